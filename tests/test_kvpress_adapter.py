"""kvpress presses as VeriCache compressors: exact against stock `generate` in float64, per-layer budgets kept to
equal slot counts, key-masking presses rejected, and importing kvpress through the adapter leaves stock untouched."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vericache_hf import VeriCacheConfig
from vericache_hf.compressors.kvpress_adapter import KVPressCompressor, import_kvpress

from .conftest import random_prompt, tiny_model
from .conftest import vericache_dict as run

pytest.importorskip("kvpress")
kvpress = import_kvpress()

#: kvpress-style registry: press class and constructor kwargs.
PRESSES = [
    (kvpress.SnapKVPress, {"compression_ratio": 0.5, "window_size": 8}),
    (kvpress.KnormPress, {"compression_ratio": 0.75}),
    (kvpress.StreamingLLMPress, {"compression_ratio": 0.5}),
    (kvpress.ExpectedAttentionPress, {"compression_ratio": 0.5}),
    (kvpress.TOVAPress, {"compression_ratio": 0.5}),
    (kvpress.KeyDiffPress, {"compression_ratio": 0.5}),
    (kvpress.RandomPress, {"compression_ratio": 0.5}),
    (kvpress.PyramidKVPress, {"compression_ratio": 0.5, "window_size": 8}),
]


@pytest.fixture(scope="module")
def deep_llama():
    """Four layers, so per-layer budgets differ."""
    return tiny_model("llama", num_hidden_layers=4)


@pytest.mark.parametrize(("cls", "kwargs"), PRESSES, ids=[cls.__name__ for cls, _ in PRESSES])
def test_press_matches_stock(deep_llama, cls, kwargs):
    ids = random_prompt(48, seed=21)
    out = run(deep_llama, ids, cls(**kwargs), max_new_tokens=30)
    assert torch.equal(out.sequences, deep_llama.generate(ids, do_sample=False, max_new_tokens=30))
    cache = out.past_key_values
    assert len({layer.draft.num_committed for layer in cache.layers}) == 1
    assert out.vericache_stats.draft_tier_bytes < out.vericache_stats.full_tier_bytes


def test_per_layer_budgets_are_topped_up_to_equal_slot_counts(deep_llama):
    ids = random_prompt(40, seed=22)
    press = kvpress.PerLayerCompressionPress(kvpress.KnormPress(), compression_ratios=[0.25, 0.75, 0.5, 0.9])
    out = run(deep_llama, ids, press, max_new_tokens=20)
    assert torch.equal(out.sequences, deep_llama.generate(ids, do_sample=False, max_new_tokens=20))
    # Every layer holds the largest budget: 30 of the 40 prompt tokens.
    for layer in out.past_key_values.layers:
        assert layer.draft.num_committed == layer.full.length - 10


def test_left_padded_batch_and_budget(llama):
    ids = random_prompt(36, batch=2, seed=23)
    mask = torch.ones_like(ids)
    ids[0, :7], mask[0, :7] = 0, 0
    expected = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    press = KVPressCompressor(press=kvpress.SnapKVPress(window_size=4), budget=10)
    assert torch.equal(run(llama, ids, press, attention_mask=mask, max_new_tokens=20).sequences, expected)
    # built in the prefill, as on an accelerator (on the CPU, a draft that needs it would build it)
    config = VeriCacheConfig(compressor=kvpress.KnormPress(0.5), compression_budget=9, stage_on_cpu=True)
    out = llama.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=1,
        generation_mode="vericache",
        vericache_config=config,
        return_dict_in_generate=True,
    )
    assert out.past_key_values.layers[1].draft.num_committed == 9


def test_press_then_quantizer_composes(llama):
    from vericache_hf.compressors import KIVICompressor  # noqa: PLC0415

    ids = random_prompt(48, seed=24)
    compressor = [
        kvpress.SnapKVPress(0.5, window_size=8),
        KIVICompressor(bits=4, group_size=8, residual_length=4),
    ]
    out = run(llama, ids, compressor, max_new_tokens=24)
    assert torch.equal(out.sequences, llama.generate(ids, do_sample=False, max_new_tokens=24))


def test_presses_that_save_nothing_or_need_hooks_are_rejected():
    with pytest.raises(ValueError, match="only masks keys"):
        KVPressCompressor(press=kvpress.AdaKVPress(kvpress.KnormPress(0.5)))
    with pytest.raises(ValueError, match="Pass a list"):
        KVPressCompressor(press=kvpress.ComposedPress([kvpress.KnormPress(0.5)]))
    with pytest.raises(TypeError, match="kvpress press"):
        KVPressCompressor(press="snapkv")


def test_importing_kvpress_through_the_adapter_leaves_stock_generate_untouched():
    script = textwrap.dedent(
        """
        import torch
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from tests.conftest import tiny_model, random_prompt
        model, ids = tiny_model("llama"), random_prompt(30, seed=25)
        before = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS}
        expected = model.generate(ids, do_sample=False, max_new_tokens=15)
        from vericache_hf.compressors.kvpress_adapter import import_kvpress
        import_kvpress()
        after = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS}
        assert all(after[name] is before[name] for name in before), "kvpress patched attention functions"
        assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=15), expected)
        print("ok")
        """
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
