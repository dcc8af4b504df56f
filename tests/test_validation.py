"""Bad input gets a clear error that names the problem and the fix; nothing falls back to lossy output."""

from __future__ import annotations

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from vericache_hf import VeriCacheConfig
from vericache_hf.compressors import (
    KIVICompressor,
    SnapKVCompressor,
    StreamingLLMCompressor,
    build_compressor,
)

from .conftest import random_prompt, tiny_model


def run(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=4, do_sample=False, generation_mode="vericache", **kwargs)


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_config_rejects_ratios_outside_zero_one(ratio):
    with pytest.raises(ValueError, match="compression_ratio"):
        VeriCacheConfig(compression_ratio=ratio)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"draft_length": 0}, "draft_length"),
        ({"draft_schedule": "sometimes"}, "draft_schedule"),
        ({"min_draft_length": 9, "max_draft_length": 4}, "min_draft_length"),
        ({"draft_length": 100, "max_draft_length": 64}, "draft_length"),
    ],
)
def test_config_rejects_bad_draft_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VeriCacheConfig(**kwargs)


def test_unknown_compressor_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="snapkv"):
        build_compressor("zipper", 0.5)
    with pytest.raises(TypeError, match="Compressor"):
        build_compressor(42, 0.5)


def test_quantizer_ratio_that_maps_to_no_bit_width_is_an_error():
    with pytest.raises(ValueError, match=r"compression_ratio=0\.7.*bits="):
        KIVICompressor(compression_ratio=0.7)
    with pytest.raises(ValueError, match="bits"):
        KIVICompressor(bits=3)
    assert KIVICompressor(compression_ratio=0.875).bits == 2
    assert KIVICompressor(bits=4).compression_ratio == 0.75


def test_compressor_parameters_are_checked():
    with pytest.raises(ValueError, match="kernel_size"):
        SnapKVCompressor(kernel_size=4)
    with pytest.raises(ValueError, match="n_sink"):
        StreamingLLMCompressor(n_sink=-1)
    with pytest.raises(ValueError, match="compression_ratio"):
        SnapKVCompressor(compression_ratio=1.0)


def test_empty_prompt_is_refused(llama):
    with pytest.raises(ValueError, match="non-empty prompt"):
        run(llama, torch.zeros((1, 0), dtype=torch.long))


def test_prompt_longer_than_the_model_allows_is_refused():
    model = tiny_model("llama", max_position_embeddings=32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        run(model, random_prompt(40))


def test_a_window_counts_positions_where_a_row_has_holes():
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    from vericache_hf.window_mask import window_aware

    padding = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1]], dtype=torch.bool)  # a pad, then holes at slots 3 and 4
    kwargs = dict(batch_size=1, q_length=2, kv_length=8, q_offset=6, kv_offset=0, local_size=3)
    got = window_aware(sdpa_mask)(
        mask_function=sliding_window_causal_mask_function(3), attention_mask=padding, **kwargs
    )
    # positions of slots 1, 2, 5, 6, 7 are 0..4: the query at slot 6 (position 3) sees positions 1..3
    assert got[0, 0].tolist() == [
        [False, False, True, False, False, True, True, False],
        [False, False, False, False, False, True, True, True],
    ]
    counted_in_slots = sdpa_mask(
        mask_function=sliding_window_causal_mask_function(3), attention_mask=padding, **kwargs
    )
    assert not torch.equal(got, counted_in_slots)


@pytest.mark.parametrize(
    "family, match",
    [
        ("minimax", "'linear_attention': .* past recording"),  # its code keeps no state per token
        ("zamba", "shared by several decoder layers"),  # one attention module serves several layers
    ],
)
def test_a_hybrid_that_cannot_be_rolled_back_is_refused_before_decoding_naming_why(family, match):
    from vericache_tools.families import prompts
    from vericache_tools.families import tiny_model as family_model

    model = family_model(family).float()
    with pytest.raises(ValueError, match=match):
        model.generate(**prompts(1), max_new_tokens=2, generation_mode="vericache")


def test_mistral_without_sliding_window_is_served_exactly():
    model = tiny_model("mistral")
    ids = random_prompt(40, seed=2)
    expected = model.generate(ids, max_new_tokens=20, do_sample=False)
    got = model.generate(ids, max_new_tokens=20, do_sample=False, generation_mode="vericache")
    assert torch.equal(got, expected)


def test_encoder_decoder_model_is_refused():
    config = T5Config(
        vocab_size=128, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0
    )
    model = T5ForConditionalGeneration(config).eval()
    with pytest.raises(ValueError, match="decoder-only"):
        run(model, random_prompt(6))


def test_unknown_generation_mode_is_refused(llama):
    with pytest.raises(ValueError, match="generation_mode"):
        llama.generate(random_prompt(5), max_new_tokens=2, generation_mode="lossless-magic")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_beams": 2}, "beam"),
        ({"use_cache": False}, "use_cache"),
        ({"cache_implementation": "static"}, "StaticCache"),
    ],
)
def test_generate_settings_that_cannot_be_served_are_refused(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        run(llama, random_prompt(10), **kwargs)
