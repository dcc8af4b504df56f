"""KNorm: keep the tokens whose keys have the smallest L2 norm.

Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression". Low-norm keys tend to
draw high attention, so the score is the negated key norm. Needs nothing but the keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import CompressionContext, ScorerCompressor


@dataclass
class KnormCompressor(ScorerCompressor):
    """Score = -||k||, per KV head.

    Parameters:
        compression_ratio: fraction of the prompt's tokens removed.
    """

    compression_ratio: float = 0.5

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        return -keys.float().norm(dim=-1)
