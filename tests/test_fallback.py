"""The fallback when drafting does not pay: rounds turn plain, the draft tier is built only when a draft first needs
it (not at prefill; a query-aware compressor's from the layer inputs held since then), a K/V-only compressor's is
freed after failed probes and built again from the full tier by the next probe. Output stays equal to stock
`generate` through every switch. Each call starts from a prior that says plain rounds pay and probes have failed
before, as a schedule that measured this on an earlier call would carry (so the switches happen at known rounds, not
by the clock)."""

from __future__ import annotations

import time

import pytest
import torch

from vericache_hf import VeriCache, VeriCacheConfig, VeriCacheStats
from vericache_hf.compat import cache_kwargs
from vericache_hf.compressors import build_compressor
from vericache_hf.compressors.h2o import H2OCompressor
from vericache_hf.compressors.streaming_llm import StreamingLLMCompressor
from vericache_hf.decoding import _schedule_key
from vericache_hf.loop import build_for_drafting
from vericache_hf.pass_model import pass_model
from vericache_hf.schedule import priors_for
from vericache_hf.schedule.draft_length import CostAwareDraftLength
from vericache_hf.schedule.exploration import Exploration
from vericache_hf.schedule.payoff import Payoff
from vericache_hf.schedule.round_costs import RoundCosts

from .conftest import random_prompt, tiny_model


def remember_plain_pays(model, config: VeriCacheConfig, ids: torch.Tensor) -> None:
    """A prior in which drafts were all rejected and two probes failed (the probe interval is 64 plain rounds)."""
    schedule = CostAwareDraftLength(config)
    for _ in range(10):
        schedule.costs.acceptance.add([(8, 0)] * 4)
    schedule.costs.draft_step.add(0.01)
    schedule.costs.plain_step.add(0.01)
    schedule.costs.verify.add(5, 0.012)
    schedule.exploration.probe_after = Exploration.FREE_AFTER
    priors_for(model).remember(_schedule_key(config, ids, None), schedule)


def prefilled(model, ids, method: str, mask=None, **settings) -> VeriCache:
    """A VeriCache holding `ids`'s prefill (ratio 0.5): the full tier, and the draft tier unless it was deferred."""
    mask = torch.ones_like(ids) if mask is None else mask
    cache = VeriCache(model.config.num_hidden_layers, build_compressor(method, 0.5), **settings)
    runner = pass_model(model)
    with cache.prefilling(runner, mask):
        runner(ids, attention_mask=mask, **cache_kwargs(runner, cache), use_cache=True)
    return cache


@pytest.fixture(autouse=True)
def probes_are_due(monkeypatch):
    """Every due probe runs, and no round drafts but a probe: whether one can pay, and whether drafting leads after a
    probe that ran through, read the clock (a tiny model's draft step costs what a plain round does), and these
    tests put the switches at known rounds. `probe_pays` and the choice of length have their own tests."""
    monkeypatch.setattr(Payoff, "probe_pays", lambda *args: True)
    monkeypatch.setattr(RoundCosts, "tokens_per_second", lambda self, k, curve=None: float(not k))


def stock(model, ids, mask=None, new=90):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def vericache(model, ids, config, mask=None, new=90):
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        generation_mode="vericache",
        vericache_config=config,
    )


@pytest.mark.parametrize("compressor", ["streaming_llm", "kivi", ["knorm", "kivi"]])
def test_plain_rounds_free_the_draft_tier_and_a_probe_rebuilds_it(model, compressor):
    ids = random_prompt(48, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row: the built tier must mask it as a prefill would
    stats = VeriCacheStats()
    config = VeriCacheConfig(compressor=compressor, compression_ratio=0.5, stats=stats)
    remember_plain_pays(model, config, ids)
    # 64 plain rounds, a probe (the deferred tier's first build), the tier freed, 128 plain rounds, a probe again
    new = 230
    out = vericache(model, ids, config, mask, new)
    assert torch.equal(out, stock(model, ids, mask, new))
    assert stats.plain_rounds >= 64 + 128
    assert stats.draft_tier_frees >= 1 and stats.draft_tier_builds >= 2
    assert stats.rounds >= 2  # both probes drafted: on the deferred tier, and on the one built after the free
    assert stats.compress_seconds > 0 and stats.commit_seconds > 0 and stats.plain_round_seconds > 0


def test_a_call_whose_rounds_are_all_plain_never_compresses(model):
    ids = random_prompt(30, seed=6)
    stats = VeriCacheStats()
    config = VeriCacheConfig(compressor="kivi", compression_ratio=0.5, stats=stats)
    remember_plain_pays(model, config, ids)
    out = model.generate(
        ids, max_new_tokens=20, do_sample=False, generation_mode="vericache", vericache_config=config
    )
    assert torch.equal(out, model.generate(ids, max_new_tokens=20, do_sample=False))
    assert stats.plain_rounds == 19 and stats.draft_tier_builds == 0 and stats.compress_seconds == 0


def press(name: str):
    """A kvpress press at ratio 0.5: SnapKV keeps as many tokens in every layer, PyramidKV fewer in later layers
    (which the adapter tops up to the largest layer's count)."""
    kvpress = pytest.importorskip("kvpress")
    return getattr(kvpress, name)(compression_ratio=0.5, window_size=8)


@pytest.mark.parametrize("method", ["snapkv", "h2o", "SnapKVPress", "PyramidKVPress"])
def test_a_query_aware_draft_tier_is_built_from_held_layer_inputs_and_kept_through_plain_rounds(
    llama, method
):
    ids = random_prompt(48, seed=4)
    stats = VeriCacheStats()
    compressor = press(method) if method.endswith("Press") else method
    config = VeriCacheConfig(compressor=compressor, compression_ratio=0.5, stats=stats)
    remember_plain_pays(llama, config, ids)
    assert torch.equal(vericache(llama, ids, config), stock(llama, ids))
    assert stats.plain_rounds >= 64 and stats.rounds >= 1
    # built once, by the first probe, from the layer inputs held since the prefill; never freed (no rebuild)
    assert stats.draft_tier_builds == 1 and stats.draft_tier_frees == 0


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_a_deferred_query_aware_build_equals_the_one_a_prefill_makes(llama, method):
    ids = torch.cat([random_prompt(40, seed=9), random_prompt(40, seed=10)])
    valid = torch.ones_like(ids)
    valid[1, :7] = 0  # a left-padded row
    at_prefill = prefilled(llama, ids, method, valid, stage_on_cpu=True)
    deferred = prefilled(llama, ids, method, valid)
    assert (
        at_prefill.draft_tier.held and not deferred.draft_tier.held and deferred.stats.compress_seconds == 0
    )
    held = deferred.draft_tier.prompt_inputs[0].queries.shape[2]
    assert held == (32 if method == "snapkv" else 40)  # SnapKV holds its observation window's queries only
    deferred.draft_tier.build()
    # the queries are let go once used
    assert deferred.draft_tier.held and not deferred.draft_tier.prompt_inputs
    for built, reference in zip(deferred.layers, at_prefill.layers, strict=True):
        for name, tensor in reference.draft.export().items():
            assert torch.equal(built.draft.export()[name], tensor), name
    at_prefill.close()
    deferred.close()


def test_a_declined_query_aware_build_releases_its_layer_inputs(llama):
    ids = random_prompt(24, seed=11)
    cache = prefilled(llama, ids, "h2o")
    assert cache.draft_tier.buildable
    assert not cache.draft_tier.build(lambda seconds: False)
    assert not cache.draft_tier.held and not cache.draft_tier.buildable and not cache.draft_tier.prompt_inputs
    with pytest.raises(RuntimeError, match="released when one was declined"):
        cache.draft_tier.build()
    cache.close()


def test_a_build_declined_at_a_remembered_price_builds_nothing_and_releases_the_layer_inputs(llama):
    """A call on settings an earlier call priced declines from that price: no layer is built, and H2O's held inputs
    (1.5x the full tier on SmolLM2-135M) go at once, not when the call ends."""
    cache = prefilled(llama, random_prompt(24, seed=11), "h2o")
    schedule = CostAwareDraftLength(VeriCacheConfig(compressor="h2o", compression_ratio=0.5))
    schedule.costs.plain_step.add(0.01)  # a plain round's price: 20 tokens could save at most 0.2 s
    schedule.observe_build(10.0)  # the remembered build
    assert cache.draft_tier.prompt_inputs and not build_for_drafting(
        pass_model(llama), cache, schedule, remaining=20
    )
    assert not cache.draft_tier.held and not cache.draft_tier.buildable and not cache.draft_tier.prompt_inputs
    assert cache.stats.compress_seconds == 0 and cache.stats.draft_tier_builds_declined == 1
    cache.close()


def test_the_draft_tier_is_built_after_the_prefill_and_rebuilt_after_a_free(llama):
    ids = random_prompt(20, seed=5)
    cache = prefilled(llama, ids, "streaming_llm")
    assert (
        not cache.draft_tier.held and cache.stats.compress_seconds == 0
    )  # deferred: the layers are on the CPU
    with pytest.raises(RuntimeError, match=r"draft_tier\.build"), cache.drafting(2):
        pass
    cache.draft_tier.build()
    held = cache.draft_tier_bytes()
    assert cache.draft_tier.held and held > 0
    cache.draft_tier.free()
    assert not cache.draft_tier.held and cache.draft_tier_bytes() == 0
    with pytest.raises(RuntimeError, match=r"draft_tier\.build"), cache.drafting(2):
        pass
    cache.draft_tier.build()
    assert cache.draft_tier.held and cache.draft_tier_bytes() == held and cache.stats.draft_tier_builds == 2

    # the full tier is copied out for passes, as on an accelerator: compress now
    staged = prefilled(llama, ids, "streaming_llm", stage_on_cpu=True)
    assert staged.draft_tier.held
    staged.close()

    query_aware = VeriCache(llama.config.num_hidden_layers, build_compressor("snapkv", 0.5))
    with pytest.raises(ValueError, match="cannot be refreshed"):
        query_aware.draft_tier.free()


class SlowBuild(StreamingLLMCompressor):
    """StreamingLLM whose compression takes a fifth of a second a layer: a build dearer than anything drafting can
    save on a tiny model (a plain round there takes milliseconds). Counts the layers it compressed."""

    layers_compressed = 0

    def compress(self, keys, values, context):
        type(self).layers_compressed += 1
        time.sleep(0.2)
        return super().compress(keys, values, context)


class SlowH2O(H2OCompressor):
    """H2O, as slow as `SlowBuild`: a query-aware build, from the layer inputs held since the prefill."""

    layers_compressed = 0

    def compress(self, keys, values, context):
        type(self).layers_compressed += 1
        time.sleep(0.2)
        return super().compress(keys, values, context)


@pytest.mark.parametrize("slow", [SlowBuild, SlowH2O])
def test_a_build_drafting_could_never_repay_is_declined_after_its_first_layers(monkeypatch, slow):
    monkeypatch.undo()  # no probe is forced: no probe should come
    model = tiny_model("llama", num_hidden_layers=4)
    ids = random_prompt(40, seed=8)
    stats = VeriCacheStats()
    slow.layers_compressed = 0
    config = VeriCacheConfig(compressor=slow(compression_ratio=0.5), stats=stats)
    # no prior: two plain rounds, then the round that would price drafting builds two layers, prices the whole build
    # from them (four layers: 0.8 s) and declines it; every round is plain and the output is stock's
    assert torch.equal(vericache(model, ids, config, new=30), stock(model, ids, new=30))
    assert stats.draft_tier_builds == 0 and stats.draft_tier_builds_declined == 1
    assert stats.rounds == 0 and stats.drafted_tokens == 0 and stats.plain_rounds == 29
    assert slow.layers_compressed == 2  # two layers were built, then dropped
    assert stats.compress_seconds >= 0.4
    # the next call on the same settings declines from the remembered price, building nothing
    again = VeriCacheStats()
    config = VeriCacheConfig(compressor=slow(compression_ratio=0.5), stats=again)
    assert torch.equal(vericache(model, ids, config, new=30), stock(model, ids, new=30))
    assert again.draft_tier_builds == 0 and again.draft_tier_builds_declined == 1
    assert again.compress_seconds == 0 and again.drafted_tokens == 0 and slow.layers_compressed == 2
