"""Vision-language models with image inputs: the prefill gets the images as stock `generate`'s first step does,
and the text decoding that follows is one of the families in `docs/models.md` (Gemma 3's with window layers).
Exact against stock on tiny random models, or refused before decoding where the model derives rotary positions
from the images."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoModelForImageTextToText

import vericache_hf
from vericache_tools.families import tiny_config

#: family: image tokens in the prompt for a 32x32 image of 8x8 patches
IMAGE_TOKENS = {"gemma3": 16, "llava": 16, "smolvlm": 4}
#: families whose pixel values have an images dimension, (batch, images, channels, height, width)
IMAGE_LISTS = {"smolvlm"}
IMAGE_TOKEN = 127


def vision_model(family: str):
    config = tiny_config(family)
    if hasattr(config, "mm_tokens_per_image"):
        config.mm_tokens_per_image = IMAGE_TOKENS[family]
    for name in ("image_token_id", "image_token_index"):  # an id the tiny vocabulary holds
        if getattr(config, name, None) is not None:
            setattr(config, name, IMAGE_TOKEN)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval().to(torch.float64)
    with torch.no_grad():  # sharper outputs, and images that move them: dropping one then shows
        model.get_output_embeddings().weight.mul_(4.0)
        for name, parameter in model.named_parameters():
            if "projector" in name and parameter.ndim == 2:
                if not parameter.any():  # a projection initialised to zeros (Gemma 3's) would drop the image
                    parameter.normal_(std=0.02)
                parameter.mul_(20.0)
    return model, config


def image_prompt(config, tokens: int, seed: int = 0, listed: bool = False) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (1, 48), generator=generator)
    image = IMAGE_TOKEN
    ids[0, 6 : 6 + tokens] = image
    pixels = torch.randn(1, 3, 32, 32, generator=generator, dtype=torch.float64)
    pixels = pixels[:, None] if listed else pixels
    inputs = {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids)}
    return inputs


@pytest.mark.parametrize("family", sorted(IMAGE_TOKENS))
def test_image_prompts_match_stock(family):
    model, config = vision_model(family)
    inputs = image_prompt(config, IMAGE_TOKENS[family], listed=family in IMAGE_LISTS)
    if (
        "token_type_ids" in inspect.signature(model.forward).parameters
    ):  # Gemma 3: image tokens see each other
        inputs["token_type_ids"] = (inputs["input_ids"] == IMAGE_TOKEN).long()
    expected = model.generate(**inputs, do_sample=False, max_new_tokens=16, min_new_tokens=16)
    other_image = {
        **inputs,
        "pixel_values": image_prompt(config, IMAGE_TOKENS[family], 1, family in IMAGE_LISTS)["pixel_values"],
    }
    elsewhere = model.generate(**other_image, do_sample=False, max_new_tokens=16, min_new_tokens=16)
    assert not torch.equal(expected, elsewhere)  # the image moves the output, so dropping it would show
    config_ = vericache_hf.VeriCacheConfig(compressor="snapkv", draft_length=4, draft_schedule="fixed")
    got = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=16,
        min_new_tokens=16,
        generation_mode="vericache",
        vericache_config=config_,
    )
    assert torch.equal(got, expected)


def test_images_with_multimodal_rotary_positions_are_refused_before_decoding():
    model, config = vision_model("qwen2_5_vl")
    ids = torch.randint(3, 100, (1, 24))
    with pytest.raises(ValueError, match="M-RoPE"):
        model.generate(
            input_ids=ids,
            pixel_values=torch.randn(16, 3 * 2 * 8 * 8, dtype=torch.float64),
            image_grid_thw=torch.tensor([[1, 4, 4]]),
            max_new_tokens=2,
            generation_mode="vericache",
        )


def test_mllama_serves_text_alone_and_refuses_image_states():
    """Mllama's cross-attention layers attend to image states, which a text-only call does not give: its decoder
    then skips them, and so does VeriCache's cache (they hold nothing). With image states given, it is refused."""
    from vericache_tools.families import prompts, stock_greedy, vericache_greedy
    from vericache_tools.families import tiny_model as family_model

    model = family_model("mllama").to(torch.float64)
    stats = vericache_hf.VeriCacheStats()
    got = vericache_greedy(model, prompts(3), 30, stats=stats)
    assert torch.equal(got, stock_greedy(model, prompts(3), 30)) and stats.accepted_tokens > 0
    states = torch.zeros(1, 4, 8, model.config.hidden_size, dtype=torch.float64)
    with pytest.raises(ValueError, match="text alone: its cross-attention layers"):
        model.generate(
            **prompts(1), cross_attention_states=states, max_new_tokens=3, generation_mode="vericache"
        )
