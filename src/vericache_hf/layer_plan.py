"""What each decoder layer is, read from the model itself, and whether VeriCache can serve it exactly.

A model is served when every decoder layer is self-attention over a KV cache: full attention, a sliding window or
attention chunks (the window and chunks count token positions, whatever holes ragged acceptance leaves in a row;
see `window_mask.py`), or a layer whose recurrent, linear-attention or convolution state transformers keeps in a
linear-attention cache layer and whose model hands over the state after each token of a block (past recording):
VeriCache rolls that state back to each row's accepted tokens (`cache/recurrent.py`). Any other kind is refused
with its kind named and the reason.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

from torch import nn
from transformers.cache_utils import get_layer_types_and_kwargs

from .pass_model import attention_layers

#: `config.layer_types` values that are self-attention over a KV cache.
ATTENTION_KINDS = {"full_attention", "sliding_attention", "chunked_attention", "attention", "global", "local"}
SLIDING_KINDS = {"sliding_attention", "local"}
CHUNKED_KIND = "chunked_attention"
#: transformers' layer types whose cache is a linear-attention layer (a recurrent or convolution state, no KV).
RECURRENT_KINDS = {"linear_attention", "conv"}
#: Layer types with no attention and no state at all (a feed-forward block alone), and cross-attention to images
#: (Mllama), which a text-only call skips: nothing to cache.
STATELESS_KINDS = {"mlp", "moe", "cross_attention"}
#: transformers' layer types that hold attention K/V and a recurrent state side by side.
PAIRED_KINDS = {"hybrid", "hybrid_sliding"}


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer: its kind (a `config.layer_types` value, or `full_attention`), its window in tokens
    (sliding or chunked layers), None for full attention, and the number of recurrent states it keeps (transformers'
    cache kwargs; 0 for a layer without one)."""

    index: int
    kind: str
    window: int | None = None
    states: int = 0

    @property
    def servable(self) -> bool:
        return self.kind in ATTENTION_KINDS | RECURRENT_KINDS | PAIRED_KINDS | STATELESS_KINDS

    @property
    def recurrent(self) -> bool:
        """Whether the layer keeps a recurrent or convolution state (alone, or beside attention K/V)."""
        return self.kind in RECURRENT_KINDS or self.kind in PAIRED_KINDS

    @property
    def attends(self) -> bool:
        """Whether the layer is self-attention over a KV cache (the layers with a draft and a full tier)."""
        return self.kind not in RECURRENT_KINDS and self.kind not in STATELESS_KINDS


def text_config(model: nn.Module):
    """The decoder's config: a vision-language model's text config, or the model's own."""
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def _kinds(config, layers: int) -> list[str]:
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return [str(kind) for kind in kinds]
    block_types = getattr(config, "layers_block_type", None)  # Jamba, Zamba and other hybrids
    if block_types:
        return ["full_attention" if kind == "attention" else str(kind) for kind in block_types]
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        return ["sliding_attention"] * layers
    return ["full_attention"] * layers


def _cache_kinds(config, layers: int) -> tuple[list[str], list[dict]] | None:
    """transformers' own cache layer types and their kwargs, where it has them for this config (recurrent kinds
    included)."""
    try:
        kinds, kwargs = get_layer_types_and_kwargs(config)
    except (AttributeError, TypeError, ValueError):
        return None
    return ([str(kind) for kind in kinds], kwargs) if len(kinds) >= layers else None


def recurrent_states(model: nn.Module) -> dict[int, int]:
    """The decoder layers that keep a recurrent state, each with its number of states."""
    return {plan.index: plan.states for plan in layer_plan(model, strict=False) if plan.recurrent}


class CacheLayout(NamedTuple):
    """What `VeriCache` builds besides two-tier attention layers (its keyword arguments of these names)."""

    #: the recurrent layers, each with its number of states
    recurrent: dict[int, int]
    #: those of them that hold attention K/V too
    paired: set[int]
    #: the layers with nothing to cache
    stateless: set[int]
    #: the sliding-window or chunked layers that keep one exact tier on the device, each with its window
    windowed: dict[int, int]
    #: whether those attend in chunks
    chunked: bool
    #: the window of a model whose every attention layer slides by one window (`tail_window`)
    verify_window: int | None


def cache_layout(model: nn.Module) -> CacheLayout:
    """What `VeriCache` builds besides two-tier attention layers, from one plan."""
    plans = layer_plan(model, strict=False)
    windows = window_layers(plans)
    return CacheLayout(
        recurrent={plan.index: plan.states for plan in plans if plan.recurrent},
        paired={plan.index for plan in plans if plan.kind in PAIRED_KINDS},
        stateless={plan.index for plan in plans if plan.kind in STATELESS_KINDS},
        windowed=windows,
        chunked=any(plans[i].kind == CHUNKED_KIND for i in windows),
        verify_window=None if windows else tail_window(plans),
    )


def tail_window(plans: list[LayerPlan]) -> int | None:
    """The window of a model whose every attention layer is a sliding window of one size (Mistral v0.1, Phi-3,
    Starcoder2): such a model keeps two tiers in every layer, and its verify passes read only the full tier's tail
    that some row's window still reaches. None for any other model."""
    attending = [plan for plan in plans if plan.attends]
    sizes = {plan.window for plan in attending}
    sliding = all(plan.kind in SLIDING_KINDS for plan in attending)
    return sizes.pop() if attending and sliding and len(sizes) == 1 and None not in sizes else None


def window_layers(plans: list[LayerPlan]) -> dict[int, int]:
    """The sliding-window or chunked layers served by one exact tier on the device (`cache/window.py`), with their
    window or chunk: those of a model that also has full-attention layers, whose draft tier is where compression
    saves. Where every attention layer is windowed, the windows keep two tiers, since drafting over a compressed
    window is the only saving left (their verify passes read the tail a window reaches, `tail_window`); and windows
    of different sizes or kinds (sliding and chunked) would need masks of their own, so they keep two tiers too."""
    windows = {
        plan.index: plan.window
        for plan in plans
        if plan.kind in SLIDING_KINDS | {CHUNKED_KIND} and plan.window
    }
    kinds = {plans[i].kind == CHUNKED_KIND for i in windows}
    full = any(plan.attends and plan.window is None and plan.kind not in PAIRED_KINDS for plan in plans)
    return windows if full and len(set(windows.values())) == 1 and len(kinds) == 1 else {}


@cache
def records_past(module_name: str) -> bool:
    """Whether a modeling module hands its cache the state after each token of a block when asked (transformers'
    past recording, which its own speculative decoding uses to roll a hybrid model back)."""
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return False
    return "get_recurrent_states_to_keep" in source or "is_recording_past" in source


def layer_plan(model: nn.Module, strict: bool = True) -> list[LayerPlan]:
    """Each decoder layer's plan. With `strict`, a model VeriCache cannot serve exactly raises a ValueError that
    names the layer kind and what to do instead."""
    config = text_config(model)
    layers = getattr(config, "num_hidden_layers", None) or len(attention_layers(model))
    kinds = _kinds(config, layers)[:layers]
    cached, states = _cache_kinds(config, layers) or ([], [])
    # a layer transformers caches with a linear-attention state is recurrent, whatever its name
    stateful = {
        i: kwargs.get("number_of_states", 1)
        for i, kwargs in enumerate(states)
        if cached[i] in RECURRENT_KINDS | PAIRED_KINDS
    }
    kinds = [cached[i] if i in stateful else kind for i, kind in enumerate(kinds)]
    cross = set(getattr(config, "cross_attention_layers", None) or [])
    kinds = ["cross_attention" if i in cross else kind for i, kind in enumerate(kinds)]
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    plans = []
    for index, kind in enumerate(kinds):
        size = chunk if kind == CHUNKED_KIND else window if kind in SLIDING_KINDS else None
        plans.append(LayerPlan(index, kind, size, stateful.get(index, 0)))
    if strict:
        check_plan(model, plans)
    return plans


#: Why a layer kind that is not plain self-attention cannot be served, by the words its `layer_types` use.
_STATEFUL = ("linear", "mamba", "conv", "recurrent", "rwkv", "ssm", "hybrid", "mlp", "moe")
_SECOND_CACHE = ("indexed", "compressed", "sparse")
#: What a modeling file builds a windowed layer's mask with: a family that imports none of these keeps its window
#: by dropping tokens from the cache instead.
_WINDOW_MASKS = (
    "create_sliding_window_causal_mask",
    "create_chunked_causal_mask",
    "create_masks_for_generate",
)


def refusal_reason(kind: str) -> str:
    """Why VeriCache cannot serve a layer of this kind exactly."""
    if kind in RECURRENT_KINDS | PAIRED_KINDS:
        return (
            "its recurrent or convolution state would be advanced by a draft past the accepted tokens, and the "
            "model's code does not hand over the state after each token of a block (transformers' past recording) "
            "for VeriCache to roll it back to"
        )
    if any(word in kind for word in _SECOND_CACHE):
        return (
            "it selects or compresses keys with a cache of its own (an indexer's keys or a compressed KV) beside "
            "the attention KV, which VeriCache's draft and full tiers do not hold"
        )
    if any(word in kind for word in _STATEFUL):
        return (
            "it keeps a recurrent, linear-attention or convolution state outside transformers' linear-attention "
            "cache layers, which a draft would advance past the accepted tokens with no copy to roll back to"
        )
    return "VeriCache does not know this layer kind, so it cannot promise exactness for it"


def check_plan(model: nn.Module, plans: list[LayerPlan]) -> None:
    """Refuse, before any decoding, a model with a layer VeriCache cannot serve exactly."""
    name = type(model).__name__
    odd = sorted({plan.kind for plan in plans if not plan.servable})
    if not records_past(type(model).__module__):
        odd = sorted(set(odd) | {plan.kind for plan in plans if plan.recurrent})
    if odd:
        reasons = "; ".join(f"{kind!r}: {refusal_reason(kind)}" for kind in odd)
        raise ValueError(
            f"VeriCache cannot serve {name} exactly because of its layers of kind {reasons}. Use stock generate() "
            "(or its assistant_model / prompt_lookup_num_tokens speculative decoding) for this model."
        )
    config = text_config(model)
    windowed = sorted({plan.kind for plan in plans if plan.window is not None})
    masks = vars(sys.modules.get(type(model).__module__, object))
    if windowed and not any(name in masks for name in _WINDOW_MASKS):
        raise ValueError(
            f"VeriCache cannot serve {name} exactly: its {windowed} layers keep their window by dropping tokens "
            "from the cache, not through a sliding-window mask, and VeriCache's full tier keeps every token. "
            "Use a config without the window (sliding_window=None), or stock generate()."
        )
    if getattr(config, "ngram", None):
        raise ValueError(
            f"VeriCache cannot serve {name}: its decoder predicts {config.ngram} n-gram streams and, with a cache, "
            "takes one token per pass, so a block of drafted tokens cannot be verified in one pass. Use stock "
            "generate() for this model."
        )
    attention = attention_layers(model)
    shared = [
        m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")
    ]
    if not attention and shared:
        raise ValueError(
            f"VeriCache cannot serve {name}: its attention module is shared by several decoder layers and carries "
            "no layer index of its own, so VeriCache cannot tell which layer's draft and full tiers a pass reads. "
            "Use stock generate() for this model."
        )
    if not attention:
        raise ValueError(
            f"VeriCache cannot serve {name}: it has no self-attention layers that read a KV cache through "
            "transformers' Cache (nothing to compress or verify against). Use stock generate() for this model."
        )
    if len(attention) < sum(1 for plan in plans if plan.attends):
        raise ValueError(
            f"VeriCache cannot serve {name} exactly: only {len(attention)} of its {len(plans)} decoder layers are "
            "self-attention over a KV cache; the others keep a recurrent or convolution state that drafting would "
            "advance past the accepted tokens. Use stock generate() for this model."
        )
    bidirectional = sorted(
        {
            module.layer_idx
            for name, module in model.named_modules()
            if module in attention
            and getattr(module, "is_causal", True) is False
            and "encoder" not in name
            and "cross" not in name
        }
    )
    if getattr(config, "is_decoder", None) is not False and getattr(config, "is_causal", True) is not False:
        bidirectional = []  # the model builds causal masks whatever its modules' flags say
    if bidirectional:
        raise ValueError(
            f"VeriCache cannot serve {name} exactly: its attention layers {bidirectional} are bidirectional "
            "(is_causal=False), so a block of drafted tokens would let earlier tokens see later ones. Load it as a "
            "decoder (is_decoder=True in its config), or use stock generate()."
        )


def check_compressor(model: nn.Module, compressor) -> None:
    """Refuse a compressor that cannot score this model's cache, before any pass. Multi-head latent attention
    (DeepSeek V2/V3, Kimi, MiniCPM3) caches latents: SnapKV and H2O score the keys attention expands from them
    (`cache/capture.py`), but a kvpress press scores the cache itself, with queries it derives on its own."""
    if getattr(compressor, "reads_layer_inputs", False) and getattr(text_config(model), "kv_lora_rank", None):
        raise ValueError(
            f"{type(compressor).__name__} scores the cache with queries of its own, but {type(model).__name__} "
            "uses multi-head latent attention: its cache holds compressed latents, which those queries do not "
            "score. Use snapkv or h2o (they score the keys attention expands from the latents), or a compressor "
            "that reads the cache alone (streaming_llm, knorm, kivi, quanto, ...)."
        )
