"""Hybrid models whose layers keep a recurrent state (gated-delta linear attention in Qwen3.5, Mamba beside attention
in Falcon-H1): drafting never leaves that state past the accepted tokens, each row's state after a verify pass is
the one stock decoding of its accepted tokens leaves, and output is stock `generate`'s."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import vericache_hf
from vericache_hf.cache.recurrent import RecurrentLayer
from vericache_hf.layer_plan import recurrent_states
from vericache_hf.prefix import DiskStore
from vericache_tools.families import prompts, tiny_model

PROMPT, BLOCK = 20, 5


def sensitive(family: str):
    """The family's tiny model in float64, its recurrent mixers' output scaled up: random weights leave them so
    small a share of the output that a wrong state would rarely change a greedy token; scaled up, it does."""
    torch.manual_seed(0)
    model = tiny_model(family).to(torch.float64).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(("linear_attn.out_proj", "mamba.out_proj")):
                module.weight.mul_(30)
    return model


@pytest.fixture(scope="module")
def hybrid():
    return sensitive("qwen3_5")


def _states(cache, layers):
    return {
        i: (cache.layers[i].recurrent_states[0].clone(), cache.layers[i].conv_states[0].clone())
        for i in layers
    }


def test_commit_keeps_each_rows_state_after_its_accepted_tokens(hybrid):
    layers = recurrent_states(hybrid)
    assert layers, "the hybrid has recurrent layers"
    ids = torch.randint(3, 100, (3, PROMPT + BLOCK), generator=torch.Generator().manual_seed(1))
    stock = DynamicCache(config=hybrid.config)
    hybrid(ids[:, :PROMPT], cache=stock, use_cache=True)
    after = [_states(stock, layers)]
    for t in range(BLOCK):  # stock decoding, one token at a time
        hybrid(ids[:, PROMPT + t : PROMPT + t + 1], cache=stock, use_cache=True)
        after.append(_states(stock, layers))

    ours = DynamicCache(config=hybrid.config)
    for i, states in layers.items():
        ours.layers[i] = RecurrentLayer(i, states)
    hybrid(ids[:, :PROMPT], cache=ours, use_cache=True)
    for i in layers:
        ours.layers[i].record_states()
    hybrid(ids[:, PROMPT:], cache=ours, use_cache=True)  # the verify pass: the whole block at once
    kept = torch.tensor([0, 2, BLOCK])
    for i in layers:
        ours.layers[i].keep_states(BLOCK, torch.arange(BLOCK)[None, :] < kept[:, None])
    for i in layers:
        for row, t in enumerate(kept.tolist()):
            state, conv = after[t][i]
            assert torch.allclose(ours.layers[i].recurrent_states[0][row], state[row], rtol=0, atol=1e-12)
            assert torch.allclose(ours.layers[i].conv_states[0][row], conv[row], rtol=0, atol=1e-12)


def test_restore_undoes_a_draft(hybrid):
    layers = recurrent_states(hybrid)
    cache = DynamicCache(config=hybrid.config)
    for i, states in layers.items():
        cache.layers[i] = RecurrentLayer(i, states)
    ids = torch.randint(3, 100, (2, PROMPT + 3), generator=torch.Generator().manual_seed(2))
    hybrid(ids[:, :PROMPT], cache=cache, use_cache=True)
    before = _states(cache, layers)
    for i in layers:
        cache.layers[i].save_state()
    for t in range(3):  # draft steps update the states in place
        hybrid(ids[:, PROMPT + t : PROMPT + t + 1], cache=cache, use_cache=True)
    assert not all(torch.equal(before[i][0], cache.layers[i].recurrent_states[0]) for i in layers)
    for i in layers:
        cache.layers[i].restore_state()
    for i, (state, conv) in before.items():
        assert torch.equal(cache.layers[i].recurrent_states[0], state)
        assert torch.equal(cache.layers[i].conv_states[0], conv)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("compressor", ["snapkv", "streaming_llm"])
def test_hybrid_is_exact_where_drafts_are_rejected(hybrid, batch, compressor):
    kwargs = dict(do_sample=False, max_new_tokens=30, min_new_tokens=30)
    expected = hybrid.generate(**prompts(batch), **kwargs)
    stats = vericache_hf.VeriCacheStats()
    config = vericache_hf.VeriCacheConfig(
        compressor=compressor, compression_ratio=0.9, draft_length=4, draft_schedule="fixed", stats=stats
    )
    got = hybrid.generate(**prompts(batch), generation_mode="vericache", vericache_config=config, **kwargs)
    assert torch.equal(got, expected)
    assert 0 < stats.accepted_tokens < stats.drafted_tokens, (
        "rounds must accept some drafts and reject others"
    )
    assert stats.recurrent_state_bytes > 0  # counted as device memory


def test_hybrid_with_prompt_lookup_is_exact(hybrid):
    kwargs = dict(do_sample=False, max_new_tokens=30, min_new_tokens=30)
    expected = hybrid.generate(**prompts(3), **kwargs)
    config = vericache_hf.VeriCacheConfig(compression_ratio=0.9, draft_length=4, draft_schedule="fixed")
    got = hybrid.generate(
        **prompts(3),
        generation_mode="vericache",
        vericache_config=config,
        prompt_lookup_num_tokens=3,
        **kwargs,
    )
    assert torch.equal(got, expected)


def test_hybrid_refuses_a_prefix_store(hybrid, tmp_path):
    config = vericache_hf.VeriCacheConfig(prefix_store=DiskStore(tmp_path))
    with pytest.raises(ValueError, match="recurrent state in layers"):
        hybrid.generate(**prompts(1), max_new_tokens=4, generation_mode="vericache", vericache_config=config)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_layer_pairing_attention_with_a_recurrent_state_is_exact(batch):
    """Falcon-H1: every layer holds attention K/V (two tiers) and a Mamba state (rolled back) side by side."""
    model = sensitive("falcon_h1")
    kwargs = dict(do_sample=False, max_new_tokens=30, min_new_tokens=30)
    expected = model.generate(**prompts(batch), **kwargs)
    stats = vericache_hf.VeriCacheStats()
    config = vericache_hf.VeriCacheConfig(
        compressor="snapkv", compression_ratio=0.9, draft_length=4, draft_schedule="fixed", stats=stats
    )
    got = model.generate(**prompts(batch), generation_mode="vericache", vericache_config=config, **kwargs)
    assert torch.equal(got, expected)
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
