"""The full tier off the device: chunk-wise streaming for verification, prefetch during drafting, bounded device
memory, measured transfers, and failures that surface in `generate` without leaving a thread behind."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from vericache_hf import VeriCache, VeriCacheConfig
from vericache_hf.cache.full_tier import HostSnapshot
from vericache_hf.cache.staging import buffer_tokens
from vericache_hf.cache.transfer import TransferError
from vericache_hf.compressors import build_compressor

from .conftest import no_worker_left, random_prompt, tiny_model, vericache_dict

HEADS, KEY_DIM, VALUE_DIM = 2, 8, 8


CHUNK = 128


def prefilled(layers: int, tokens: int, buffers: int = 2, batch: int = 1, seed: int = 0):
    """A cache after prefill of random K/V (no model): returns it and each layer's prompt keys/values."""
    generator = torch.Generator().manual_seed(seed)
    cache = VeriCache(
        layers,
        build_compressor("streaming_llm", 0.75),
        chunk_tokens=CHUNK,
        staging_buffers=buffers,
        transfer_timeout=30,
        stage_on_cpu=True,  # the accelerator's path: staging buffers and the transfer thread
    )
    cache.start(torch.ones(batch, tokens, dtype=torch.long))
    prompt = []
    for layer in range(layers):
        keys = torch.randn(batch, HEADS, tokens, KEY_DIM, generator=generator)
        values = torch.randn(batch, HEADS, tokens, VALUE_DIM, generator=generator)
        cache.update(keys, values, layer)
        prompt.append((keys, values))
    cache.mode = "draft"
    return cache, prompt


def verify_pass(cache: VeriCache, prompt, new_tokens: int = 5) -> None:
    """Run the verify side of every layer in order, as attention does: the update keeps the new tokens, and the
    stored ones arrive chunk by chunk; check they are exactly the prompt's, in order."""
    cache.set_mode("verify")
    batch = prompt[0][0].shape[0]
    for layer, (keys, values) in enumerate(prompt):
        new_keys = torch.randn(batch, HEADS, new_tokens, KEY_DIM)
        new_values = torch.randn(batch, HEADS, new_tokens, VALUE_DIM)
        got_keys, _ = cache.update(new_keys, new_values, layer)
        assert got_keys is new_keys
        chunks = [(k.clone(), v.clone(), valid) for k, v, valid in cache.chunks_for_verify(layer)]
        assert all(k.shape[-2] <= CHUNK and valid.shape == k.shape[::2][:2] for k, _, valid in chunks)
        assert torch.equal(torch.cat([k for k, _, _ in chunks], dim=2), keys)
        assert torch.equal(torch.cat([v for _, v, _ in chunks], dim=2), values)


def layer_bytes(tokens: int, batch: int = 1) -> int:
    return batch * HEADS * tokens * (KEY_DIM + VALUE_DIM) * 4


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_verify_streams_every_layer_through_a_bounded_set_of_buffers(buffers):
    cache, prompt = prefilled(layers=5, tokens=300, buffers=buffers, batch=2)
    cache.prefetch_for_verify()
    verify_pass(cache, prompt)
    verify_pass(cache, prompt)  # a second pass without a commit re-stages the round
    assert len(cache.transfers.buffers.pairs) == buffers
    assert cache.staging_bytes() == buffers * layer_bytes(CHUNK, batch=2)
    assert cache.stats.chunk_transfers == 2 * 5 * 3  # two passes, five layers, three chunks of 300 tokens
    assert cache.stats.bytes_to_device == 10 * layer_bytes(300, batch=2)
    cache.close()


def test_prefetch_during_drafting_makes_the_first_chunks_resident_before_verify():
    cache, prompt = prefilled(layers=4, tokens=200)
    cache.prefetch_for_verify()
    (first, second), (third, _) = cache.verify_round[:2]
    assert first.done.wait(10) and second.done.wait(10)
    assert (first.state, second.state, third.state) == ("ready", "ready", "backlog")  # two buffers, no more
    with pytest.raises(RuntimeError, match="in flight"):
        cache.layers[0].full.truncate(100)  # the store may not shrink under a transfer
    verify_pass(cache, prompt, new_tokens=3)
    assert cache.verify_round[0][0] is first  # the prefetched transfers were the ones read
    cache.close()


@pytest.mark.parametrize("layers", [4, 8])
def test_full_tier_device_bytes_are_the_same_at_8k_and_32k(layers):
    """Accounting (B*H*T*D*bytes): the full tier on the device is two chunk buffers at 8k and at 32k tokens, for
    4 layers and for 8; the full KV cache a DynamicCache would keep on the device is `layers` whole layers."""
    for context in (8192, 32768):
        cache, prompt = prefilled(layers=layers, tokens=context)
        cache.prefetch_for_verify()
        verify_pass(cache, prompt, new_tokens=17)
        assert cache.stats.peak_staging_bytes == 2 * layer_bytes(CHUNK)
        assert cache.full_tier_bytes() == layers * layer_bytes(context)  # host memory
        assert cache.stats.bytes_to_device == layers * layer_bytes(context)  # all of it streamed through
        cache.close()


@pytest.mark.slow
def test_generate_at_8k_and_32k_matches_stock_with_the_same_full_tier_device_bytes():
    """End to end in float64: the verify pass attends over 4 and 16 streamed chunks and merges them exactly enough
    that greedy output equals stock `generate` on the full cache; the full tier's device bytes do not change."""
    model = tiny_model("llama", max_position_embeddings=33000)
    config = VeriCacheConfig(compressor="streaming_llm", compression_ratio=0.875, stage_on_cpu=True)
    staging = {}
    for context in (8192, 32768):
        ids = random_prompt(context, seed=context)
        expected = stock(model, ids, max_new_tokens=10)
        out = vericache_dict(model, ids, config=config, max_new_tokens=10)
        assert torch.equal(out.sequences, expected)
        stats = out.vericache_stats
        assert stats.chunk_transfers >= context // 2048 * model.config.num_hidden_layers
        staging[context] = stats.peak_staging_bytes
        assert stats.full_tier_bytes > 3 * staging[context]  # more is off the device than on it
    assert staging[8192] == staging[32768] > 0


def stock(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, **kwargs)


def vericache(model, ids, **kwargs):
    config = VeriCacheConfig(
        compressor="streaming_llm", compression_ratio=0.75, draft_length=8, stage_on_cpu=True
    )
    return model.generate(
        ids, do_sample=False, generation_mode="vericache", vericache_config=config, **kwargs
    )


@pytest.fixture(scope="module")
def deep_llama():
    return tiny_model("llama", num_hidden_layers=6)


def test_generate_streams_the_full_tier_and_reports_the_transfers(deep_llama):
    ids = random_prompt(100, batch=2, seed=11)
    expected = stock(deep_llama, ids, max_new_tokens=16, return_dict_in_generate=True)
    out = vericache(deep_llama, ids, max_new_tokens=16, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)
    stats, cache = out.vericache_stats, out.past_key_values
    layers = deep_llama.config.num_hidden_layers
    assert stats.chunk_transfers > 0 and stats.chunk_transfers % layers == 0
    assert stats.bytes_to_device > 0 and stats.transfer_seconds > 0
    assert 0.0 <= stats.transfer_hidden_share <= 1.0
    # Device to host: the prompt, then only accepted tokens -- exactly what the full tier holds.
    assert stats.bytes_to_host == cache.full_tier_bytes() == stats.full_tier_bytes
    # Peak device memory of the request against full-KV decoding's DynamicCache.
    full_kv = sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in expected.past_key_values.layers
    )
    kv_tokens = expected.past_key_values.layers[0].keys.shape[-2]
    token_bytes = full_kv // (layers * kv_tokens)  # one token of one layer
    assert stats.peak_staging_bytes == 2 * token_bytes * buffer_tokens(
        kv_tokens, out.past_key_values.chunk_tokens
    )
    assert 0 < stats.peak_draft_tier_bytes + stats.peak_staging_bytes < full_kv
    assert no_worker_left()


def test_on_cpu_the_verify_pass_reads_the_full_tier_in_place_by_default(deep_llama):
    """The default on a CPU: the same output as stock, every chunk read where it lies, no copy and no thread."""
    ids = random_prompt(300, batch=2, seed=12)
    config = VeriCacheConfig(compressor="streaming_llm", compression_ratio=0.75, chunk_tokens=128)
    out = vericache_dict(deep_llama, ids, config=config, max_new_tokens=16)
    assert torch.equal(out.sequences, stock(deep_llama, ids, max_new_tokens=16))
    stats = out.vericache_stats
    assert stats.chunk_transfers >= 3 * deep_llama.config.num_hidden_layers  # 3 chunks a layer, each round
    assert stats.bytes_to_device == stats.peak_staging_bytes == 0
    assert out.past_key_values.transfers._last_thread is None


def test_a_transfer_failure_raises_from_generate_and_the_next_call_works(deep_llama, monkeypatch):
    ids = random_prompt(80, seed=13)
    original = HostSnapshot.copy_chunk_into
    calls = []

    def failing_copy(self, chunk, keys_out, values_out):
        calls.append(1)
        if len(calls) == 9:  # layer 2 of the second verify pass (one chunk a layer)
            raise OSError("injected transfer failure")
        return original(self, chunk, keys_out, values_out)

    monkeypatch.setattr(HostSnapshot, "copy_chunk_into", failing_copy)
    with pytest.raises(TransferError, match="injected transfer failure"):
        vericache(deep_llama, ids, max_new_tokens=40)
    assert len(calls) == 9 and no_worker_left()
    monkeypatch.setattr(HostSnapshot, "copy_chunk_into", original)
    assert torch.equal(
        vericache(deep_llama, ids, max_new_tokens=20), stock(deep_llama, ids, max_new_tokens=20)
    )
    assert no_worker_left()


def test_the_gpu_benchmark_runs_its_cpu_dry_run(tmp_path):
    path = Path(__file__).parents[1] / "benchmarks" / "gpu_offload.py"
    spec = importlib.util.spec_from_file_location("gpu_offload", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    rows = bench.main(["--dry-run", "--batches", "2", "--json", str(out)])
    (row,) = rows
    assert row["vericache"]["tokens_per_s"] > 0 and row["full_kv"]["tokens_per_s"] > 0
    # Accounting on CPU: draft tier + two staging buffers against the whole KV cache of 6 layers.
    assert row["vericache"]["device_bytes"] < row["full_kv"]["device_bytes"]
    # Device to host per round: only the k + 1 accepted tokens (batch 2, 6 layers, 2 KV heads, K+V dims 8+8, fp32).
    assert row["vericache"]["bytes_to_host"] == 2 * 6 * 2 * (8 + 8) * (3 + 1) * 4
    assert json.loads(out.read_text()) == rows


def test_generate_under_inference_mode_matches_stock():
    """The transfer worker writes into buffers the caller made, also when the caller runs under inference_mode."""
    model = tiny_model("llama")
    ids = random_prompt(40, seed=11)
    expected = model.generate(ids, max_new_tokens=20, do_sample=False)
    with torch.inference_mode():
        got = model.generate(
            ids,
            max_new_tokens=20,
            do_sample=False,
            generation_mode="vericache",
            vericache_config=VeriCacheConfig(stage_on_cpu=True),
        )
    assert torch.equal(got, expected)


def test_staging_buffers_and_chunk_size_come_from_the_config(deep_llama):
    ids = random_prompt(300, batch=2, seed=5)
    config = VeriCacheConfig(
        compressor="streaming_llm", chunk_tokens=64, staging_buffers=3, stage_on_cpu=True
    )
    out = vericache_dict(deep_llama, ids, config=config, max_new_tokens=12)
    assert torch.equal(out.sequences, stock(deep_llama, ids, max_new_tokens=12))
    cfg = deep_llama.config
    token_bytes = (
        2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2 * 8
    )  # B=2, f64
    assert out.vericache_stats.peak_staging_bytes == 3 * 64 * token_bytes
    assert out.past_key_values.transfers.buffers.num_buffers == 3


@pytest.mark.parametrize(
    "field, value",
    [("staging_buffers", 0), ("chunk_tokens", -1), ("transfer_timeout", 0), ("chunk_tokens", 1.5)],
)
def test_bad_transfer_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        VeriCacheConfig(**{field: value})


@pytest.mark.parametrize("kernel", ["fused", "matmul"])
@pytest.mark.parametrize("chunk", [1, 7, 64, 500])
def test_streamed_attention_equals_sdpa_over_the_whole_sequence(chunk, kernel, monkeypatch):
    """The chunked log-sum-exp merge against torch's own attention on the concatenated K/V, with GQA, padding and
    a row whose first chunk is entirely masked; through torch's fused CPU kernel and through the plain matmul path
    other devices take."""
    from vericache_hf.cache import attention
    from vericache_hf.cache.attention import streamed_attention

    if kernel == "matmul":
        monkeypatch.setattr(attention, "_FUSED_CPU", None)

    generator = torch.Generator().manual_seed(chunk)
    batch, heads, kv_heads, stored, new, dim = 2, 6, 2, 300, 9, 16
    query = torch.randn(batch, heads, new, dim, generator=generator, dtype=torch.float64)
    keys = torch.randn(batch, kv_heads, stored + new, dim, generator=generator, dtype=torch.float64)
    values = torch.randn(batch, kv_heads, stored + new, dim, generator=generator, dtype=torch.float64)
    valid = torch.ones(batch, stored, dtype=torch.bool)
    valid[1, :130] = False  # left padding longer than a chunk
    valid[0, 200:210] = False  # slots a row rejected

    def chunks(layer_idx):
        for start in range(0, stored, chunk):
            span = slice(start, min(stored, start + chunk))
            yield keys[:, :, span], values[:, :, span], valid[:, span]

    module = torch.nn.Module()
    module.layer_idx = 0
    got, _ = streamed_attention(
        module, query, keys[:, :, stored:], values[:, :, stored:], None, scaling=0.3, vericache_chunks=chunks
    )
    mask = torch.cat(
        [
            valid[:, None, :].expand(batch, new, stored),
            torch.ones(new, new).tril().bool()[None].expand(batch, -1, -1),
        ],
        dim=-1,
    )
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask[:, None], scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(got, expected.transpose(1, 2), rtol=1e-12, atol=1e-12)
