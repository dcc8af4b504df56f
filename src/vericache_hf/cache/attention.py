"""Verify-pass attention over a full tier that arrives in chunks.

The verify pass must attend to every committed token, but the full tier never sits on the device as a whole: its
chunks stream through a few fixed-size staging buffers. Each chunk's attention is computed as it arrives and merged
with the running result by the log-sum-exp rule (flash-attention's online softmax), so device memory for the full tier
depends on the chunk size and the buffer count, not on the context length. The verified tokens' own K/V come last,
with a causal mask among themselves.

The function is registered with transformers' `AttentionInterface` as `"vericache_streamed"`; `streamed_verify`
switches a model to it for one verify forward. That name has no mask function, so transformers builds no
(B, 1, q, context) mask for the pass: padding and rejected-slot masks come from the cache's validity rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

ATTENTION_NAME = "vericache_streamed"


#: torch's fused CPU attention kernel; unlike the public `scaled_dot_product_attention` it also returns each row's
#: log-sum-exp, which is what merging chunks needs. Elsewhere chunks take the plain matmul path.
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def chunk_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of (B, H, rows, D) queries over one chunk, and each row's log-sum-exp of its scores
    ((B, H, rows), -inf where `allowed`, broadcastable to (B, H, rows, chunk), masks the whole chunk)."""
    empty = ~allowed.any(dim=-1)
    if _FUSED_CPU is not None and queries.device.type == "cpu":
        bias = torch.zeros(allowed.shape, dtype=queries.dtype).masked_fill_(~allowed, float("-inf"))
        output, lse = _FUSED_CPU(queries, keys, values, attn_mask=bias, scale=scaling)
    else:
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])
        output = torch.matmul(weights, values)
    # A row that sees no token of this chunk contributes nothing (the fused kernel reports lse 0 for it).
    return output.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))


class OnlineSoftmax:
    """Running attention of (B, H_kv, rows, D) queries over key chunks arriving in turn: each chunk's result is
    merged with the running one by the log-sum-exp rule, so no chunk is kept after it is read."""

    def __init__(self, queries: torch.Tensor, scaling: float) -> None:
        # Half-precision models attend in float32 here, as the fused kernels accumulate internally.
        self.compute_dtype = torch.promote_types(queries.dtype, torch.float32)
        self.queries = queries.to(self.compute_dtype)
        self.scaling = scaling
        self.output: torch.Tensor | None = None  # (B, H_kv, rows, D): attention over the chunks so far
        self.lse: torch.Tensor | None = None  # (B, H_kv, rows): log-sum-exp of their scores

    def add(self, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor) -> None:
        """Attend to one chunk; `allowed` broadcasts to (B, H_kv, rows, chunk) and is False where masked."""
        keys, values = keys.to(self.compute_dtype), values.to(self.compute_dtype)
        output, lse = chunk_attention(self.queries, keys, values, allowed, self.scaling)
        if self.output is None:
            self.output, self.lse = output, lse
            return
        merged = torch.logaddexp(self.lse, lse)
        reference = torch.where(torch.isinf(merged), 0.0, merged)  # rows that saw no token yet
        old_share = torch.exp(self.lse - reference)[..., None]
        new_share = torch.exp(lse - reference)[..., None]
        self.output, self.lse = self.output * old_share + output * new_share, merged

    def result(self) -> torch.Tensor:
        return self.output


def streamed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    vericache_chunks=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of (B, H, q, D) queries over the full tier's chunks, then the q new (B, H_kv, q, D) keys/values.

    `vericache_chunks(layer_idx)` yields (keys, values, valid) per stored chunk, `valid` being (B, chunk) bool on the
    keys' device. Query
    heads share key heads in groups (GQA) without repeating K/V. Returns (B, q, H, D_v), as transformers'
    attention functions do.
    """
    if vericache_chunks is None:
        raise RuntimeError(
            f"the {ATTENTION_NAME!r} attention only serves VeriCache verify passes; load the model with another "
            "attn_implementation."
        )
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scaling = dim**-0.5 if scaling is None else scaling
    # (B, H, q, D) -> (B, H_kv, groups * q, D): query head h reads key head h // groups.
    grouped = query.reshape(batch, kv_heads, groups * length, dim)
    state = OnlineSoftmax(grouped, scaling)
    for keys, values, valid in vericache_chunks(module.layer_idx):
        state.add(keys, values, valid[:, None, None, :])
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    state.add(key, value, causal.repeat(groups, 1))
    output = state.result().to(query.dtype).reshape(batch, heads, length, -1)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, streamed_attention)


@contextmanager
def streamed_verify(model) -> Iterator[None]:
    """Run the model's attention layers with `streamed_attention` inside the block, restoring the implementation
    they had on exit (even on error)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
