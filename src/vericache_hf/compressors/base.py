"""The score-then-gather base that token-dropping methods share. The interface every compressor implements,
`Compressor`, is the cache's (`cache/compressor.py`), re-exported here.

A compressor turns a layer's full K/V after prefill (plus whatever it needs, such as the attention module and its
input hidden states) into a `DraftStore`: the draft tier of that layer. The store also decides how newly committed
tokens enter it: appended, windowed, or quantized.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass

import torch

from ..cache.compressor import CompressionContext, Compressor
from ..cache.draft_tier import DraftStore, TokenStore
from ..checks import check_budget, check_ratio

__all__ = ["CompressionContext", "Compressor", "ScorerCompressor"]


@dataclass
class ScorerCompressor(Compressor):
    """Token dropping by score: keep the `1 - compression_ratio` share of tokens (or `budget` tokens) that score
    highest, per head.

    A subclass implements `score`; this base masks padding, takes the top-k per (row, head), keeps the kept tokens in
    their original order (`select`) and builds the store (`make_store`, appending committed tokens by default).
    """

    compression_ratio: float = 0.5
    budget: int | None = None

    def __post_init__(self) -> None:
        check_ratio(f"{type(self).__name__}.compression_ratio", self.compression_ratio)
        check_budget(f"{type(self).__name__}.budget", self.budget)

    @abstractmethod
    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        """(B, H_kv, T) importance of each token; higher is kept."""

    def kept_tokens(self, length: int) -> int:
        if self.budget is not None:
            return min(length, self.budget)
        return max(1, math.ceil(length * (1.0 - self.compression_ratio)))

    def make_store(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> DraftStore:
        return TokenStore(keys, values, valid)

    def select(
        self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept (B, H, kept, D) keys/values and their (B, kept) validity, in their original order."""
        length = keys.shape[-2]
        kept = self.kept_tokens(length)
        valid = context.valid.to(keys.device)
        if kept >= length:
            return keys, values, valid
        scores = self.score(keys, values, context).float()
        if scores.shape[1] != keys.shape[1]:  # scored per query head over latents held in fewer cache heads
            scores = scores.view(scores.shape[0], keys.shape[1], -1, length).mean(2)
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        indices = scores.topk(kept, dim=-1).indices.sort(dim=-1).values  # (B, H, kept)
        gather = indices.unsqueeze(-1)
        kept_keys = keys.gather(2, gather.expand(-1, -1, -1, keys.shape[-1]))
        kept_values = values.gather(2, gather.expand(-1, -1, -1, values.shape[-1]))
        # Padding is only kept when a row holds fewer real tokens than the budget; it sorts first in every head
        # (left padding), so the validity of a slot is the same across heads.
        return kept_keys, kept_values, valid.gather(1, indices[:, 0])

    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> DraftStore:
        return self.make_store(*self.select(keys, values, context))

    def restore(self, state: dict[str, torch.Tensor]) -> DraftStore:
        return self.make_store(state["keys"], state["values"], state["valid"])
