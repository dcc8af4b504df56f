"""The verify pass's attention (`verify_attention.py`): every kernel exact, the full tier in chunks merged exactly,
staging bounded in context, and decoding with each identical to stock `generate`."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import vericache_hf
from vericache_hf import VeriCache
from vericache_hf.compat import cache_kwargs
from vericache_hf.compressors import build_compressor
from vericache_hf.serving.admission import footprint
from vericache_hf.verify_attention import KERNELS, VerifyPass

from .conftest import random_prompt, tiny_model


class _Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.layer_idx, self.num_key_value_groups, self.is_causal = 0, groups, True


def _inputs(batch=3, heads=8, kv_heads=2, stored=301, queries=9, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, queries, dim, generator=generator, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, stored + queries, dim, generator=generator, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, stored + queries, dim, generator=generator, dtype=torch.float64)
    allowed = (
        torch.ones(queries, stored + queries, dtype=torch.bool)
        .tril(stored)[None, None]
        .repeat(batch, 1, 1, 1)
    )
    return query, key, value, allowed


def _stock(module, query, key, value, mask, dropout=0.0, **kwargs):
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, **kwargs)


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k != "auto"])
@pytest.mark.parametrize("ragged", [False, True])
def test_every_kernel_equals_sdpa(kernel, ragged):
    """Dense and ragged blocks (rows with masked cached slots): each kernel, or sdpa where it cannot serve one."""
    query, key, value, allowed = _inputs()
    if ragged:
        allowed[1, :, :, :40] = False  # left padding
        allowed[2, :, :, 100:300:7] = False  # slots this row rejected
    module = _Layer(4)
    expected, _ = _stock(module, query, key, value, allowed, scaling=0.25)
    got, _ = VerifyPass(kernel=kernel, dense=not ragged).attend(
        module, query, key, value, allowed, _stock, scaling=0.25
    )
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 64, 100, 301, 512])
@pytest.mark.parametrize("float_mask", [False, True])
def test_chunks_merged_by_log_sum_exp_equal_one_softmax(chunk, float_mask):
    """The full tier in chunks, merged by their log-sum-exp, equals attention over it whole, with rows that see no
    key of a chunk (left padding longer than a chunk) and an additive float mask (eager attention's) alike."""
    stored = 301
    query, key, value, allowed = _inputs(stored=stored)
    allowed[0, :, :, :130] = False
    allowed[2, :, :, 50:200:3] = False
    module = _Layer(4)
    expected, _ = _stock(module, query, key, value, allowed, scaling=0.25)

    def chunks(_layer):
        for start in range(0, stored, chunk):
            yield key[:, :, start : start + chunk], value[:, :, start : start + chunk]

    mask = allowed
    if float_mask:
        mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(
            ~allowed, torch.finfo(torch.float64).min
        )
    verify = VerifyPass(chunks=chunks, streamed={0})
    got, _ = verify.attend(
        module, query, key[:, :, stored:], value[:, :, stored:], mask, _stock, scaling=0.25
    )
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)
    assert verify.served == {0}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kernel", ["auto", "lower_right", "flex"])
@pytest.mark.parametrize("chunk", [None, 24, 4096])
def test_staged_verify_passes_decode_as_stock(family, kernel, chunk):
    """The accelerator's path on a CPU (`stage_on_cpu`), whole layers (None), chunks far shorter than the prompt
    (24) and one chunk holding it all: a left-padded batch decodes exactly as stock generate."""
    model = tiny_model(family, seed=1)
    ids = random_prompt(90, batch=3, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :40] = 0
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    stats = vericache_hf.VeriCacheStats()
    config = vericache_hf.VeriCacheConfig(
        compressor="snapkv",
        draft_length=5,
        draft_schedule="fixed",
        stage_on_cpu=True,
        staging_chunk_tokens=chunk,
        verify_attention=kernel,
        stats=stats,
    )
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=24, do_sample=False, generation_mode="vericache",
        vericache_config=config,
    )  # fmt: skip
    assert torch.equal(out, stock)
    assert stats.accepted_tokens > 0
    verify_passes = stats.rounds + stats.plain_rounds
    layers = model.config.num_hidden_layers
    if chunk == 24:  # every layer in several chunks, every pass
        assert stats.chunk_transfers >= 4 * layers * verify_passes
    else:
        assert stats.chunk_transfers == layers * verify_passes


def _staging_peak(model, tokens: int, chunk: int | None) -> tuple[int, bool]:
    ids = random_prompt(tokens, seed=tokens)
    stock = model.generate(ids, max_new_tokens=8, do_sample=False)
    stats = vericache_hf.VeriCacheStats()
    config = vericache_hf.VeriCacheConfig(
        compressor="streaming_llm",
        draft_length=3,
        draft_schedule="fixed",
        stage_on_cpu=True,
        staging_chunk_tokens=chunk,
        stats=stats,
    )
    out = model.generate(
        ids, max_new_tokens=8, do_sample=False, generation_mode="vericache", vericache_config=config
    )
    return stats.peak_staging_bytes, torch.equal(out, stock)


def test_staging_does_not_grow_with_context():
    """The full tier's staging peak at 8k tokens is at most 1.2x that at 2k (chunks of the default size), with
    every output identical; staging whole layers, it grows with the context (what the chunks save)."""
    model = tiny_model("llama", seed=2, max_position_embeddings=8300)
    chunk = vericache_hf.VeriCacheConfig.staging_chunk_tokens
    short, short_same = _staging_peak(model, 2048, chunk)
    long, long_same = _staging_peak(model, 8192, chunk)
    assert short_same and long_same
    assert long <= 1.2 * short
    whole_short, _ = _staging_peak(model, 2048, None)
    whole_long, whole_same = _staging_peak(model, 8192, None)
    assert whole_same
    assert whole_long >= 3.5 * whole_short


def test_a_streamed_pass_outside_the_pass_model_raises():
    """A verify pass whose attention is not VeriCache's would attend to the block's own tokens alone where the
    full tier arrives in chunks (a one-token pass has no mask whose size would give it away): the cache refuses
    the pass rather than return that."""
    model = tiny_model("llama", seed=3)
    ids = random_prompt(60, seed=3)
    cache = VeriCache(
        model.config.num_hidden_layers, build_compressor("streaming_llm", 0.5), stage_on_cpu=True,
        staging_chunk_tokens=16,
    )  # fmt: skip
    with torch.no_grad():
        with cache.prefilling(model, torch.ones_like(ids)):
            model(ids, **cache_kwargs(model, cache), use_cache=True)
        block = random_prompt(1, seed=4)
        with pytest.raises(RuntimeError, match="pass_model"), cache.verifying():
            model(
                block,
                position_ids=torch.tensor([[60]]),
                **cache_kwargs(model, cache),
                use_cache=True,
            )
    cache.close()


def test_admission_counts_the_staging_it_will_hold():
    """A request's device bytes count its staging buffers as the cache will allocate them: chunks of a fixed
    size, or whole layers a quarter longer than the context."""
    model = tiny_model("llama", seed=4)
    chunked = vericache_hf.VeriCacheConfig(compressor="streaming_llm", staging_chunk_tokens=256)
    whole = vericache_hf.VeriCacheConfig(compressor="streaming_llm", staging_chunk_tokens=None)
    at = {
        n: (footprint(model, chunked, n, 64, True), footprint(model, whole, n, 64, True))
        for n in (2048, 8192)
    }
    draft = {n: footprint(model, chunked, n, 64, False).device_bytes for n in at}
    staging = {n: (c.device_bytes - draft[n], w.device_bytes - draft[n]) for n, (c, w) in at.items()}
    assert staging[2048][0] == staging[8192][0]
    assert staging[8192][1] > 3.5 * staging[2048][1]


def test_a_bad_kernel_name_is_refused():
    with pytest.raises(ValueError, match="verify_attention"):
        vericache_hf.VeriCacheConfig(verify_attention="fast")
    with pytest.raises(ValueError, match="staging_chunk_tokens"):
        vericache_hf.VeriCacheConfig(staging_chunk_tokens=0)
