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


class OnlineSoftmax:
    """Running softmax-weighted sum of value chunks: (B, H_kv, rows, D) queries against key chunks arriving in turn."""

    def __init__(self, queries: torch.Tensor, scaling: float) -> None:
        # Half-precision models attend in float32 here, as the fused kernels accumulate internally.
        self.compute_dtype = torch.promote_types(queries.dtype, torch.float32)
        self.queries = queries.to(self.compute_dtype)
        self.scaling = scaling
        self.maximum: torch.Tensor | None = None  # (B, H_kv, rows, 1)
        self.total: torch.Tensor | None = None  # sum of exp(score - maximum)
        self.weighted: torch.Tensor | None = None  # sum of exp(score - maximum) * value

    def add(self, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor) -> None:
        """Attend to one chunk; `allowed` broadcasts to (B, H_kv, rows, chunk) and is False where masked."""
        keys, values = keys.to(self.compute_dtype), values.to(self.compute_dtype)
        scores = torch.matmul(self.queries, keys.transpose(-1, -2)) * self.scaling
        scores = scores.masked_fill(~allowed, float("-inf"))
        chunk_max = scores.amax(dim=-1, keepdim=True)
        maximum = chunk_max if self.maximum is None else torch.maximum(self.maximum, chunk_max)
        safe_max = torch.where(torch.isinf(maximum), torch.zeros_like(maximum), maximum)  # rows masked so far
        weights = torch.exp(scores - safe_max)
        weighted = torch.matmul(weights, values)
        total = weights.sum(dim=-1, keepdim=True)
        if self.maximum is not None:
            rescale = torch.exp(self.maximum - safe_max)
            weighted = weighted + self.weighted * rescale
            total = total + self.total * rescale
        self.maximum, self.total, self.weighted = maximum, total, weighted

    def result(self) -> torch.Tensor:
        return self.weighted / self.total


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
