"""Greedy VeriCache output equals stock `generate` on the full cache, for every compressor and setting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vericache_hf
from vericache_hf import VeriCacheConfig

from .conftest import random_prompt, tiny_model

COMPRESSORS = ["streaming_llm", "snapkv", "kivi"]
RATIOS = {"streaming_llm": [0.5, 0.75, 0.9], "snapkv": [0.5, 0.75, 0.9], "kivi": [0.5, 0.75, 0.875]}


def stock(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, **kwargs)


def vericache(model, ids, config: VeriCacheConfig, **kwargs):
    return model.generate(
        ids, do_sample=False, generation_mode="vericache", vericache_config=config, **kwargs
    )


@pytest.mark.parametrize("compressor", COMPRESSORS)
@pytest.mark.parametrize("schedule", ["fixed", "adaptive", "cost_aware"])
def test_every_compressor_and_ratio_matches_stock(model, compressor, schedule):
    ids = random_prompt(60, seed=1)
    expected = stock(model, ids, max_new_tokens=40)
    for ratio in RATIOS[compressor]:
        config = VeriCacheConfig(compressor=compressor, compression_ratio=ratio, draft_schedule=schedule)
        assert torch.equal(vericache(model, ids, config, max_new_tokens=40), expected), (compressor, ratio)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt_length=st.integers(1, 90),
    new_tokens=st.integers(1, 50),
    compressor=st.sampled_from(COMPRESSORS),
    ratio_index=st.integers(0, 2),
    draft_length=st.integers(1, 20),
    schedule=st.sampled_from(["fixed", "adaptive", "cost_aware"]),
    seed=st.integers(0, 10_000),
)
def test_random_settings_match_stock(
    llama, prompt_length, new_tokens, compressor, ratio_index, draft_length, schedule, seed
):
    ids = random_prompt(prompt_length, seed=seed)
    config = VeriCacheConfig(
        compressor=compressor,
        compression_ratio=RATIOS[compressor][ratio_index],
        draft_length=draft_length,
        draft_schedule=schedule,
        max_draft_length=max(draft_length, 32),
        min_draft_length=1,
    )
    assert torch.equal(
        vericache(llama, ids, config, max_new_tokens=new_tokens), stock(llama, ids, max_new_tokens=new_tokens)
    )


def test_eos_ends_the_sequence_as_in_stock(llama):
    ids = random_prompt(30, seed=3)
    free_run = stock(llama, ids, max_new_tokens=30)
    eos = int(free_run[0, 30 + 12])  # a token the model emits mid-generation becomes the EOS
    expected = stock(llama, ids, max_new_tokens=30, eos_token_id=eos)
    assert expected.shape[-1] < free_run.shape[-1]
    got = vericache(
        llama, ids, VeriCacheConfig(compressor="snapkv", draft_length=16), max_new_tokens=30, eos_token_id=eos
    )
    assert torch.equal(got, expected)


def test_custom_generate_callable_gives_the_same_result(llama):
    ids = random_prompt(50, seed=4)
    config = VeriCacheConfig(compressor="kivi", compression_ratio=0.875)
    got = llama.generate(
        ids,
        max_new_tokens=25,
        do_sample=False,
        custom_generate=vericache_hf.generate,
        vericache_config=config,
    )
    assert torch.equal(got, stock(llama, ids, max_new_tokens=25))


def test_plain_generate_is_untouched(llama):
    ids = random_prompt(20, seed=5)
    assert type(llama).generate.__name__ == "generate"
    out = llama.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert not hasattr(out, "vericache_stats")


def test_stats_are_reported_and_accumulated(llama):
    ids = random_prompt(80, seed=6)
    total = vericache_hf.VeriCacheStats()
    # a fixed schedule: the cost-aware one decides by the clock whether a tiny model drafts at all
    config = VeriCacheConfig(compressor="snapkv", draft_schedule="fixed", draft_length=6, stats=total)
    out = vericache(llama, ids, config, max_new_tokens=30, return_dict_in_generate=True)
    again = vericache(llama, ids, config, max_new_tokens=30, return_dict_in_generate=True)
    stats = out.vericache_stats
    assert stats.rounds > 0 and stats.drafted_tokens >= stats.accepted_tokens
    assert stats.emitted_tokens == 30
    assert (
        stats.draft_tier_bytes < stats.full_tier_bytes
    )  # on the CPU the full tier is read in place: no transfers
    for name in ("rounds", "plain_rounds", "drafted_tokens", "emitted_tokens"):
        assert getattr(total, name) == getattr(stats, name) + getattr(again.vericache_stats, name), name


def test_qwen3_with_query_norms_matches_stock():
    model = tiny_model("qwen3", head_dim=16)
    ids = random_prompt(50, seed=8)
    expected = stock(model, ids, max_new_tokens=30)
    for compressor in COMPRESSORS:
        config = VeriCacheConfig(compressor=compressor, compression_ratio=0.75)
        assert torch.equal(vericache(model, ids, config, max_new_tokens=30), expected), compressor
