"""The attention every VeriCache pass runs: the model's own implementation, reached through a name of ours.

Registered once, at import, for each implementation transformers ships: `vericache_sdpa` wraps `sdpa`,
`vericache_eager` the model's own eager function, and so on, each with the mask function of the implementation it
wraps, so transformers builds exactly the masks it would build for the model (a sliding window or chunk counted in
token positions where a row holds masked slots: `window_mask.py`). Only VeriCache's own copy of the
module tree (`pass_model.py`) is configured with these names; the user's model is never changed.

The wrapper adds three things to the stock call, and nothing else:
- **exact queries** for compressors that score tokens with them (SnapKV, H2O): a pass given a `vericache_capture`
  hands each layer's queries to it as attention receives them, after the model's own projections, norms and rotary
  embedding (partial, interleaved or fused, whatever the family does), with the layer's own scaling;
- **the verify pass's kernel**: a pass given a `vericache_verify` (`verify_attention.VerifyPass`) attends with the
  kernel it names, and over a full tier that arrives in chunks where it says so;
- **grouped-query attention on a CPU**: for a multi-token pass with a mask (every verify pass), transformers' sdpa
  repeats K/V across the query heads unless a process-wide variable says otherwise; sdpa's `enable_gqa` computes the
  same result bit for bit on a CPU (checked for float64, float32 and bfloat16 in `tests/test_attention.py`) without
  the copies.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .verify_attention import VERIFY_KWARG
from .window_mask import window_aware

PREFIX = "vericache_"
#: The keyword a forward pass of the pass model takes its `QueryReader` by; it reaches attention through the
#: model's `**kwargs`, as every transformers keyword meant for attention does.
CAPTURE_KWARG = "vericache_capture"
#: The capture open in this thread's pass, for families whose layers do not hand `**kwargs` on to attention: a
#: context variable is per thread, so another thread's forward on the same modules never sees it.
ACTIVE_CAPTURE: ContextVar[QueryReader | None] = ContextVar(CAPTURE_KWARG, default=None)


class QueryReader(Protocol):
    """What a pass hands its attention layers to read their queries: see `cache/capture.py`."""

    def read(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, scaling: float | None
    ) -> None: ...


def wrapped_name(base: str) -> str:
    """The registered name that wraps attention implementation `base`."""
    return base if base.startswith(PREFIX) else PREFIX + base


def base_name(name: str) -> str:
    """The implementation a registered name wraps."""
    return name.removeprefix(PREFIX)


def wrappable(base: str | None) -> bool:
    """Whether attention implementation `base` can be wrapped: eager, or one registered with transformers
    that has a mask function of its own."""
    return base == "eager" or (base in ALL_ATTENTION_FUNCTIONS and base in ALL_MASK_ATTENTION_FUNCTIONS)


def module_eager(module: torch.nn.Module) -> Callable:
    """The eager attention function of the module's own modeling file (softcapping, sinks and the like are there)."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise ValueError(
            f"{type(module).__name__} has no eager_attention_forward in {type(module).__module__}; load the model "
            "with attn_implementation='sdpa'."
        )
    return function


def _grouped_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """sdpa with `enable_gqa` for a multi-token pass on a CPU: the same numbers as transformers' sdpa, which would
    repeat K/V per query head for a masked pass. Anything sdpa itself would refuse or treat specially goes to it."""
    query_length = query.shape[2]
    special = kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if special or not grouped or query_length == 1 or query.device.type != "cpu" or kwargs.get("is_causal"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    is_causal = attention_mask is None and getattr(module, "is_causal", True)
    if is_causal and key.shape[2] != query_length:
        # sdpa's causal flag aligns top-left: only right for a pass that sees no cached token
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=is_causal,
        enable_gqa=True,
    )
    return output.transpose(1, 2).contiguous(), None


def _stock(base: str, module: torch.nn.Module) -> Callable:
    """The attention `base` names, as the wrapper runs it when a pass asks for nothing else."""
    if base == "sdpa":
        return _grouped_sdpa
    return module_eager(module) if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]


def _make(base: str) -> Callable:
    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # `dropout` by position too: kvpress wraps every registered attention function and passes it so
        capture = kwargs.pop(CAPTURE_KWARG, None) or ACTIVE_CAPTURE.get()
        if capture is not None:
            capture.read(module, query, key, kwargs.get("scaling"))
        verify = kwargs.pop(VERIFY_KWARG, None)
        stock = _stock(base, module)
        if verify is not None:  # a verify pass: its kernel, and a full tier that may arrive in chunks
            return verify.attend(module, query, key, value, attention_mask, stock, dropout=dropout, **kwargs)
        return stock(module, query, key, value, attention_mask, dropout=dropout, **kwargs)

    attention.__name__ = attention.__qualname__ = f"{PREFIX}{base}_attention"
    return attention


def register_attention() -> None:
    """Register `vericache_<base>` for every attention implementation transformers knows now (idempotent)."""
    bases = {"eager"} | {name for name in ALL_ATTENTION_FUNCTIONS if name in ALL_MASK_ATTENTION_FUNCTIONS}
    for base in bases:
        if base.startswith(PREFIX) or wrapped_name(base) in ALL_ATTENTION_FUNCTIONS._global_mapping:
            continue
        AttentionInterface.register(wrapped_name(base), _make(base))
        AttentionMaskInterface.register(wrapped_name(base), window_aware(ALL_MASK_ATTENTION_FUNCTIONS[base]))
