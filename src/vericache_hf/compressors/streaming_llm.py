"""StreamingLLM: keep the first tokens (attention sinks) and a recent window.

Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks". The draft tier stays the same size
as decoding goes on: committed tokens enter the window and the oldest window tokens leave it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.draft_tier import DraftStore, TokenStore
from ..checks import check_int
from .base import CompressionContext, ScorerCompressor


class WindowStore(TokenStore):
    """A `TokenStore` that keeps `sinks` leading slots and evicts the oldest of the rest beyond `budget` slots."""

    def __init__(self, keys, values, valid, sinks: int, budget: int) -> None:
        super().__init__(keys, values, valid)
        self.sinks = sinks
        self.budget = budget

    def commit(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        super().commit(keys, values, valid)
        excess = self.length - self.budget
        if excess > 0:
            self.drop_slots(self.sinks, self.sinks + excess)


@dataclass
class StreamingLLMCompressor(ScorerCompressor):
    """Sink tokens plus the most recent tokens.

    Parameters:
        compression_ratio: fraction of the prompt's tokens removed.
        n_sink: leading tokens always kept (the attention sinks).
    """

    compression_ratio: float = 0.5
    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("StreamingLLMCompressor.n_sink", self.n_sink, 0)

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        valid = context.valid.to(keys.device)
        order = valid.long().cumsum(-1) - 1  # index among the row's real tokens
        scores = order.to(torch.float32)
        scores = scores.masked_fill(order < self.n_sink, float(keys.shape[-2] + 1))
        return scores[:, None, :].expand(-1, keys.shape[1], -1)

    def make_store(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> DraftStore:
        # Short prompts are kept whole; the window then fills up to at least one token beyond the sinks.
        budget = max(keys.shape[-2], self.n_sink + 1)
        return WindowStore(keys, values, valid, sinks=self.n_sink, budget=budget)
