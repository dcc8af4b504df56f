"""Sliding-window and chunked masks that count token positions, not cache slots.

Transformers builds a sliding layer's mask from slot indices (`kv_idx > q_idx - window`), which equal positions
while a row's tokens sit in consecutive slots, as in stock `generate`. VeriCache's rows accept different counts per
round, so a row can hold masked slots between its tokens; counted in slots, its window would then see fewer tokens
than stock's. Where the padding mask has such holes, the mask functions registered for VeriCache's attention
(`attention.py`) build the window from each slot's position instead, the number of real tokens before it in its row,
which is what stock's slot index measures. Without holes they build exactly transformers' mask.

A chunk needs absolute positions, not only their differences. Where a chunked layer holds only the tail of each row's
tokens (a window layer, `cache/window.py`) and a draft pass places that tail after the draft tier's layout, the
slots before it count other tokens: the pass then sets `WINDOW_DROPPED`, each row's real tokens before the tail, and
the chunks are counted from there. The variable is per thread (a context variable), so another thread's forward on
the same model never sees it. Such a span is built as a mask even when it is shorter than a chunk, where
transformers would leave attention unmasked: it may still cross a chunk boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

import torch
from transformers.masking_utils import prepare_padding_mask

#: (B,) real tokens each row had before the chunked window layers' span of the running draft pass's mask; None when
#: that span's slots count them (a verify pass reads the full tier's layout, a prefill starts at the first token).
WINDOW_DROPPED: ContextVar[torch.Tensor | None] = ContextVar("vericache_window_dropped", default=None)


def has_holes(padding: torch.Tensor) -> bool:
    """Whether some row has a masked slot after its first real token."""
    started = padding.cumsum(-1) > 0
    return bool((started & ~padding).any())


def _positional(positions: torch.Tensor, size: int, chunked: bool) -> Callable:
    """The causal window (or chunk) of `size` tokens over each slot's position in its row."""

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        q_pos, kv_pos = positions[batch_idx, q_idx], positions[batch_idx, kv_idx]
        local = (q_pos // size == kv_pos // size) if chunked else (q_pos - kv_pos < size)
        return (kv_idx <= q_idx) & local

    return inner


def window_aware(base: Callable) -> Callable:
    """`base` (a transformers mask function such as `sdpa_mask`), counting a window in positions where a row has
    holes, and a chunk in absolute positions where a draft pass says its span starts late (`WINDOW_DROPPED`).
    Chunks are told from windows by the config that asked (`attention_chunk_size`)."""

    def mask(*args, **kwargs):
        size, padding_2d = kwargs.get("local_size"), kwargs.get("attention_mask")
        config = kwargs.get("config")
        chunked = (
            size is not None
            and getattr(config, "attention_chunk_size", None) == size
            and getattr(config, "sliding_window", None) != size
        )
        kv_length, kv_offset = kwargs.get("kv_length"), kwargs.get("kv_offset", 0)
        if chunked and kv_offset:
            # a window's span starts past position 0: fewer than a chunk of slots may still cross a chunk boundary,
            # so transformers' shortcut (no mask below a chunk's length) does not hold
            kwargs["allow_is_causal_skip"] = False
        if size is None or padding_2d is None or padding_2d.ndim != 2:
            return base(*args, **kwargs)
        padding = prepare_padding_mask(padding_2d.bool(), kv_length, kv_offset)
        dropped = WINDOW_DROPPED.get() if chunked else None
        if dropped is None and not has_holes(padding):
            return base(*args, **kwargs)
        positions = padding.long().cumsum(-1) - 1
        if dropped is not None:  # the span's first real token is each row's token number `dropped`
            before = padding[:, :kv_offset].sum(-1)
            positions = positions + (dropped.to(positions.device) - before)[:, None]
        span = kwargs.get("q_offset", 0) + kwargs["q_length"]
        if positions.shape[-1] < span:  # query slots past the mask's end (transformers pads the same way)
            positions = torch.nn.functional.pad(positions, (0, span - positions.shape[-1]))
        kwargs.update(
            mask_function=_positional(positions, size, chunked), allow_is_causal_skip=False, use_vmap=False
        )
        return base(*args, **kwargs)

    mask.__name__ = mask.__qualname__ = f"window_aware_{getattr(base, '__name__', 'mask')}"
    return mask
