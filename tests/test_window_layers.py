"""Sliding-window layers of a model that has full-attention layers too (Gemma 2/3/4, Cohere2, GPT-OSS, Exaone4), and
Llama 4's chunked layers, keep one exact tier on the device, bounded by the window or chunk, read by draft and verify
passes alike; only the full-attention layers have a draft tier and a full tier. Every output is compared with stock
`generate` on the full cache, on tiny random models (float64, or float32 where grouped matmuls refuse it), with
answers long enough that the windows are trimmed and chunk boundaries crossed while rows accept different counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask

from vericache_hf import RequestStatus, VeriCacheConfig, VeriCacheStats
from vericache_hf.cache.layers import VeriCacheLayer
from vericache_hf.cache.window import WindowLayer, first_needed, held_slots
from vericache_hf.decoding import _build_cache
from vericache_hf.layer_plan import LayerPlan, layer_plan, window_layers
from vericache_hf.prefix import DiskStore
from vericache_hf.window_mask import WINDOW_DROPPED, window_aware
from vericache_tools.families import prompts, stock_greedy, vericache_greedy
from vericache_tools.families import tiny_model as family_model

from .conftest import random_prompt, tiny_model
from .test_cohorts import serve
from .test_engine import stock

NEW_TOKENS = 100  # windows and chunks of 16 tokens: each row's window moves on several times over
FAMILIES = {
    "gemma3_text": torch.float64,
    "gemma2": torch.float64,
    "cohere2": torch.float64,
    "gpt_oss": torch.float32,
    "llama4_text": torch.float64,  # chunked attention beside full attention
}
#: One family of each window kind, for the tests that need not run every family.
KINDS = ["gemma3_text", "llama4_text"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def windowed(request):
    return family_model(request.param).to(FAMILIES[request.param])


def vericache(model, inputs, stats, **settings):
    return vericache_greedy(model, inputs, NEW_TOKENS, stats=stats, **{"compression_ratio": 0.875} | settings)


def test_the_sliding_or_chunked_layers_of_a_mixed_model_are_window_layers(windowed):
    plans = layer_plan(windowed)
    windows = window_layers(plans)
    kinds = {"sliding_attention", "chunked_attention"}
    assert windows and set(windows) == {plan.index for plan in plans if plan.kind in kinds}
    _, cache = _build_cache(windowed, VeriCacheConfig(compressor="snapkv"), VeriCacheStats())
    assert [layer.layer_idx for layer in cache.windowed] == sorted(windows)
    chunked = {plan.kind for plan in plans} >= {"chunked_attention"}
    assert cache.chunked == chunked and all(layer.chunked == chunked for layer in cache.windowed)
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


@pytest.mark.parametrize("family", KINDS)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_draft_pass_reads_each_layout_where_its_layers_expect_it(family, batch):
    """With every prompt token kept in the draft tier, a draft pass is the model itself, so the verify pass accepts
    every draft. Prompt-lookup proposals that the draft tier rejects leave masked drafted slots in both layouts of
    the draft pass's mask (the draft tier's and the windows'); a window part placed off by a slot drafts wrong, and
    so do chunks counted from the window's first held slot rather than from each row's first token."""
    model = family_model(family).to(torch.float64)
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


@pytest.mark.parametrize("family", KINDS)
def test_the_window_tier_stays_bounded_as_the_context_grows(family):
    """Prompts of 70 and 406 tokens (as far into a chunk): the draft tier grows with the prompt, the window layers'
    buffers do not, and they hold no more than a window or chunk, a trim's slack and a round's tokens."""
    model = family_model(family).to(torch.float64)
    text = model.config
    token = 2 * text.num_key_value_heads * text.head_dim * model.dtype.itemsize
    windows = window_layers(layer_plan(model))
    (size,) = set(windows.values())
    sizes = {}
    for length in (70, 406):
        ids = torch.randint(3, 120, (1, length), generator=torch.Generator().manual_seed(length))
        stats = VeriCacheStats()
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        expected = stock_greedy(model, inputs, NEW_TOKENS)
        assert torch.equal(vericache(model, inputs, stats, compression_ratio=0.5), expected)
        sizes[length] = stats
    assert sizes[70].window_tier_bytes == sizes[406].window_tier_bytes
    assert sizes[406].window_tier_bytes <= len(windows) * token * held_slots(size, 5)
    assert sizes[406].window_tier_bytes < len(windows) * token * 406 // 2  # far less than the prompt
    assert sizes[406].draft_tier_bytes > 2 * sizes[70].draft_tier_bytes


def test_a_draft_model_of_another_float_type_reads_the_windows_in_its_own():
    model = family_model("gemma3_text").to(torch.float64)
    inputs = prompts(3)
    expected = stock_greedy(model, inputs, NEW_TOKENS)
    stats = VeriCacheStats()
    assert torch.equal(vericache(model, inputs, stats, draft_dtype="float32"), expected)
    assert stats.accepted_tokens > 0


@pytest.mark.parametrize("family", KINDS)
@pytest.mark.parametrize("compressor", ["snapkv", "streaming_llm"], ids=["carried", "rebuilt"])
def test_cohorts_join_and_split_window_layers_exactly(family, compressor):
    """Requests of different lengths share passes: rows join a running cohort and leave it, and each window
    layer's rows move with the full tier's (a chunked layer's with the count of tokens it dropped); every output
    equals stock's."""
    model = family_model(family).to(torch.float64)
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
    with pytest.raises(ValueError, match="chunked layers .* prefix_store"):
        model.generate(**prompts(1), max_new_tokens=4, generation_mode="vericache", vericache_config=config)


def test_a_model_whose_every_layer_slides_keeps_two_tiers():
    """With no full-attention layer, compressing the windows is the only saving drafting has: they keep two tiers."""
    model = family_model("mistral")
    assert {plan.kind for plan in layer_plan(model)} == {"sliding_attention"}
    assert window_layers(layer_plan(model)) == {}


@pytest.mark.parametrize("stage_on_cpu", [False, True])
def test_a_model_whose_every_layer_slides_verifies_over_the_tail_its_windows_reach(monkeypatch, stage_on_cpu):
    """Every layer slides by 8 tokens over a 40-token prompt, on a left-padded batch whose rows accept different
    counts: the output is stock generate's (the window counts each row's positions, as stock's contiguous rows do,
    not the slots its rejected drafts left masked), and each verify pass reads only the full tier's slots that some
    row's window reaches (a window, the slots rows left masked inside it, and the block), not the whole context:
    read in place on the host, or staged through copies."""
    model = tiny_model("mistral", sliding_window=8)
    ids = random_prompt(40, batch=3, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :9], mask[2, :17] = 0, 0
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    reads, verify = [], VeriCacheLayer._verify

    def verify_reading(layer, keys, values):
        read = verify(layer, keys, values)
        reads.append((read[0].shape[2], layer.full.length + keys.shape[2]))
        return read

    monkeypatch.setattr(VeriCacheLayer, "_verify", verify_reading)
    config = VeriCacheConfig(
        compressor="snapkv", draft_length=5, draft_schedule="fixed", stage_on_cpu=stage_on_cpu
    )
    got = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        generation_mode="vericache",
        vericache_config=config,
    )
    assert torch.equal(got, expected)
    assert reads and reads[-1][1] >= 80, reads
    # at most a window's 8 tokens, the 6 of the block and the slots rows left masked between them, while the
    # context grows to 85 slots
    assert max(read for read, _ in reads) <= 30 and reads[-1][0] < reads[-1][1] / 2, reads


def test_a_chunked_window_keeps_each_row_from_the_chunk_of_its_next_position():
    """Chunks of 4: a row that has 9 tokens (2 dropped, 7 held) needs its 9th (the chunk of positions 8 to 11), one
    that has 12 needs nothing more, and a row with a hole counts only its real tokens."""
    valid = torch.tensor(
        [
            [True, True, True, True, True, True, True],
            [True, True, True, True, True, True, True],
            [False, True, True, False, True, True, True],
        ]
    )
    assert first_needed(valid, 4, torch.tensor([2, 5, 0])) == 6
    assert first_needed(valid[2:], 4, torch.tensor([2])) == 4  # 7 tokens: its 5th to 7th, in slots 4 to 6
    assert first_needed(valid[1:2], 4, torch.tensor([5])) == 7  # none needed
    assert first_needed(valid, 4) == 2  # a sliding window of 4: the last row's last 4 tokens, over its hole


def test_a_model_whose_windows_are_of_both_kinds_keeps_two_tiers():
    """Sliding and chunked layers in one model would need two window masks in one pass: they keep two tiers."""
    plans = [
        LayerPlan(0, "sliding_attention", 16),
        LayerPlan(1, "chunked_attention", 16),
        LayerPlan(2, "full_attention"),
    ]
    assert window_layers(plans) == {}
    assert window_layers([plans[1], plans[2]]) == {1: 16}


CHUNK_CONFIG = SimpleNamespace(attention_chunk_size=4, sliding_window=None)


def chunked_mask(**kwargs) -> torch.Tensor | None:
    """A chunked layer's mask (chunks of 4) for one row and one query, as transformers asks VeriCache's sdpa for it."""
    return window_aware(sdpa_mask)(
        batch_size=1,
        q_length=1,
        mask_function=chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)),
        local_size=4,
        allow_is_causal_skip=True,
        config=CHUNK_CONFIG,
        **kwargs,
    )


def test_a_window_shorter_than_a_chunk_still_gets_its_chunk_boundary():
    """A verify pass over a dense row whose window holds positions 6 and 7, for the query at 8: fewer slots than a
    chunk, yet the chunk 8..11 begins among them, so the pass needs a mask (transformers would skip it)."""
    mask = chunked_mask(kv_length=3, q_offset=8, kv_offset=6, attention_mask=None)
    assert mask is not None and mask.flatten().tolist() == [False, False, True]


def test_a_draft_pass_counts_chunks_from_each_rows_dropped_tokens():
    """A draft pass's mask: three draft-tier slots, then a window that holds the row's tokens 6 to 9 (6 dropped),
    then the query, the row's token 10. Its chunk is 8..11, whatever the draft tier's layout before the window."""
    padding = torch.ones(1, 8, dtype=torch.long)
    token = WINDOW_DROPPED.set(torch.tensor([6]))
    try:
        mask = chunked_mask(kv_length=5, q_offset=7, kv_offset=3, attention_mask=padding)
    finally:
        WINDOW_DROPPED.reset(token)
    assert mask.flatten().tolist() == [False, False, True, True, True]
