"""H2O: keep the heavy hitters, the tokens that received the most attention over the prompt, plus a recent window.

Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models". Every
prompt query's causal attention is accumulated per key (summed over the queries and the query heads sharing a KV
head), computed from the layer's own queries in chunks so memory stays O(chunk x T).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..checks import check_int
from .base import CompressionContext, ScorerCompressor
from .snapkv import window_queries


@dataclass
class H2OCompressor(ScorerCompressor):
    """Accumulated attention over the prompt, top-k per KV head; the last `recent_size` tokens are always kept.

    Parameters:
        compression_ratio: fraction of the prompt's tokens removed.
        recent_size: final prompt tokens always kept (H2O's recent window).
        chunk_size: prompt queries scored at once (bounds the attention matrix held in memory).
    """

    needs_hidden_states: ClassVar[bool] = True
    compression_ratio: float = 0.5
    recent_size: int = 32
    chunk_size: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("H2OCompressor.recent_size", self.recent_size, 0)
        check_int("H2OCompressor.chunk_size", self.chunk_size, 1)

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        batch, kv_heads, length, dim = keys.shape
        queries = window_queries(context, length).float()  # (B, H_q, T, D)
        group = queries.shape[1] // kv_heads
        # the query heads that share a KV head go side by side, so one matmul per KV head serves them all
        queries = queries.view(batch, kv_heads, group, length, dim)
        keys_t = keys.float().transpose(-1, -2)[:, :, None]  # (B, H_kv, 1, D, T)
        valid = context.valid.to(keys.device)
        key_pos = torch.arange(length, device=keys.device)
        scores = keys.new_zeros((batch, kv_heads, length), dtype=torch.float32)
        for start in range(0, length, self.chunk_size):
            stop = min(start + self.chunk_size, length)  # causal: these queries see keys [0, stop) only
            # (B, H_kv, group, chunk, stop)
            logits = queries[..., start:stop, :] @ keys_t[..., :stop] * context.module.scaling
            causal = key_pos[None, :stop] <= torch.arange(start, stop, device=keys.device)[:, None]
            allowed = causal[None, None, None] & valid[:, None, None, None, :stop]
            # a real query always sees itself, so a finite fill never leaves it a row of nothing; padding queries'
            # rows are zeroed below
            weights = logits.masked_fill_(~allowed, torch.finfo(logits.dtype).min).softmax(-1)
            weights = weights * valid[:, None, None, start:stop, None]
            scores[..., :stop] += weights.sum((2, 3))
        if self.recent_size:
            scores[..., -self.recent_size :] = scores.max() + 1
        return scores
