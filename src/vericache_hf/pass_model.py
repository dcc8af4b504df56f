"""The module tree VeriCache's passes run on: the model's own parameters and buffers, its own config.

A VeriCache pass needs what stock attention does not give: each layer's exact queries at prefill, and on a CPU
sdpa's grouped-query path for a masked multi-token pass (`attention.py`). Changing the user's model for a call
(its attention setting, hooks on its modules) would change every other thread's forward too, plain `generate`
included. So the passes run on a copy of the module tree that shares every parameter and buffer tensor with the
model (no memory) and holds its own config, whose decoder attention is set once to the wrapped implementation
(`vericache_sdpa` for `sdpa`, ...).

The copy is made once per model and reused by every call (under a lock). It follows the model: a model moved to
another device or type, given other parameter tensors, or set to another attention implementation gets a new one.
"""

from __future__ import annotations

import copy
import inspect
import threading
import weakref
from functools import cache

import torch
from torch import nn

from .attention import base_name, wrappable, wrapped_name
from .cache.capture import record_layer_input, record_probabilities

_COPIES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, nn.Module]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def decoder_configs(model: nn.Module) -> list:
    """The configs the decoder's attention layers read their implementation from (one for a causal LM; the text
    config of a vision-language model), each once."""
    configs: dict[int, object] = {}
    for module in attention_layers(model):
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs[id(config)] = config
    if not configs:
        configs[id(model.config)] = model.config
    return list(configs.values())


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder's self-attention modules: named `...Attention` with a `layer_idx` (a vision tower's have none)."""
    return [
        module
        for module in model.modules()
        if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int)
    ]


def attention_base(model: nn.Module) -> str | None:
    """The attention implementation the model's decoder runs (the first decoder config's)."""
    return decoder_configs(model)[0]._attn_implementation


def check_attention(model: nn.Module) -> None:
    """Refuse a model whose decoder attention cannot be wrapped, naming the implementation and what to load."""
    for config in decoder_configs(model):
        base = base_name(config._attn_implementation or "eager")
        if not wrappable(base):
            raise ValueError(
                f"VeriCache runs the model's own attention through transformers' attention interface, but this "
                f"model's decoder uses attn_implementation={config._attn_implementation!r}, which has no mask "
                "function there. Load it with attn_implementation='sdpa' (or 'eager')."
            )


def _fingerprint(model: nn.Module) -> tuple:
    """What a copy must match: the tensors it shares (identity, device and type) and the attention setting."""
    tensors = [*model.parameters(), *model.buffers()]
    return (
        tuple(id(t) for t in tensors),
        tuple(str(t.device) for t in tensors[:1] + tensors[-1:]),
        tuple(t.dtype for t in tensors[:1] + tensors[-1:]),
        tuple(config._attn_implementation for config in decoder_configs(model)),
    )


def pass_model(model: nn.Module) -> nn.Module:
    """The shared copy of `model` whose decoder attention is wrapped (see the module docstring); made on first use,
    and again when the model's tensors or attention setting changed since."""
    check_attention(model)
    key = _fingerprint(model)
    with _LOCK:
        held = _COPIES.get(model)
        if held is None or held[0] != key:
            held = key, wrapped_copy(model)
            _COPIES[model] = held
        return held[1]


def shared_copy(model: nn.Module, memo: dict[int, object] | None = None) -> nn.Module:
    """A copy of the module tree holding the model's own parameters and buffers (deepcopy's memo hands them back),
    or the tensors `memo` gives instead."""
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    shared.update(memo or {})
    with torch.no_grad():
        return copy.deepcopy(model, shared).eval()


def wrapped_copy(model: nn.Module) -> nn.Module:
    """A shared copy whose decoder configs name the wrapped attention of their own implementation, and whose
    attention layers hand their input, and the probabilities a layer attending inline returns, to a pass's capture
    (`cache/capture.py`)."""
    copied = shared_copy(model)
    set_attention(copied, None)
    for module in copied.modules():  # hooks on the model when it was copied are its user's, not the passes'
        for hooks in (
            module._forward_hooks,
            module._forward_hooks_with_kwargs,
            module._forward_hooks_always_called,
            module._forward_pre_hooks,
            module._forward_pre_hooks_with_kwargs,
        ):
            hooks.clear()
    for module in attention_layers(copied):
        module.register_forward_pre_hook(record_layer_input, with_kwargs=True)
        if attends_inline(type(module)):
            module.register_forward_hook(record_probabilities, with_kwargs=True)
    return copied


@cache
def attends_inline(module_type: type) -> bool:
    """Whether an attention layer may compute attention itself rather than through transformers' attention
    interface (its forward never names the interface, or returns probabilities on request): only such layers'
    outputs are read for probabilities, so no other layer's forward pays for a hook."""
    try:
        source = inspect.getsource(module_type.forward)
    except (OSError, TypeError):
        return True
    takes = "output_attentions" in inspect.signature(module_type.forward).parameters
    return takes or "ALL_ATTENTION_FUNCTIONS" not in source


def set_attention(copied: nn.Module, base: str | None) -> None:
    """Point a copy's decoder attention at the wrapper of `base`, or of each config's own implementation when
    None. Only the copy's configs change: the model's are other objects (deepcopy)."""
    for config in decoder_configs(copied):
        own = base or base_name(config._attn_implementation or "eager")
        config._attn_implementation_internal = wrapped_name(own)
