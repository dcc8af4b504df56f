"""A `VeriCacheConfig` saved as a model's default reads back as the same config and decodes as stock `generate`
does; what cannot be saved is refused before anything is; and a config holds no per-call state, so calls that share
one each count towards its refresh policy on their own."""

from __future__ import annotations

import copy
import dataclasses
import json
import tempfile
import threading

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from vericache_hf import RefreshPolicy, VeriCacheConfig, loop
from vericache_hf.compressors import (
    FP8Compressor,
    H2OCompressor,
    KIVICompressor,
    KnormCompressor,
    SnapKVCompressor,
    StreamingLLMCompressor,
    build_compressor,
)
from vericache_hf.registration import set_default_mode

from .conftest import random_prompt, tiny_model

DROPPING = ["streaming_llm", "snapkv", "knorm", "h2o"]
KV_ONLY = ["streaming_llm", "knorm", "kivi", "fp8"]  # compressors that need no queries, so refresh can apply
RATIOS = [0.0, 0.5, 0.75]
NAME_KWARGS = {
    "streaming_llm": st.fixed_dictionaries({"n_sink": st.integers(0, 8)}),
    "snapkv": st.fixed_dictionaries({"window_size": st.integers(1, 16)}),
    "knorm": st.just({}),
    "h2o": st.fixed_dictionaries({"recent_size": st.integers(1, 16)}),
    "kivi": st.fixed_dictionaries({"bits": st.sampled_from([2, 4])}),
    "fp8": st.just({}),
}


def library_compressors(names: list[str]) -> st.SearchStrategy:
    """Instances of the library's compressors with varied settings."""
    ratio = st.sampled_from(RATIOS)
    made = {
        "streaming_llm": st.builds(StreamingLLMCompressor, compression_ratio=ratio, n_sink=st.integers(0, 8)),
        "snapkv": st.builds(SnapKVCompressor, compression_ratio=ratio, window_size=st.integers(1, 16)),
        "knorm": st.builds(KnormCompressor, compression_ratio=ratio, budget=st.none() | st.integers(8, 64)),
        "h2o": st.builds(H2OCompressor, compression_ratio=ratio, recent_size=st.integers(1, 16)),
        "kivi": st.builds(KIVICompressor, bits=st.sampled_from([2, 4]), group_size=st.sampled_from([8, 16])),
        "fp8": st.builds(FP8Compressor),
    }
    return st.one_of(*(made[name] for name in names))


def presses() -> st.SearchStrategy:
    kvpress = pytest.importorskip("kvpress")
    ratio = st.sampled_from(RATIOS)
    return st.one_of(
        st.builds(kvpress.SnapKVPress, compression_ratio=ratio, window_size=st.integers(2, 16)),
        st.builds(kvpress.KnormPress, compression_ratio=ratio),
        st.builds(kvpress.StreamingLLMPress, compression_ratio=ratio, n_sink=st.integers(0, 8)),
    )


@st.composite
def compressor_specs(draw) -> tuple:
    """(compressor, compressor_kwargs, compression_budget): every form a user may give."""
    form = draw(st.sampled_from(["name", "name+kwargs", "list", "instance", "press", "dict"]))
    if form == "name":
        name = draw(st.sampled_from(sorted(NAME_KWARGS)))
        budget = draw(st.none() | st.integers(8, 64)) if name in DROPPING else None
        return name, {}, budget
    if form == "name+kwargs":
        name = draw(st.sampled_from(sorted(NAME_KWARGS)))
        return name, draw(NAME_KWARGS[name]), None
    if form == "list":  # droppers first; only the first may score with queries
        first = draw(st.sampled_from(DROPPING) | library_compressors(DROPPING) | presses())
        last = draw(st.sampled_from(["streaming_llm", "knorm", "kivi", "fp8"]) | library_compressors(KV_ONLY))
        return [first, last], {}, None
    if form == "instance":
        return draw(library_compressors(sorted(NAME_KWARGS))), {}, None
    if form == "press":
        return draw(presses()), {}, None
    name = draw(st.sampled_from(sorted(NAME_KWARGS)))  # a library compressor by name and settings, as saved
    return {"compressor": name, **draw(NAME_KWARGS[name])}, {}, None


@st.composite
def configs(draw) -> VeriCacheConfig:
    compressor, kwargs, budget = draw(compressor_specs())
    ratio = draw(st.sampled_from(RATIOS))
    try:
        built = build_compressor(compressor, ratio, budget, **kwargs)
    except ValueError:  # a quantizer by name meets only the ratios of its bit widths
        assume(False)
    refresh = None
    if not built.scores_with_queries:
        refresh = draw(
            st.none()
            | st.builds(
                RefreshPolicy,
                every_tokens=st.integers(1, 32),
                min_accepted=st.none() | st.floats(0, 8, allow_nan=False),
                window_rounds=st.integers(1, 6),
            )
        )
    schedule = draw(st.sampled_from(["fixed", "adaptive", "cost_aware", "auto"]))
    low = draw(st.integers(1, 6))
    high = draw(st.integers(low, 12))
    return VeriCacheConfig(
        compressor=compressor,
        compressor_kwargs=kwargs,
        compression_budget=budget,
        compression_ratio=ratio,
        refresh=refresh,
        draft_schedule=schedule,
        min_draft_length=low,
        max_draft_length=high,
        draft_length=draw(st.integers(low, high)),
        chunk_tokens=draw(st.sampled_from([16, 64, 2048])),
        staging_buffers=draw(st.integers(1, 3)),
        staging_chunk_tokens=draw(st.sampled_from([None, 32, 3072])),
        verify_attention=draw(st.sampled_from(["auto", "sdpa", "lower_right"])),
        stage_on_cpu=draw(st.booleans()),
        transfer_timeout=draw(st.sampled_from([30.0, 60])),
        proposer=draw(st.sampled_from([None, "prompt_lookup"])),
        proposal_length=draw(st.integers(1, 12)),
        draft_dtype=draw(st.sampled_from([None, "float32", torch.float64])),
        draft_matmul=draw(st.sampled_from(["measured", "stock"])),
        prefix_chunk_tokens=draw(st.sampled_from([64, 256])),
    )


def saved_and_reloaded(model, config: VeriCacheConfig) -> GenerationConfig:
    """`model`'s generation config after `set_default_mode(model, config)`, written to a folder and read back."""
    set_default_mode(model, config)
    with tempfile.TemporaryDirectory() as folder:
        model.generation_config.save_pretrained(folder)
        return GenerationConfig.from_pretrained(folder)


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=configs())
def test_every_config_survives_json_and_a_saved_generation_config(base, config):
    data = config.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain JSON: nothing written by repr
    again = VeriCacheConfig.from_any(json.loads(json.dumps(data)))
    assert again.to_dict() == data
    assert again == config  # objects come back as equal objects
    model = copy.copy(base)  # a generation config of its own; the weights are shared, and never changed
    model.generation_config = copy.deepcopy(base.generation_config)
    loaded = saved_and_reloaded(model, config)
    assert loaded.generation_mode == "vericache"
    assert VeriCacheConfig.from_any(loaded.vericache_config).to_dict() == data


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=configs())
def test_a_saved_default_decodes_as_stock_generate(base, config):
    ids = random_prompt(48, seed=3)
    expected = base.generate(ids, do_sample=False, max_new_tokens=24)
    model = copy.copy(base)
    model.generation_config = copy.deepcopy(base.generation_config)
    model.generation_config = saved_and_reloaded(model, config)
    out = model.generate(ids, do_sample=False, max_new_tokens=24, return_dict_in_generate=True)
    assert out.vericache_stats is not None  # decoded by VeriCache, as saved
    assert torch.equal(out.sequences, expected)


class OwnCompressor(KnormCompressor):
    """A compressor class of a user's own: JSON cannot name it."""


def test_a_compressor_that_cannot_be_named_is_refused_and_nothing_is_saved(base):
    model = copy.copy(base)
    model.generation_config = copy.deepcopy(base.generation_config)
    for compressor, kwargs in [
        (OwnCompressor(0.5), {}),
        (["snapkv", OwnCompressor(0.5)], {}),
        ("kivi", {"bits": torch.tensor(2)}),
    ]:
        config = VeriCacheConfig(compressor=compressor, compressor_kwargs=kwargs)
        with pytest.raises(ValueError, match="cannot be saved in a generation config.*vericache_config="):
            set_default_mode(model, config)
    assert getattr(model.generation_config, "generation_mode", None) is None
    assert getattr(model.generation_config, "vericache_config", None) is None
    with pytest.raises(ValueError, match="exactly one of 'compressor' and 'kvpress'"):
        VeriCacheConfig(compressor={"bits": 2})
    with pytest.raises(ValueError, match="Unknown compressor name"):
        VeriCacheConfig(compressor={"compressor": "nope"})


def test_a_refresh_policy_is_plain_settings():
    policy = RefreshPolicy(every_tokens=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.every_tokens = 4
    config = VeriCacheConfig(compressor="knorm", refresh={"every_tokens": 8, "min_accepted": None})
    assert config.refresh == policy and config.to_dict()["refresh"] == {
        "every_tokens": 8,
        "min_accepted": None,
        "window_rounds": 4,
    }


class Turns:
    """Two threads whose verify rounds strictly alternate: each round, from its verify pass to the next one's
    start, runs while the other thread waits, so the two calls' refresh checks alternate too."""

    def __init__(self, names: tuple[str, str]) -> None:
        self.names, self.turn, self.done = names, None, set()
        self.changed = threading.Condition()

    def hand_over(self) -> None:
        me = threading.current_thread().name
        other = next(name for name in self.names if name != me)
        with self.changed:
            self.turn = other
            self.changed.notify_all()
            if not self.changed.wait_for(lambda: self.turn == me or other in self.done, timeout=60):
                raise TimeoutError("the other call never handed the turn back")

    def finished(self) -> None:
        with self.changed:
            self.done.add(threading.current_thread().name)
            self.changed.notify_all()


def test_calls_that_share_a_config_each_count_towards_its_refresh_policy(monkeypatch):
    """Every round of both calls commits 4 tokens (a draft tier that drops nothing accepts every draft). One
    clock shared by the calls would see 8 tokens between two checks and refresh only in whichever call checks
    second; each call's own clock refreshes it every other round, as a call alone does."""
    model = tiny_model("llama")
    config = VeriCacheConfig(
        compressor="knorm",
        compression_ratio=0.0,
        draft_length=3,
        draft_schedule="fixed",
        draft_matmul="stock",
        refresh=RefreshPolicy(every_tokens=8),
    )
    before = copy.deepcopy(config)
    ids = random_prompt(40, seed=5)
    expected = model.generate(ids, do_sample=False, max_new_tokens=33)

    def run() -> tuple[torch.Tensor, int]:
        out = model.generate(
            ids,
            do_sample=False,
            max_new_tokens=33,
            generation_mode="vericache",
            vericache_config=config,
            return_dict_in_generate=True,
        )
        assert out.vericache_stats.accepted_tokens == out.vericache_stats.drafted_tokens
        return out.sequences, out.vericache_stats.draft_tier_refreshes

    alone_sequences, alone = run()
    assert torch.equal(alone_sequences, expected) and alone >= 3

    turns, results, errors = Turns(("a", "b")), {}, []
    verify_round = loop.verify_round

    def verify_in_turn(*args, **kwargs):
        turns.hand_over()
        return verify_round(*args, **kwargs)

    def call() -> None:
        try:
            results[threading.current_thread().name] = run()
        except BaseException as error:  # noqa: BLE001 - re-raised by the test's thread
            errors.append(error)
        finally:
            turns.finished()

    monkeypatch.setattr(loop, "verify_round", verify_in_turn)
    threads = [threading.Thread(target=call, name=name) for name in turns.names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    for name in turns.names:
        sequences, refreshes = results[name]
        assert torch.equal(sequences, expected)
        assert refreshes == alone, (name, refreshes, alone)
    assert config == before  # the config holds no count of any call
