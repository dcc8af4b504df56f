"""The interface the cache builds a draft tier through. Compressors (`vericache_hf.compressors`) implement it; the
cache depends only on this file, never on a particular method."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from .draft_tier import DraftStore


@dataclass
class CompressionContext:
    """What a compressor may read when it builds one layer's draft tier at prefill.

    `valid` is (B, T) bool, False on left padding. For compressors that score with queries (`scores_with_queries`),
    `queries` are the layer's (B, H_q, w, D) queries of the prompt's last w positions, exactly as its attention
    received them (after norms and rotary embedding), with the layer's `scaling`, and `module` is the attention
    layer. Where the cache holds latents (multi-head latent attention), `attention_keys` are the (B, H_q, T', D)
    keys attention received, expanded from them, its first T positions those of the cache. Where a layer computes
    attention inline rather than through transformers' attention interface (Bloom, MPT, XGLM, ...), its queries are
    out of reach, but the attention probabilities it returns are not: `attention_received` (B, H_q, T) is then the
    attention each key received, summed over the real queries read (the prompt's last w, or all of a pass).
    Compressors that run code of their own on the layer (`reads_layer_inputs`, kvpress presses) also get its
    input `hidden_states` (B, w, hidden) and `attention_kwargs` (its forward kwargs, `position_embeddings`
    included), and `model`.
    """

    layer_idx: int
    valid: torch.Tensor
    model: nn.Module | None = None
    module: nn.Module | None = None
    queries: torch.Tensor | None = None
    scaling: float | None = None
    attention_keys: torch.Tensor | None = None
    attention_received: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    attention_kwargs: dict[str, Any] = field(default_factory=dict)

    def at_positions(self, index: slice) -> CompressionContext:
        """This context cut to the pass positions `index`: its queries, inputs and rotary embeddings (views). Attention
        already summed over queries (`attention_received`) stays whole: it scores with every query the pass read."""
        kwargs = dict(self.attention_kwargs)
        if "position_embeddings" in kwargs:
            cos, sin = kwargs["position_embeddings"]
            kwargs["position_embeddings"] = (cos[:, index], sin[:, index])
        return replace(
            self,
            queries=self.queries[:, :, index] if self.queries is not None else None,
            hidden_states=self.hidden_states[:, index] if self.hidden_states is not None else None,
            attention_kwargs=kwargs,
        )

    def detached(self) -> CompressionContext:
        """A copy whose tensors are its own (a view would keep the whole pass's tensors alive while it is held)."""
        return replace(
            self,
            queries=self.queries.clone() if self.queries is not None else None,
            attention_keys=self.attention_keys.clone() if self.attention_keys is not None else None,
            attention_received=self.attention_received.clone()
            if self.attention_received is not None
            else None,
            hidden_states=self.hidden_states.clone() if self.hidden_states is not None else None,
        )


class Compressor(ABC):
    """Builds a layer's draft tier from its exact K/V. Subclasses are dataclasses holding their parameters."""

    #: True when `compress` scores with the prompt's queries (`context.queries`, `context.module`).
    scores_with_queries: ClassVar[bool] = False
    #: True when `compress` also reads the layer's input (`context.hidden_states`, `context.attention_kwargs`).
    reads_layer_inputs: ClassVar[bool] = False

    def check_layer(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> None:
        """Raise, at the prefill, what `compress` would raise on this model, when the draft tier itself is built
        later (after the first token): a compressor that runs code it cannot vouch for on every family overrides
        it. Most compressors' `compress` cannot fail on a layer it was given, so this does nothing."""
        return None

    @abstractmethod
    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> DraftStore:
        """Turn (B, H_kv, T, D) keys/values into this layer's draft tier."""

    @property
    def queries_read(self) -> int | None:
        """How many of the prompt's last tokens' layer inputs `compress` reads: 0 for a K/V-only compressor, None
        for all of them. A prompt whose leading K/V come from a shared prefix is prefilled from there on, so only
        a compressor that reads no more than that suffix's queries can build its draft tier then."""
        return None if self.scores_with_queries else 0

    @property
    def restorable(self) -> bool:
        """Whether `restore` can rebuild this compressor's draft tier (what a prefix store needs)."""
        return type(self).restore is not Compressor.restore

    def restore(self, state: dict[str, torch.Tensor]) -> DraftStore:
        """The draft tier a store's `export()` described (read back from a prefix store, already on the device)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot restore a draft tier from a prefix store; use a token-dropping or "
            "quantizing compressor (snapkv, streaming_llm, knorm, h2o, kivi...) with prefix_store."
        )
