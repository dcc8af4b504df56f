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
from transformers.models.llama.modeling_llama import rotate_half

from ..checks import check_int
from .base import CompressionContext, ScorerCompressor


def window_queries(context: CompressionContext, window: int) -> torch.Tensor:
    """Post-RoPE queries (B, H_q, window, D) of the last `window` prompt tokens, recomputed from the layer input."""
    module, hidden = context.module, context.hidden_states[:, -window:]
    head_dim = module.head_dim
    queries = module.q_proj(hidden).view(*hidden.shape[:-1], -1, head_dim)
    if hasattr(module, "q_norm"):  # Qwen3 normalises queries per head before RoPE
        queries = module.q_norm(queries)
    queries = queries.transpose(1, 2)
    cos, sin = context.attention_kwargs["position_embeddings"]
    cos, sin = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
    return queries * cos + rotate_half(queries) * sin


@dataclass
class SnapKVCompressor(ScorerCompressor):
    """Observation-window attention scores, pooled, then top-k per KV head.

    Parameters:
        compression_ratio: fraction of the prompt's tokens removed.
        window_size: number of final prompt tokens whose queries score the keys (always kept).
        kernel_size: width of the average pooling that smooths the scores.
    """

    needs_hidden_states: ClassVar[bool] = True
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
        batch, kv_heads, length, _ = keys.shape
        window = min(self.window_size, length)
        queries = window_queries(context, window).to(torch.float32)  # (B, H_q, w, D)
        group = queries.shape[1] // kv_heads
        expanded_keys = keys.to(torch.float32).repeat_interleave(group, dim=1)  # (B, H_q, T, D)
        logits = queries @ expanded_keys.transpose(-1, -2) * context.module.scaling  # (B, H_q, w, T)
        valid = context.valid.to(keys.device)
        query_pos = torch.arange(length - window, length, device=keys.device)
        causal = torch.arange(length, device=keys.device)[None, :] <= query_pos[:, None]  # (w, T)
        allowed = causal[None, None] & valid[:, None, None, :]
        weights = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        query_valid = valid[:, -window:].to(weights.dtype)[:, None, :, None]  # ignore padding queries
        scores = (weights * query_valid).sum(2) / query_valid.sum(2).clamp(min=1)  # (B, H_q, T)
        scores = scores.view(batch, kv_heads, group, length).mean(2)
        scores = F.avg_pool1d(scores, self.kernel_size, stride=1, padding=self.kernel_size // 2)
        scores[..., -window:] = scores.max() + 1  # the observation window is always kept
        return scores
