"""SnapKV: keep the tokens that the last queries of the prompt attend to most.

Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation". The queries of an observation
window at the end of the prompt score every key; scores are averaged over the window and over the query heads that
share a KV head, smoothed by average pooling, and the top tokens are kept per KV head. The window is always kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..checks import check_int
from .base import CompressionContext, ScorerCompressor


def window_queries(context: CompressionContext, window: int) -> torch.Tensor:
    """The (B, H_q, window, D) queries of the prompt's last `window` positions, as the layer's attention received
    them (see `cache/capture.py`)."""
    if context.queries is None:
        raise ValueError(
            f"layer {context.layer_idx}'s queries were not captured; a query-scoring compressor runs inside "
            "generate(generation_mode='vericache'), whose prefill hands them over."
        )
    return context.queries[:, :, -window:]


def received_attention(context: CompressionContext, keys: torch.Tensor) -> torch.Tensor | None:
    """(B, H_kv, T) attention each cached key received from the queries a layer that attends inline used, summed
    over them and over the query heads sharing its KV head (`CompressionContext.attention_received`); None where
    the queries themselves were captured."""
    received = context.attention_received
    if received is None or context.queries is not None:
        return None
    batch, heads, _ = received.shape
    kv_heads, length = keys.shape[1], keys.shape[-2]
    return received[..., :length].reshape(batch, kv_heads, heads // kv_heads, length).sum(2).to(keys.device)


def scored_keys(keys: torch.Tensor, context: CompressionContext) -> torch.Tensor:
    """The keys the queries score: the cache's own, or where it holds latents (multi-head latent attention), the
    keys attention expanded from them, over the same positions."""
    if context.attention_keys is None:
        return keys
    return context.attention_keys[:, :, : keys.shape[-2]]


@dataclass
class SnapKVCompressor(ScorerCompressor):
    """Observation-window attention scores, pooled, then top-k per KV head.

    Parameters:
        compression_ratio: fraction of the prompt's tokens removed.
        window_size: number of final prompt tokens whose queries score the keys (always kept).
        kernel_size: width of the average pooling that smooths the scores.
    """

    scores_with_queries: ClassVar[bool] = True
    compression_ratio: float = 0.5
    window_size: int = 32
    kernel_size: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("SnapKVCompressor.window_size", self.window_size, 1)
        check_int("SnapKVCompressor.kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"SnapKVCompressor.kernel_size must be odd, got {self.kernel_size}.")

    @property
    def queries_read(self) -> int:
        return self.window_size

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        window = min(self.window_size, keys.shape[-2])
        scores = received_attention(context, keys)
        if scores is None:
            keys = scored_keys(keys, context)
            queries = window_queries(context, window).to(torch.float32)
            valid = context.valid.to(keys.device)
            scores = window_attention(queries, keys.to(torch.float32), valid, context.scaling)
        scores = F.avg_pool1d(scores, self.kernel_size, stride=1, padding=self.kernel_size // 2)
        scores[..., -window:] = scores.max() + 1  # the observation window is always kept
        return scores


def window_attention(
    queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float
) -> torch.Tensor:
    """(B, H_kv, T) causal attention weight of each key, averaged over the real queries of the prompt's last w
    positions (`queries`: (B, H_q, w, D)) and over the query heads that share its KV head.

    The query heads of a KV head go side by side in one matmul, so the keys are never repeated per query head, and
    the masks are written in place: at 8k tokens and batch 4 this is most of SnapKV's build, 2.5x faster so."""
    batch, kv_heads, length, dim = keys.shape
    group, window = queries.shape[1] // kv_heads, queries.shape[2]
    logits = queries.reshape(batch, kv_heads, group * window, dim) @ keys.transpose(-1, -2)
    logits.mul_(scaling).masked_fill_(~valid[:, None, None, :], float("-inf"))
    # causal within the window: a window query does not see the window's later keys
    later = torch.ones(window, window, dtype=torch.bool, device=keys.device).triu(1)
    logits.view(batch, kv_heads, group, window, length)[..., -window:].masked_fill_(later, float("-inf"))
    weights = logits.softmax(dim=-1).nan_to_num_(0.0)  # a padding query may see no key at all
    real = valid[:, -window:].to(weights.dtype)  # padding queries do not count
    per_query = (real / real.sum(1, keepdim=True).clamp(min=1) / group).repeat(1, group)  # (B, group * w)
    return (per_query[:, None, None, :] @ weights).squeeze(2)
