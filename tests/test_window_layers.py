"""Sliding-window layers of a model that has full-attention layers too (Gemma 2/3/4, Cohere2, GPT-OSS, Exaone4)
keep one exact tier on the device, bounded by the window, read by draft and verify passes alike; only the
full-attention layers have a draft tier and a full tier. Every output is compared with stock `generate` on the
full cache, on tiny random models (float64, or float32 where grouped matmuls refuse it), with answers long enough
that the windows are trimmed while rows accept different counts."""

from __future__ import annotations

import pytest
import torch

from vericache_hf import RequestStatus, VeriCacheConfig, VeriCacheStats
from vericache_hf.cache.window import WindowLayer, held_slots
from vericache_hf.decoding import _build_cache
from vericache_hf.layer_plan import layer_plan, window_layers
from vericache_hf.prefix import DiskStore
from vericache_tools.families import prompts, stock_greedy, vericache_greedy
from vericache_tools.families import tiny_model as family_model

from .test_cohorts import serve
from .test_engine import stock

NEW_TOKENS = 100  # the tiny models' window is 16 tokens: each row's window moves on several times over
FAMILIES = {
    "gemma3_text": torch.float64,
    "gemma2": torch.float64,
    "cohere2": torch.float64,
    "gpt_oss": torch.float32,
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def windowed(request):
    return family_model(request.param).to(FAMILIES[request.param])


def vericache(model, inputs, stats, **settings):
    return vericache_greedy(model, inputs, NEW_TOKENS, stats=stats, **{"compression_ratio": 0.875} | settings)


def test_the_sliding_layers_of_a_mixed_model_are_window_layers(windowed):
    plans = layer_plan(windowed)
    windows = window_layers(plans)
    assert windows and set(windows) == {plan.index for plan in plans if plan.kind == "sliding_attention"}
    _, cache = _build_cache(windowed, VeriCacheConfig(compressor="snapkv"), VeriCacheStats())
    assert [layer.layer_idx for layer in cache.windowed] == sorted(windows)
    assert all(isinstance(cache.layers[i], WindowLayer) for i in windows)
    assert len(cache.tiered) == len(plans) - len(windows)


@pytest.mark.parametrize("batch", [1, 3])
def test_window_layers_match_stock_with_ragged_rows(windowed, batch):
    """A left-padded batch whose rows accept different counts in some round (masked slots inside the windows),
    and a lossy draft tier on the full-attention layers."""
    inputs = prompts(batch)
    expected = stock_greedy(windowed, inputs, NEW_TOKENS)
    stats = VeriCacheStats()
    assert torch.equal(vericache(windowed, inputs, stats), expected)
    assert stats.accepted_tokens > 0 and stats.window_tier_bytes > 0
    if batch > 1:
        assert stats.ragged_rounds > 0


@pytest.mark.parametrize("batch", [1, 3])
def test_a_draft_pass_reads_each_layout_where_its_layers_expect_it(batch):
    """With every prompt token kept in the draft tier, a draft pass is the model itself, so the verify pass accepts
    every draft. Prompt-lookup proposals that the draft tier rejects leave masked drafted slots in both layouts of
    the draft pass's mask (the draft tier's and the windows'); a window part placed off by a slot drafts wrong."""
    model = family_model("gemma3_text").to(torch.float64)
    inputs = prompts(batch)
    expected = stock_greedy(model, inputs, NEW_TOKENS)
    stats = VeriCacheStats()
    got = vericache_greedy(
        model,
        inputs,
        NEW_TOKENS,
        stats=stats,
        compression_budget=1000,
        proposer="prompt_lookup",
        proposal_length=3,
    )
    assert torch.equal(got, expected)
    assert stats.proposed_tokens > stats.proposal_kept_tokens > 0  # some drafted slots were masked
    assert stats.acceptance_rate == 1.0


def test_the_window_tier_stays_bounded_as_the_context_grows():
    """Prompts of 70 and 400 tokens: the draft tier grows with the prompt, the window layers' buffers do not, and
    they hold no more than a window, a trim's slack and a round's tokens."""
    model = family_model("gemma3_text").to(torch.float64)
    text = model.config
    token = 2 * text.num_key_value_heads * text.head_dim * model.dtype.itemsize
    sizes = {}
    for length in (70, 400):
        ids = torch.randint(3, 120, (1, length), generator=torch.Generator().manual_seed(length))
        stats = VeriCacheStats()
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        expected = stock_greedy(model, inputs, NEW_TOKENS)
        assert torch.equal(vericache(model, inputs, stats, compression_ratio=0.5), expected)
        sizes[length] = stats
    windows = text.layer_types.count("sliding_attention")
    assert sizes[70].window_tier_bytes == sizes[400].window_tier_bytes
    assert sizes[400].window_tier_bytes <= windows * token * held_slots(text.sliding_window, 5)
    assert sizes[400].window_tier_bytes < windows * token * 400 // 2  # far less than the prompt
    assert sizes[400].draft_tier_bytes > 2 * sizes[70].draft_tier_bytes


def test_a_draft_model_of_another_float_type_reads_the_windows_in_its_own():
    model = family_model("gemma3_text").to(torch.float64)
    inputs = prompts(3)
    expected = stock_greedy(model, inputs, NEW_TOKENS)
    stats = VeriCacheStats()
    assert torch.equal(vericache(model, inputs, stats, draft_dtype="float32"), expected)
    assert stats.accepted_tokens > 0


@pytest.mark.parametrize("compressor", ["snapkv", "streaming_llm"], ids=["carried", "rebuilt"])
def test_cohorts_join_and_split_window_layers_exactly(compressor):
    """Requests of different lengths share passes: rows join a running cohort and leave it, and each window
    layer's rows move with the full tier's; every output equals stock's."""
    model = family_model("gemma3_text").to(torch.float64)
    generator = torch.Generator().manual_seed(7)
    inputs = [torch.randint(3, 120, (30 + 17 * i,), generator=generator).tolist() for i in range(5)]
    new_tokens = [60, 24, 48, 12, 36]
    config = VeriCacheConfig(compressor=compressor, compression_ratio=0.75, draft_length=4)
    with pytest.warns(UserWarning, match="prefills every prompt whole"):
        outs, shared = serve(model, inputs, config, new_tokens)
    for out, prompt, count in zip(outs, inputs, new_tokens, strict=True):
        assert out.status == RequestStatus.FINISHED, out.error
        assert out.generated_tokens == stock(model, prompt, count)
    assert shared["most_rows_per_round"] >= 2


def test_a_prefix_store_is_refused_for_window_layers(tmp_path):
    model = family_model("gemma3_text").to(torch.float64)
    config = VeriCacheConfig(compressor="snapkv", prefix_store=DiskStore(tmp_path))
    with pytest.raises(ValueError, match="sliding-window layers .* prefix_store"):
        model.generate(**prompts(1), max_new_tokens=4, generation_mode="vericache", vericache_config=config)


def test_a_model_whose_every_layer_slides_keeps_two_tiers():
    """With no full-attention layer, compressing the windows is the only saving drafting has: they keep two tiers."""
    model = family_model("mistral")
    assert {plan.kind for plan in layer_plan(model)} == {"sliding_attention"}
    assert window_layers(layer_plan(model)) == {}
