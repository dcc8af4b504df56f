"""Edges: settings refused when the config is made, finite timeouts, a reload of the registration, the top-level
TransferError and a readable stats line."""

from __future__ import annotations

import importlib
import math

import pytest
from transformers.generation.utils import GenerationMixin

import vericache_hf
from vericache_hf import VeriCacheConfig, VeriCacheStats
from vericache_hf.checks import check_seconds
from vericache_hf.compressors import (
    ComposedCompressor,
    KIVICompressor,
    SnapKVCompressor,
    available_compressors,
    build_compressor,
    check_compressor_spec,
)

from .conftest import random_prompt

MIB = 1024 * 1024


class FakePress:
    """Stands for a kvpress press: `is_press` goes by the class's module, so kvpress need not be installed."""

    __module__ = "kvpress.presses.fake_press"


# 1. The compressor is checked when the config is made.


def test_unknown_compressor_name_is_refused_by_the_config():
    with pytest.raises(ValueError, match="'snapk'") as info:
        VeriCacheConfig(compressor="snapk")
    for name in available_compressors():
        assert name in str(info.value)


def test_bad_list_entries_are_refused_by_the_config_with_their_index():
    with pytest.raises(TypeError, match="entry 1"):
        VeriCacheConfig(compressor=["snapkv", 3])
    with pytest.raises(TypeError, match="entry 0"):
        VeriCacheConfig(compressor=[None, "kivi"])
    with pytest.raises(ValueError, match=r"'zipper' \(list entry 1\)"):
        VeriCacheConfig(compressor=["snapkv", "zipper"])
    with pytest.raises(ValueError, match="two or more"):
        VeriCacheConfig(compressor=["snapkv"])
    with pytest.raises(TypeError, match="compressor must be"):
        VeriCacheConfig(compressor=42)


def test_compressor_kwargs_that_cannot_apply_are_refused_by_the_config():
    with pytest.raises(ValueError, match="compressor_kwargs"):
        VeriCacheConfig(compressor=["snapkv", "kivi"], compressor_kwargs={"bits": 2})
    with pytest.raises(ValueError, match="compressor_kwargs"):
        VeriCacheConfig(compressor=SnapKVCompressor(0.5), compressor_kwargs={"window_size": 8})
    with pytest.raises(ValueError, match="compressor_kwargs"):
        VeriCacheConfig(compressor=FakePress(), compressor_kwargs={"x": 1})
    with pytest.raises(TypeError, match="compressor_kwargs must be a dict"):
        VeriCacheConfig(compressor="kivi", compressor_kwargs=[("bits", 2)])
    with pytest.raises(ValueError, match="compression_budget"):
        VeriCacheConfig(compressor="kivi", compression_budget=8)


def test_every_valid_compressor_spec_is_still_accepted():
    for spec in [
        *available_compressors(),
        "SnapKV",
        "streaming-llm",
        SnapKVCompressor(0.5),
        FakePress(),
        ["snapkv", "kivi"],
        ("knorm", KIVICompressor(bits=4)),
        [FakePress(), "kivi"],
    ]:
        VeriCacheConfig(compressor=spec)
    VeriCacheConfig(compressor="kivi", compressor_kwargs={"bits": 2})
    VeriCacheConfig(compressor=["snapkv", "kivi"], compression_budget=8)


def test_build_compressor_applies_the_same_rules():
    with pytest.raises(TypeError, match="entry 1"):
        build_compressor(["snapkv", 3], 0.5)
    with pytest.raises(TypeError, match="entry 1"):
        check_compressor_spec(["snapkv", 3])
    with pytest.raises(ValueError, match="snapk"):
        build_compressor("snapk", 0.5)
    # A budget goes to the token-dropping stages of a list; the quantizer keeps the ratio's bit width.
    composed = build_compressor(["snapkv", "kivi"], 0.75, 8)
    assert isinstance(composed, ComposedCompressor)
    assert composed.stages[0].budget == 8
    assert composed.stages[1].bits == 4


# 2. Timeouts are finite.


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0, -1.0, 1e300])
def test_non_finite_or_non_positive_timeouts_are_refused(value):
    with pytest.raises(ValueError, match="transfer_timeout"):
        VeriCacheConfig(transfer_timeout=value)


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_the_timeout_message_asks_for_a_finite_number_of_seconds(value):
    with pytest.raises(ValueError, match=r"my_timeout.*finite number of seconds"):
        check_seconds("my_timeout", value)


def test_finite_timeouts_are_accepted():
    check_seconds("t", 0.01)
    check_seconds("t", 3600)
    assert VeriCacheConfig(transfer_timeout=5).transfer_timeout == 5


# 3. Reloading the registration neither recurses nor wraps twice.


def test_reload_keeps_generate_wrapped_exactly_once(llama):
    registration = importlib.import_module("vericache_hf.registration")
    stock = registration._stock_generate
    ids = random_prompt(12)
    settings = dict(max_new_tokens=8, do_sample=False)
    reference = stock(llama, ids, **settings)

    importlib.reload(registration)
    assert registration._stock_generate is stock
    assert llama.generate(ids, **settings).tolist() == reference.tolist()

    importlib.reload(vericache_hf)
    wrapper = GenerationMixin.generate
    assert wrapper is registration.generate_with_modes
    assert wrapper.__wrapped_stock__ is stock
    assert not hasattr(stock, "__wrapped_stock__")
    assert llama.generate(ids, **settings).tolist() == reference.tolist()
    config = VeriCacheConfig(compressor="streaming_llm", draft_length=4)
    out = llama.generate(ids, generation_mode="vericache", vericache_config=config, **settings)
    assert out.tolist() == reference.tolist()


# 4. TransferError at the top level.


def test_transfer_error_is_exported():
    from vericache_hf.cache.transfer import TransferError

    assert vericache_hf.TransferError is TransferError
    assert "TransferError" in vericache_hf.__all__


# 5. A short, readable stats line.


def test_stats_str_is_one_short_line_with_the_numbers():
    stats = VeriCacheStats(
        rounds=12,
        plain_rounds=2,
        row_rounds=10,
        accepted_tokens=53,
        emitted_tokens=80,
        bytes_to_device=round(41.2 * MIB),
        bytes_to_host=round(3.1 * MIB),
        transfer_seconds=1.0,
        transfer_wait_seconds=0.36,
    )
    text = str(stats)
    assert len(text) < 200 and "\n" not in text
    for part in ("12 rounds", "2 plain", "5.3 accepted/round", "80 tokens", "41.2 MiB", "3.1 MiB", "64%"):
        assert part in text, (part, text)
    assert repr(stats).startswith("VeriCacheStats(rounds=12")
    assert "hidden" not in str(VeriCacheStats())
