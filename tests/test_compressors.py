"""Every compressor passes the same tests: draft-tier invariants, and float64 greedy exactness against stock
`generate` (batch 1, and a left-padded batch). A new compressor gets one line in REGISTRY."""

from __future__ import annotations

import pytest
import torch

from vericache_hf import VeriCacheConfig
from vericache_hf.cache.refresh import RefreshClock, RefreshPolicy, check_refreshable, refresh_draft_tier
from vericache_hf.compressors import (
    BitsAndBytesCompressor,
    ComposedCompressor,
    FP8Compressor,
    H2OCompressor,
    HQQCompressor,
    KIVICompressor,
    KnormCompressor,
    QuantoCompressor,
    SnapKVCompressor,
    StreamingLLMCompressor,
    build_compressor,
)
from vericache_hf.compressors.base import CompressionContext
from vericache_hf.compressors.quantized import require
from vericache_tools.lossy import compressed_only_generate, first_divergence

from .conftest import random_prompt
from .conftest import vericache_dict as vericache

SMALL = {"group_size": 8, "residual_length": 4}  # quantize during a short test run, not only at prefill

#: (id, compressor factory). Quantizers use small groups so that committed tokens really get quantized.
REGISTRY = [
    ("streaming_llm", lambda: StreamingLLMCompressor(0.75)),
    ("snapkv", lambda: SnapKVCompressor(0.75, window_size=8)),
    ("knorm", lambda: KnormCompressor(0.5)),
    ("h2o", lambda: H2OCompressor(0.75, recent_size=8, chunk_size=16)),
    ("snapkv_budget", lambda: SnapKVCompressor(budget=12, window_size=4)),
    ("kivi2", lambda: KIVICompressor(bits=2, **SMALL)),
    ("kivi4", lambda: KIVICompressor(bits=4, **SMALL)),
    ("fp8", lambda: FP8Compressor(**SMALL)),
    ("hqq1", lambda: HQQCompressor(bits=1, **SMALL)),
    ("hqq3", lambda: HQQCompressor(bits=3, **SMALL)),
    ("hqq8", lambda: HQQCompressor(bits=8, **SMALL)),
    ("bnb_nf4", lambda: BitsAndBytesCompressor(quant_type="nf4", **SMALL)),
    ("bnb_fp4", lambda: BitsAndBytesCompressor(quant_type="fp4", **SMALL)),
    ("bnb_int8", lambda: BitsAndBytesCompressor(quant_type="int8", **SMALL)),
    ("snapkv+kivi4", lambda: [SnapKVCompressor(0.75, window_size=8), KIVICompressor(bits=4, **SMALL)]),
    (
        "knorm+streaming+hqq2",
        lambda: [KnormCompressor(0.5), StreamingLLMCompressor(0.5), HQQCompressor(bits=2, **SMALL)],
    ),
    pytest.param("quanto2", lambda: QuantoCompressor(bits=2, **SMALL), marks=pytest.mark.slow),
    pytest.param("quanto4", lambda: QuantoCompressor(bits=4, **SMALL), marks=pytest.mark.slow),
]
IDS = [entry.values[0] if hasattr(entry, "values") else entry[0] for entry in REGISTRY]


def stock(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, **kwargs)


@pytest.mark.parametrize(("name", "factory"), REGISTRY, ids=IDS)
def test_matches_stock_and_keeps_the_draft_tier_consistent(llama, name, factory):
    ids = random_prompt(48, seed=11)
    out = vericache(llama, ids, factory(), max_new_tokens=32)
    assert torch.equal(out.sequences, stock(llama, ids, max_new_tokens=32)), name
    stats, cache = out.vericache_stats, out.past_key_values
    assert 0 < stats.draft_tier_bytes < stats.full_tier_bytes, name
    slots = {layer.draft.num_committed for layer in cache.layers}
    assert len(slots) == 1, f"{name}: layers hold different slot counts {slots}"
    for layer in cache.layers:
        store = layer.draft
        assert store.valid.shape == (1, store.num_committed)
        # Drafted tokens are uncommitted: a rollback restores exactly the committed view.
        empty = torch.zeros((1, llama.config.num_key_value_heads, 0, 16), dtype=torch.float64)
        committed_keys, committed_values = store.extend_draft(empty, empty)
        store.rollback_draft()
        noise = torch.randn((1, llama.config.num_key_value_heads, 3, 16), dtype=torch.float64)
        drafted_keys, _ = store.extend_draft(noise, noise)
        assert drafted_keys.shape[-2] == committed_keys.shape[-2] + 3
        assert torch.equal(drafted_keys[:, :, -3:], noise)
        store.rollback_draft()
        again_keys, again_values = store.extend_draft(empty, empty)
        store.rollback_draft()
        assert torch.equal(again_keys, committed_keys) and torch.equal(again_values, committed_values)


@pytest.mark.parametrize(
    ("name", "factory"), [entry for entry in REGISTRY if not hasattr(entry, "marks")][::3], ids=IDS[:16][::3]
)
def test_left_padded_batch_matches_stock(llama, name, factory):
    ids = random_prompt(40, batch=2, seed=12)
    mask = torch.ones_like(ids)
    ids[1, :9], mask[1, :9] = 0, 0
    expected = stock(llama, ids, attention_mask=mask, max_new_tokens=24)
    out = vericache(llama, ids, factory(), attention_mask=mask, max_new_tokens=24)
    assert torch.equal(out.sequences, expected), name


def test_budget_keeps_that_many_tokens(llama):
    ids = random_prompt(60, seed=13)
    # built in the prefill, as on an accelerator (on the CPU, a draft that needs it would build it)
    config = VeriCacheConfig(compressor="snapkv", draft_schedule="fixed", stage_on_cpu=True)
    out = vericache(llama, ids, config=config, max_new_tokens=1)
    assert out.past_key_values.layers[0].draft.num_committed == 15  # a quarter of 60 at the default ratio
    config = VeriCacheConfig(compressor="knorm", compression_budget=10)
    cache = llama.generate(
        ids,
        do_sample=False,
        max_new_tokens=1,
        generation_mode="vericache",
        vericache_config=config,
        return_dict_in_generate=True,
    ).past_key_values
    assert not cache.draft_tier.held  # a K/V-only tier on the CPU waits for a draft that needs it: none did
    cache.draft_tier.build()
    assert {layer.draft.num_committed for layer in cache.layers} == {10}


def test_bad_configurations_are_rejected_clearly():
    with pytest.raises(ValueError, match="compression_budget"):
        VeriCacheConfig(compression_budget=0)
    with pytest.raises(ValueError, match="quantizes"):
        build_compressor("kivi", 0.75, budget=32)
    with pytest.raises(ValueError, match="does not drop tokens"):
        ComposedCompressor(stages=[KIVICompressor(bits=4), SnapKVCompressor(0.5)])
    with pytest.raises(ValueError, match="only the first"):
        ComposedCompressor(stages=[KnormCompressor(0.5), SnapKVCompressor(0.5)])
    with pytest.raises(ValueError, match="bits"):
        HQQCompressor(compression_ratio=0.6)
    with pytest.raises(ValueError, match="quant_type"):
        BitsAndBytesCompressor(quant_type="nf3")
    with pytest.raises(ImportError, match=r"vericache-hf\[hqq\]"):
        require("a_backend_that_is_not_installed", "hqq", "hqq")


def test_compressed_only_decoding_is_exact_without_compression_and_lossy_with_it(llama):
    ids = random_prompt(60, seed=14)
    reference = stock(llama, ids, max_new_tokens=20, min_new_tokens=20)
    lossless = compressed_only_generate(llama, ids, SnapKVCompressor(0.0), 20)
    assert torch.equal(lossless, reference)
    lossy = compressed_only_generate(llama, ids, "streaming_llm", 20, compression_ratio=0.9)
    assert lossy.shape == reference.shape
    assert first_divergence(reference, lossy, 60) < 20  # this prompt's output does change when 90% is dropped


def test_refresh_keeps_output_exact(llama):
    policy = RefreshPolicy(every_tokens=8)
    ids = random_prompt(50, seed=15)
    config = VeriCacheConfig(compressor=KnormCompressor(0.5), refresh=policy)
    out = vericache(llama, ids, config=config, max_new_tokens=40)
    assert torch.equal(out.sequences, stock(llama, ids, max_new_tokens=40))
    assert out.vericache_stats.draft_tier_refreshes >= 2
    cache = out.past_key_values
    refresh_draft_tier(cache)
    assert cache.layers[0].draft.num_committed == -(-cache.layers[0].full.length // 2)


def test_refresh_with_a_query_aware_compressor_is_refused(llama):
    config = VeriCacheConfig(compressor="snapkv", refresh=RefreshPolicy(every_tokens=8))
    with pytest.raises(ValueError, match="cannot be refreshed"):
        llama.generate(
            random_prompt(20), max_new_tokens=4, generation_mode="vericache", vericache_config=config
        )


def test_refresh_policy_triggers_and_rejects():
    clock = RefreshClock(RefreshPolicy(min_accepted=2.0, window_rounds=2))
    assert not clock.due(3, 1.0) and not clock.due(1, None) and clock.due(3, 1.0)  # None: drafted nothing
    with pytest.raises(ValueError, match="every_tokens, min_accepted"):
        RefreshPolicy()
    with pytest.raises(ValueError, match="cannot be refreshed"):
        check_refreshable(SnapKVCompressor(0.5))


@pytest.mark.parametrize(
    "factory",
    [lambda: KIVICompressor(bits=2, **SMALL), lambda: FP8Compressor(**SMALL)],
    ids=["kivi2", "fp8"],  # codecs whose groups are independent (HQQ's optimiser and bnb's blocks are not)
)
def test_a_quantized_store_reads_each_group_as_its_codec_decodes_it(factory):
    """Committed tokens read back as the codec's round trip of their whole group (quantized once, in place, the
    groups a prompt or a commit makes ready all in one codec call), the residual exactly; the byte count is the
    quantized form plus the residual."""
    torch.manual_seed(0)
    keys, values = torch.randn(2, 1, 2, 45, 16, dtype=torch.float64)
    compressor = factory()
    codec = compressor.codec(16)
    valid = torch.ones(1, 45, dtype=torch.bool)
    store = compressor.compress(keys[:, :, :20], values[:, :, :20], CompressionContext(0, valid[:, :20]))
    for start, end in ((20, 23), (23, 45)):  # groups fill across commits
        store.commit(keys[:, :, start:end], values[:, :, start:end], valid[:, start:end])
    read_keys, read_values = store.extend_draft(keys[:, :, :0], values[:, :, :0])
    quantized = (45 - SMALL["residual_length"]) // SMALL["group_size"] * SMALL["group_size"]
    expected_bytes = 0
    for kind, exact, read in (("key", keys, read_keys), ("value", values, read_values)):
        assert torch.equal(read[:, :, quantized:], exact[:, :, quantized:])
        for start in range(0, quantized, SMALL["group_size"]):
            group = slice(start, start + SMALL["group_size"])
            block = codec.quantize(exact[:, :, group], kind)
            assert torch.equal(read[:, :, group], codec.dequantize(block, exact)), (kind, start)
            expected_bytes += codec.nbytes(block)
        expected_bytes += exact[:, :, quantized:].numel() * exact.element_size()
    assert store.nbytes() == expected_bytes


def test_the_documented_custom_compressor_runs_losslessly():
    import runpy  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    example = Path(__file__).resolve().parents[1] / "examples" / "custom_compressor.py"
    runpy.run_path(str(example), run_name="__main__")  # asserts equality with stock generate itself


def _accumulated_attention(queries, keys, valid, scaling):
    """H2O's definition, written out: each key's causal softmax weight summed over the real queries and the query
    heads of its KV head, from the whole (T x T) attention matrix."""
    (batch, heads, length, _), kv_heads = queries.shape, keys.shape[1]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)
    allowed = torch.ones(length, length, dtype=torch.bool).tril() & valid[:, None, None, :]
    weights = (queries @ keys.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf")).softmax(-1)
    weights = weights.nan_to_num(0.0) * valid[:, None, :, None]  # padding queries attend to nothing
    return weights.sum(-2).view(batch, kv_heads, -1, length).sum(2)


@pytest.mark.parametrize("path", ["flash", "chunked"])
def test_h2o_accumulates_each_keys_attention_over_the_later_real_queries(path):
    """Both ways H2O sums attention (the CPU flash kernel's two passes, and query chunks elsewhere) give the
    definition's numbers, on a left-padded batch with grouped query heads and a length no chunk divides."""
    from vericache_hf.compressors.h2o import _accumulated_flash  # noqa: PLC0415

    torch.manual_seed(0)
    queries, keys = 2 * torch.randn(2, 6, 37, 16), 2 * torch.randn(2, 2, 37, 16)
    valid = torch.ones(2, 37, dtype=torch.bool)
    valid[1, :5] = False
    compressor = H2OCompressor(chunk_size=8)
    accumulate = _accumulated_flash if path == "flash" else compressor._accumulated_chunked
    scores = accumulate(queries, keys, valid, 0.25)
    expected = _accumulated_attention(queries, keys, valid, 0.25)
    assert scores.shape == (2, 2, 37)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(scores[1, :, :5], torch.zeros(2, 5))  # padding keys get nothing


def test_snapkv_averages_each_keys_attention_over_the_window_s_real_queries():
    """SnapKV's grouped, in-place scoring gives the definition's numbers: each key's causal softmax weight from the
    last w queries, averaged over the real ones and the query heads of its KV head, from the whole attention matrix.
    A left-padded batch whose second row is padding for part of the window, and a row of padding only there."""
    from vericache_hf.compressors.snapkv import window_attention  # noqa: PLC0415

    torch.manual_seed(0)
    length, window = 37, 8
    queries, keys = 2 * torch.randn(3, 6, length, 16, dtype=torch.float64), 2 * torch.randn(3, 2, length, 16)
    keys = keys.double()
    valid = torch.ones(3, length, dtype=torch.bool)
    valid[1, :32] = False  # 5 real tokens: 3 of the window's queries are padding
    valid[2, :5] = False
    scores = window_attention(queries[:, :, -window:], keys, valid, 0.25)
    (batch, heads, _, _), kv_heads = queries.shape, keys.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool).tril() & valid[:, None, None, :]
    logits = queries @ keys.repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2) * 0.25
    weights = logits.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)[:, :, -window:]
    real = valid[:, -window:]
    expected = torch.stack([weights[row][:, real[row]].mean(1) for row in range(batch)])  # (B, H_q, T)
    expected = expected.view(batch, kv_heads, -1, length).mean(2)
    assert scores.shape == (3, 2, length)
    torch.testing.assert_close(scores, expected)
    assert torch.equal(scores[1, :, :32], torch.zeros(2, 32))  # padding keys get nothing
