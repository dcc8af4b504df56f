"""Every compressor family on the layer kinds that break query re-derivation: sliding windows with soft-capping
(Gemma 2), partial rotary (Phi, StableLM), q/k norms (OLMo 2), fused projections (GPT-NeoX), attention sinks
(GPT-OSS) and latent attention (DeepSeek V3). Each is exact against stock `generate` on a ragged left-padded batch,
or refused with a ValueError before the first token, never mid-decoding."""

from __future__ import annotations

import pytest
import torch

import vericache_hf
from vericache_tools.families import NEW_TOKENS, TokenCounter, prompts, tiny_model

FAMILIES = ["gemma2", "phi", "stablelm", "olmo2", "gpt_neox", "gpt_oss", "deepseek_v3"]


def compressors() -> dict:
    found = {
        "streaming_llm": "streaming_llm",
        "snapkv": "snapkv",
        "h2o": "h2o",
        "knorm": "knorm",
        "kivi": "kivi",
    }
    try:
        from vericache_hf.compressors.kvpress_adapter import import_kvpress

        found["kvpress SnapKVPress"] = import_kvpress().SnapKVPress(compression_ratio=0.5, window_size=8)
    except ImportError:
        pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_compressor_is_exact_or_refused_up_front(family):
    torch.set_num_threads(1)
    model = tiny_model(family)
    dtype = torch.float32 if family in ("gpt_oss", "deepseek_v3") else torch.float64  # grouped MoE matmuls
    model = model.to(dtype)
    expected = model.generate(
        **prompts(3), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS
    )
    served = 0
    for name, compressor in compressors().items():
        config = vericache_hf.VeriCacheConfig(
            compressor=compressor, compression_ratio=0.5, draft_length=4, draft_schedule="fixed"
        )
        kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        streamer = TokenCounter()
        try:
            model.generate(
                **prompts(1),
                generation_mode="vericache",
                vericache_config=config,
                streamer=streamer,
                **kwargs,
            )
        except ValueError as error:
            assert streamer.puts <= 1, f"{name} on {family} refused after decoding began: {error}"
            continue
        got = model.generate(**prompts(3), generation_mode="vericache", vericache_config=config, **kwargs)
        assert torch.equal(got, expected), f"{name} on {family} differs from stock generate"
        served += 1
    assert served >= 3, f"only {served} compressors serve {family}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["snapkv", "h2o"])
def test_query_scoring_serves_latent_attention(name):
    """DeepSeek V3 caches latents; SnapKV and H2O score the keys its attention expands from them, so they serve it
    exactly on a ragged batch rather than being refused."""
    torch.set_num_threads(1)
    model = tiny_model("deepseek_v3").to(torch.float32)
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    expected = model.generate(**prompts(3), **kwargs)
    config = vericache_hf.VeriCacheConfig(
        compressor=name, compression_ratio=0.5, draft_length=4, draft_schedule="fixed"
    )
    got = model.generate(**prompts(3), generation_mode="vericache", vericache_config=config, **kwargs)
    assert torch.equal(got, expected)


def test_latent_scores_reduce_to_the_cache_heads():
    """Scores per query head over expanded keys pick the latent cache's tokens by their mean over heads."""
    from vericache_hf.compressors.base import CompressionContext
    from vericache_hf.compressors.snapkv import SnapKVCompressor, window_attention

    torch.manual_seed(0)
    heads, length, window = 4, 24, 4
    latents = torch.randn(1, 1, length, 6)
    rope = torch.randn(1, 1, length, 2)
    expanded = torch.randn(1, heads, length, 8)
    queries = torch.randn(1, heads, window, 8)
    valid = torch.ones(1, length, dtype=torch.bool)
    context = CompressionContext(
        layer_idx=0, valid=valid, queries=queries, scaling=0.5, attention_keys=expanded
    )
    compressor = SnapKVCompressor(compression_ratio=0.5, window_size=window, kernel_size=1)
    kept, kept_rope, _ = compressor.select(latents, rope, context)
    scores = window_attention(queries, expanded, valid, 0.5).mean(1)
    scores[..., -window:] = float("inf")
    indices = scores.topk(length // 2, dim=-1).indices.sort(-1).values[0]
    assert torch.equal(kept[0, 0], latents[0, 0, indices])
    assert torch.equal(kept_rope[0, 0], rope[0, 0, indices])


@pytest.mark.parametrize("name", ["snapkv", "h2o"])
def test_probabilities_a_layer_returns_score_as_its_queries_do(name):
    """A layer that attends inline hands over its attention probabilities instead of its queries; SnapKV and H2O
    keep the same tokens from either."""
    from vericache_hf.cache.capture import QueryCapture
    from vericache_hf.compressors import build_compressor

    torch.manual_seed(0)
    batch, heads, length, dim = 2, 4, 40, 8
    queries = torch.randn(batch, heads, length, dim, dtype=torch.float64)
    keys = torch.randn(batch, heads, length, dim, dtype=torch.float64)
    values = torch.randn_like(keys)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :7] = False  # left padding
    logits = (queries @ keys.transpose(-1, -2)) * dim**-0.5
    allowed = torch.ones(length, length, dtype=torch.bool).tril() & valid[:, None, None, :]
    probabilities = logits.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    compressor = build_compressor(name, 0.5, None, **({"window_size": 8} if name == "snapkv" else {}))

    class Layer(torch.nn.Module):
        layer_idx = 0

    kept = {}
    for source in ("queries", "probabilities"):
        capture = QueryCapture(valid, last=compressor.queries_read)
        if source == "queries":
            capture.read(Layer(), queries, keys, dim**-0.5)
        else:
            capture.read_probabilities(Layer(), probabilities)
        kept[source] = compressor.select(keys, values, capture.pop(0))[0]
    assert torch.equal(kept["queries"], kept["probabilities"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_neox_japanese", "xglm"])
def test_query_scoring_serves_layers_that_attend_inline(family):
    torch.set_num_threads(1)
    model = tiny_model(family)
    model = model.to(torch.float64 if family == "gpt_neox_japanese" else torch.float32)
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    expected = model.generate(**prompts(3), **kwargs)
    for name in ("snapkv", "h2o"):
        config = vericache_hf.VeriCacheConfig(
            compressor=name, compression_ratio=0.5, draft_length=4, draft_schedule="fixed"
        )
        got = model.generate(**prompts(3), generation_mode="vericache", vericache_config=config, **kwargs)
        assert torch.equal(got, expected), name
