"""The verify pass's attention: a short causal block (k + 1 queries a row) over a long full tier.

Such a pass reads every cached key once for a few queries, so like a decode step it is bound by memory, not by
arithmetic. What the pass hands attention (through the pass model's wrapper, `attention.py`, by the keyword
`vericache_verify`) is a `VerifyPass`: which kernel attends, whether the block is plain lower-right causal (no
masked slot in any row), and, for layers whose full tier arrives in chunks, where the chunks come from.

Kernels (`VeriCacheConfig.verify_attention`), each exact where it runs and each falling back to the model's own
attention where it cannot serve a pass:
- `sdpa`: the model's own attention (on a CPU, sdpa's grouped-query path: `attention._grouped_sdpa`);
- `lower_right`: sdpa with `torch.nn.attention.bias.causal_lower_right`, no materialized mask: on CUDA torch's flash
  kernel, lower-right aligned (only for a pass whose rows hold no masked slot);
- `flex`: FlexAttention with a block mask made from the pass's own mask (compiled on an accelerator; eager, slow but
  exact, on a CPU);
- `flash`: flash-attn's `flash_attn_with_kvcache`, where that package is installed (CUDA, half precision, rows
  without masked slots);
- `auto`: the measured choice for the device (`AUTO`).

A layer whose full tier is longer than one staging chunk is attended chunk by chunk (`streamed_attention`): each
chunk's attention and log-sum-exp, merged as they arrive (flash attention's online softmax), then the block's own
tokens, so the device never holds more of the full tier than its staging buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

#: The keyword a verify pass of the pass model takes its `VerifyPass` by (it reaches attention through `**kwargs`).
VERIFY_KWARG = "vericache_verify"
KERNELS = ("auto", "sdpa", "lower_right", "flex", "flash")
#: The kernel `auto` takes, by device type, from `benchmarks/gpu_verify_kernels.py` (docs/benchmarks/verify-kernels):
#: on the CPU, sdpa's grouped-query path was the fastest of the candidates; on CUDA nothing else has been measured
#: yet, so the model's own attention stays.
AUTO = {"cpu": "sdpa"}
#: Keywords of families whose attention adds something a plain softmax over keys does not have.
_SPECIAL = ("softcap", "position_bias", "s_aux", "sinks", "sliding_window")

Stock = Callable[..., tuple[torch.Tensor, Any]]


def check_kernel(name: str) -> None:
    if name not in KERNELS:
        raise ValueError(f"verify_attention must be one of {KERNELS}, got {name!r}.")


def resolve_kernel(name: str, device: torch.device) -> str:
    """The kernel `name` stands for on `device` (`auto`: the measured choice there)."""
    check_kernel(name)
    return AUTO.get(device.type, "sdpa") if name == "auto" else name


@dataclass
class VerifyPass:
    """What one verify pass tells its attention layers (see the module docstring).

    `chunks(layer_idx)` yields a streamed layer's full tier as (B, H_kv, n, D) key/value chunks on its device, in
    order. `streamed` are the layers whose cache update handed attention only the block's own tokens: the cache
    checks after the pass that each was served here (`served`), so a pass that did not run through the wrapper
    raises instead of attending to the new tokens alone. `windowed` are the window layers (`cache/window.py`): their
    keys are a window's, under a mask of their own, so they take the model's own attention."""

    kernel: str = "sdpa"
    dense: bool = False
    chunks: Callable[[int], Iterator[tuple[torch.Tensor, torch.Tensor]]] | None = None
    streamed: set[int] = field(default_factory=set)
    served: set[int] = field(default_factory=set)
    windowed: frozenset[int] = frozenset()
    _block_masks: dict = field(default_factory=dict, repr=False)

    def attend(self, module, query, key, value, attention_mask, stock: Stock, dropout: float = 0.0, **kwargs):
        """Attention of the pass's (B, H, q, D) queries; `stock` is the model's own attention function."""
        if module.layer_idx in self.streamed:
            self.served.add(module.layer_idx)
            return streamed_attention(
                self, module, query, key, value, attention_mask, stock, dropout, **kwargs
            )
        kernel = self.kernel
        if (
            kernel == "sdpa"
            or module.layer_idx in self.windowed
            or dropout
            or any(kwargs.get(name) is not None for name in _SPECIAL)
        ):
            return stock(module, query, key, value, attention_mask, dropout=dropout, **kwargs)
        if kernel == "lower_right" and self.dense:
            return _lower_right(module, query, key, value, kwargs.get("scaling"))
        if kernel == "flex" and _flex_serves(query, attention_mask):
            return _flex(self, module, query, key, value, attention_mask, kwargs.get("scaling"))
        if kernel == "flash" and self.dense and _flash_serves(query):
            return _flash(query, key, value, kwargs.get("scaling"))
        return stock(module, query, key, value, attention_mask, dropout=dropout, **kwargs)


def _groups(module, query: torch.Tensor, key: torch.Tensor) -> int:
    return query.shape[1] // key.shape[1]


def _lower_right(module, query, key, value, scaling):
    """sdpa with a lower-right causal bias: the block's last query sees every key, the first all but q - 1."""
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(query.shape[2], key.shape[2])
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, scale=scaling, enable_gqa=_groups(module, query, key) > 1
    )
    return output.transpose(1, 2).contiguous(), None


def _flex_serves(query: torch.Tensor, attention_mask) -> bool:
    """FlexAttention takes a boolean mask (or none); its compiled kernels, half and single precision."""
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return False
    return query.device.type == "cpu" or query.dtype != torch.float64


def _flex_function() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


_COMPILED_FLEX: dict[str, Callable] = {}


def _flex_kernel(device: torch.device) -> Callable:
    """FlexAttention compiled once per device type (its fused kernels); eager on a CPU, where compiling takes
    tens of seconds per shape and the eager form is exact."""
    if device.type == "cpu":
        return _flex_function()
    if device.type not in _COMPILED_FLEX:
        _COMPILED_FLEX[device.type] = torch.compile(_flex_function())  # dynamic in the growing key length
    return _COMPILED_FLEX[device.type]


def _flex(verify: VerifyPass, module, query, key, value, attention_mask, scaling):
    """FlexAttention over a block mask made from the pass's own mask (the same for every layer of the pass, so made
    once), or, with none, lower-right causal."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, _, length, _ = query.shape
    keys = key.shape[2]
    shape = (batch, length, keys, query.device)
    block_mask = verify._block_masks.get(shape)
    if block_mask is None:
        if attention_mask is None:
            offset = keys - length

            def allowed(b, h, q, k):
                return k <= q + offset

            masked_batch = None
        else:
            grid = attention_mask[:, 0].expand(batch, length, keys)

            def allowed(b, h, q, k):
                return grid[b, q, k]

            masked_batch = batch
        block_mask = create_block_mask(allowed, masked_batch, None, length, keys, device=query.device)
        verify._block_masks[shape] = block_mask
    output = _flex_kernel(query.device)(
        query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=_groups(module, query, key) > 1
    )
    return output.transpose(1, 2).contiguous(), None


def _flash_serves(query: torch.Tensor) -> bool:
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _flash(query, key, value, scaling):
    """flash-attn's KV-cache kernel: the cache read in place, (B, T, H, D) as strided views of (B, H, T, D);
    causal there is lower-right aligned."""
    from flash_attn import flash_attn_with_kvcache

    output = flash_attn_with_kvcache(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scaling, causal=True
    )
    return output, None


# -- the full tier in chunks ----------------------------------------------------------------------------------------
#: torch's fused CPU attention kernel; unlike the public `scaled_dot_product_attention` it also returns each row's
#: log-sum-exp, which merging chunks needs. Elsewhere chunks take the plain matmul path.
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def chunk_attention(queries, keys, values, allowed, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of (B, H_kv, rows, D) queries over one (B, H_kv, n, D) chunk, and each row's log-sum-exp
    of its scores ((B, H_kv, rows)). `allowed` (B, 1, rows, n) is False where masked, or None (all allowed); a row
    that sees no key of the chunk gets output 0 and log-sum-exp -inf, so it adds nothing when merged."""
    empty = None if allowed is None else ~allowed.any(dim=-1)
    if _FUSED_CPU is not None and queries.device.type == "cpu":
        bias = None
        if allowed is not None:
            bias = torch.zeros(allowed.shape, dtype=queries.dtype).masked_fill_(~allowed, float("-inf"))
        output, lse = _FUSED_CPU(queries, keys, values, attn_mask=bias, scale=scaling)
    else:
        scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * scaling
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - (lse if empty is None else torch.where(empty, 0.0, lse))[..., None])
        output = torch.matmul(weights.to(values.dtype), values)
    if empty is not None:
        output = output.masked_fill(empty[..., None], 0.0)
        lse = lse.masked_fill(empty, float("-inf"))
    return output, lse


class OnlineSoftmax:
    """Attention of grouped queries over chunks arriving in turn: each chunk's result is merged with the running
    one by the log-sum-exp rule, so no chunk is kept after it is read. Merges in float32 at least."""

    def __init__(self) -> None:
        self.output: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, output: torch.Tensor, lse: torch.Tensor) -> None:
        dtype = torch.promote_types(output.dtype, torch.float32)
        output, lse = output.to(dtype), lse.to(dtype)
        if self.output is None:
            self.output, self.lse = output, lse
            return
        merged = torch.logaddexp(self.lse, lse)
        reference = torch.where(torch.isinf(merged), 0.0, merged)  # rows that saw no key yet
        self.output = (
            self.output * torch.exp(self.lse - reference)[..., None]
            + output * torch.exp(lse - reference)[..., None]
        )
        self.lse = merged


def _grouped_allowed(mask: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """(B, 1, q, n) mask (bool, or additive float: 0 allowed) as (B, 1, groups * q, n) bool, the rows of the
    grouped queries (query head g of a key head reads row g * q + t)."""
    if mask is None:
        return None
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return allowed.repeat(1, 1, groups, 1)


def streamed_attention(
    verify: VerifyPass, module, query, key, value, attention_mask, stock: Stock, dropout, **kw
):
    """Attention of (B, H, q, D) queries over a layer's full tier, chunk by chunk (`verify.chunks`), then over the
    block's own (B, H_kv, q, D) keys and values; the mask (B, 1, q, stored + q) is the pass's own, sliced per chunk.
    Query heads share key heads in groups without repeating K/V. A family whose attention adds more than a masked
    softmax (softcapping, sinks, a position bias) or dropout gets its own attention over the chunks joined."""
    layer = module.layer_idx
    if (
        dropout
        or any(kw.get(name) is not None for name in _SPECIAL)
        or (
            attention_mask is not None
            and attention_mask.dtype != torch.bool
            and not _additive_mask(attention_mask)
        )
    ):
        pieces = list(verify.chunks(layer))
        keys = torch.cat([p[0] for p in pieces] + [key], dim=2)
        values = torch.cat([p[1] for p in pieces] + [value], dim=2)
        return stock(module, query, keys, values, attention_mask, dropout=dropout, **kw)
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scaling = kw.get("scaling")
    scaling = dim**-0.5 if scaling is None else scaling
    grouped = query.reshape(batch, kv_heads, groups * length, dim)
    state, start = OnlineSoftmax(), 0
    for keys, values in verify.chunks(layer):
        count = keys.shape[2]
        mask = None if attention_mask is None else attention_mask[..., start : start + count]
        if mask is not None and (verify.dense or _allows_all(mask)):  # every query sees every stored token
            mask = None
        state.add(*chunk_attention(grouped, keys.to(query.dtype), values.to(query.dtype),
                                   _grouped_allowed(mask, groups), scaling))  # fmt: skip
        start += count
    if attention_mask is not None:
        own = attention_mask[..., start : start + length]
    else:  # no mask handed: the block is causal among itself and sees every stored token
        own = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()[None, None]
    state.add(*chunk_attention(grouped, key, value, _grouped_allowed(own, groups), scaling))
    output = state.output.to(query.dtype).reshape(batch, heads, length, -1)
    return output.transpose(1, 2).contiguous(), None


def _allows_all(mask: torch.Tensor) -> bool:
    """A chunk of the mask that masks nothing (no padding, no rejected slot in it) needs no mask: the kernel runs
    its unmasked path, and no bias is built."""
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def _additive_mask(mask: torch.Tensor) -> bool:
    """A float mask that only allows (0) or forbids (the dtype's lowest value or -inf), as transformers' eager
    masks do; anything else is a bias the chunked path does not add."""
    lowest = torch.finfo(mask.dtype).min
    return bool(((mask == 0) | (mask == lowest) | (mask == float("-inf"))).all())
