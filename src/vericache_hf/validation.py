"""Checks that a model and a `generate` call can be served exactly, with errors that say why not and what to do."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import GenerationMode

from .compat import passed_cache
from .layer_plan import layer_plan, recurrent_states, text_config, window_layers


def check_model(model) -> None:
    """Refuse, before any decoding, a model VeriCache cannot serve exactly, saying why and what to do."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"VeriCache serves decoder-only models; {type(model).__name__} is an encoder-decoder model. "
            "Use stock generate() for it."
        )
    layer_plan(model, strict=True)


def check_generation(
    model, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict
) -> None:
    if input_ids.ndim != 2 or input_ids.shape[-1] == 0:
        raise ValueError(
            f"VeriCache needs a non-empty prompt of shape (batch, length); got shape {tuple(input_ids.shape)}. "
            "Give at least one token (for example the BOS token)."
        )
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and input_ids.shape[-1] > limit:
        raise ValueError(
            f"The prompt has {input_ids.shape[-1]} tokens but this model allows at most {limit} positions "
            "(config.max_position_embeddings). Shorten the prompt."
        )
    if generation_config.num_beams > 1:
        raise ValueError(
            f"VeriCache does not do beam search (num_beams={generation_config.num_beams}); set num_beams=1, "
            "or drop generation_mode='vericache'."
        )
    if generation_config.use_cache is False:
        raise ValueError("VeriCache is a KV-cache method and needs use_cache=True; remove use_cache=False.")
    if generation_config.assistant_early_exit is not None:
        raise ValueError(
            "VeriCache cannot draft with assistant_early_exit (it drafts with the whole model on the compressed "
            "cache); drop assistant_early_exit, or use prompt_lookup_num_tokens or assistant_model as its proposer."
        )
    # prompt lookup is hierarchical drafting's proposer here; the decoding mode is what remains without it
    mode = copy.copy(generation_config)
    mode.prompt_lookup_num_tokens = None
    mode = mode.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(
            f"VeriCache serves greedy search and sampling only, but these settings select {mode.value}; "
            "use do_sample=False or do_sample=True, or drop generation_mode='vericache'."
        )
    if generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        raise ValueError(
            "VeriCache does not return attentions or hidden states (its passes cover a draft tier and blocks of "
            "tokens); remove output_attentions / output_hidden_states, or drop generation_mode='vericache'."
        )
    cache = passed_cache(model_kwargs)
    if isinstance(cache, Cache) and (cache.get_seq_length() > 0 or type(cache).__name__ != "DynamicCache"):
        raise ValueError(
            f"VeriCache builds its own two-tier cache; a {type(cache).__name__} was passed in past_key_values. "
            "Remove past_key_values (and cache_implementation) from the call."
        )


#: `generate` inputs VeriCache reads itself; any other model input belongs to the prompt (images, their masks).
_DECODING_INPUTS = {
    "attention_mask",
    "position_ids",
    "cache",
    "past_key_values",
    "use_cache",
    "logits_to_keep",
}


def check_prompt_inputs(model, model_kwargs: dict, config, cohorts) -> dict:
    """The inputs only the prefill reads (a vision-language model's `pixel_values`, `token_type_ids`, ...), passed
    to it as stock `generate` passes them to its first step. Refused where the prompt would not be the token ids
    alone: a prefix reused by ids, rows decoded in a shared cohort, or rotary positions the model derives from the
    images (M-RoPE), which later passes would not see."""
    inputs = {k: v for k, v in model_kwargs.items() if k not in _DECODING_INPUTS and v is not None}
    if not inputs:
        return {}
    names = sorted(inputs)
    cross = getattr(text_config(model), "cross_attention_layers", None)
    if cross:
        raise ValueError(
            f"VeriCache serves {type(model).__name__}'s text alone: its cross-attention layers {list(cross)} would "
            f"attend to the image states made from {names}, which VeriCache's tiers do not hold. Use stock "
            "generate() for image inputs with this model, or pass text alone."
        )
    if config.prefix_store is not None or cohorts is not None:
        raise ValueError(
            f"VeriCache reuses and shares prompts by their token ids, but this call also passes {names}. Drop the "
            "prefix store (or call generate directly rather than through VeriCacheEngine) for inputs beyond ids."
        )
    if any(hasattr(module, "get_rope_index") for module in (model, getattr(model, "model", None))):
        raise ValueError(
            f"{type(model).__name__} places image tokens with multimodal rotary positions (M-RoPE) that it derives "
            f"from {names} at the first step; VeriCache's passes give positions of their own, so they would differ "
            "from stock. Use stock generate() for image inputs with this model, or pass text alone."
        )
    return inputs


def check_shared_state(model, config, cohorts=None, prefixes=None) -> None:
    """Refuse a stored or shared prompt for a model with recurrent layers: a stored prefix and a cohort's rows
    carry attention K/V alone, and a recurrent layer's state after a prefix is not made of them. A stored prefix
    carries two tiers, so a model with window layers (one exact tier) is refused it too."""
    layers = sorted(recurrent_states(model))
    if layers and (config.prefix_store is not None or cohorts is not None or prefixes is not None):
        raise ValueError(
            f"{type(model).__name__} keeps a recurrent state in layers {layers}, which VeriCache's prefix stores "
            "and cohorts do not carry (they hold attention K/V). Drop prefix_store, or call generate directly "
            "rather than through VeriCacheEngine, for this model."
        )
    stored = config.prefix_store is not None or prefixes is not None
    windows = sorted(window_layers(layer_plan(model, strict=False))) if stored else []
    if windows:
        raise ValueError(
            f"{type(model).__name__}'s sliding-window or chunked layers {windows} keep one exact tier on the device, "
            "which VeriCache's prefix stores do not carry (they hold the full-attention layers' two tiers). Drop "
            "prefix_store (or the engine's prefix_cache_memory) for this model."
        )
