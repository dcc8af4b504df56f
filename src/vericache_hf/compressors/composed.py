"""Composition: token dropping stages, then a last stage that builds the draft tier (for example SnapKV then 4-bit).

`VeriCacheConfig(compressor=[SnapKVCompressor(0.75), KIVICompressor(bits=4)])` keeps a quarter of the prompt's
tokens and stores them (and every committed token) in 4 bits: about 1/16 of the full cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..cache.draft_tier import DraftStore
from .base import CompressionContext, Compressor


@dataclass
class ComposedCompressor(Compressor):
    """Apply `stages` in order. Every stage but the last must drop tokens (have `select`); the last builds the
    store, so it decides how committed tokens enter the draft tier. Only the first stage may read hidden states
    (later stages see fewer tokens than the layer's input).

    Parameters:
        stages: two or more compressors.
    """

    stages: list[Compressor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.stages) < 2:
            raise ValueError(f"ComposedCompressor needs at least two stages, got {len(self.stages)}.")
        for index, stage in enumerate(self.stages):
            if not isinstance(stage, Compressor):
                raise TypeError(
                    f"ComposedCompressor stage {index} must be a vericache_hf Compressor, got {type(stage).__name__}."
                )
            if index < len(self.stages) - 1 and not hasattr(stage, "select"):
                raise ValueError(
                    f"Stage {index} ({type(stage).__name__}) does not drop tokens, so it cannot come before another "
                    "stage. Put token-dropping compressors first and a quantizer (or any compressor) last."
                )
            if index > 0 and stage.scores_with_queries:
                raise ValueError(
                    f"Stage {index} ({type(stage).__name__}) scores with the layer's queries, which only the first "
                    "stage can do. Put it first."
                )

    @property
    def scores_with_queries(self) -> bool:  # type: ignore[override]
        return self.stages[0].scores_with_queries

    @property
    def reads_layer_inputs(self) -> bool:  # type: ignore[override]
        return self.stages[0].reads_layer_inputs

    @property
    def queries_read(self) -> int | None:  # type: ignore[override]
        return self.stages[0].queries_read

    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> DraftStore:
        for stage in self.stages[:-1]:
            keys, values, valid = stage.select(keys, values, context)
            context = replace(
                context, valid=valid, module=None, queries=None, hidden_states=None, attention_kwargs={}
            )
        return self.stages[-1].compress(keys, values, context)

    @property
    def restorable(self) -> bool:  # type: ignore[override]
        return self.stages[-1].restorable

    def restore(self, state: dict[str, torch.Tensor]) -> DraftStore:
        return self.stages[-1].restore(state)
