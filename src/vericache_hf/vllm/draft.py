"""One request's draft tier outside `generate`: built from its tokens (and, where given, exact K/V of its leading
tokens), then drafted on greedily, round after round, by a transformers model with the same weights.

The state knows exactly which tokens its K/V stand for (`tokens`), so whoever holds it can check that a row's
tokens still extend them before drafting on it (`extends`). Nothing here knows about vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache.capture import QueryCapture
from ..cache.compressor import CompressionContext, Compressor
from ..cache.draft_tier import DraftStore
from ..pass_model import pass_model


class DraftLayer(CacheLayerMixin):
    """One layer: while the state is built, the prompt's exact K/V (any given leading K/V, then the pass's own);
    afterwards its draft tier, to which a round's fed tokens are committed and its drafted tokens appended."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, leading: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        super().__init__()
        self.leading = leading
        self.prompt_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.store: DraftStore | None = None
        self.feeding = False  # the first pass of a round feeds known tokens: they are committed after it
        self.fed: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.store is None:  # the build pass: leading K/V then the pass's tokens
            if self.leading is not None:
                key_states = torch.cat([self.leading[0].to(key_states.dtype), key_states], dim=2)
                value_states = torch.cat([self.leading[1].to(value_states.dtype), value_states], dim=2)
                self.leading = None
            self.prompt_kv = key_states, value_states
            return key_states, value_states
        if self.feeding:
            self.fed = key_states, value_states
        return self.store.extend_draft(key_states, value_states)

    def get_seq_length(self, *args) -> int:
        if self.store is not None:
            return self.store.num_committed + self.store.num_drafted
        return 0 if self.leading is None else self.leading[0].shape[2]

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class DraftState:
    """A request's draft tier and the tokens it stands for.

    `tokens` are the tokens whose K/V the draft tier holds, in order: the request's prompt (compressed) then every
    token a round fed since. `rounds`, `drafted` and `accepted` count what drafting on it earned.
    """

    def __init__(self, drafter: nn.Module, layers: list[DraftLayer], tokens: list[int]) -> None:
        self.model, self.layers = drafter, layers
        self.cache = Cache(layers=layers)
        self.tokens = tokens
        self.pending: list[int] = []  # the last round's drafts, until the row shows which were kept

    @classmethod
    def build(
        cls,
        model: nn.Module,
        compressor: Compressor,
        tokens: Sequence[int],
        leading: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        drafter: nn.Module | None = None,
    ) -> DraftState:
        """Compress `tokens`' K/V into a draft tier. `leading`, per layer, holds exact (1, H_kv, P, D) K/V of the
        first P tokens (from the serving engine's own cache); the rest are computed here, in one pass, which must
        cover at least the last tokens whose queries the compressor reads. `drafter` runs the draft steps (a copy
        with faster draft matmuls, `vericache_hf.drafting.draft_model`); None: the model's pass copy."""
        tokens = list(tokens)
        known = 0 if leading is None else leading[0][0].shape[2]
        read = compressor.queries_read
        if leading is not None and (read is None or len(tokens) - known < read):
            raise ValueError(
                f"{type(compressor).__name__} reads the queries of the last {read or 'all'} tokens, but only "
                f"{len(tokens) - known} of {len(tokens)} are computed here; give fewer leading tokens."
            )
        layers = [
            DraftLayer(None if leading is None else kv) for kv in (leading or [None] * _num_layers(model))
        ]
        builder = pass_model(model)
        state = cls(drafter or builder, layers, tokens)
        device = next(model.parameters()).device
        valid = torch.ones((1, len(tokens)), dtype=torch.bool, device=device)
        capture = QueryCapture(valid, model=builder, last=read or None, inputs=compressor.reads_layer_inputs)
        ids = torch.tensor([tokens[known:]], device=device)
        positions = torch.arange(known, len(tokens), device=device)[None]
        kwargs = {"vericache_capture": capture} if compressor.scores_with_queries else {}
        with torch.inference_mode():
            builder(
                input_ids=ids, position_ids=positions, past_key_values=state.cache, logits_to_keep=1, **kwargs
            )
            for index, layer in enumerate(layers):
                context = capture.pop(index) or CompressionContext(index, valid)
                layer.store = compressor.compress(*layer.prompt_kv, context)
                layer.prompt_kv = None
        return state

    def extends(self, row_tokens: Sequence[int]) -> bool:
        """Whether a row's tokens start with this state's tokens and go further (a round needs one new token)."""
        count = len(self.tokens)
        return len(row_tokens) > count and list(row_tokens[:count]) == self.tokens

    def draft(self, row_tokens: Sequence[int], length: int) -> list[int]:
        """Feed the row's tokens this state has not seen, commit them, then draft `length` tokens greedily."""
        if not self.extends(row_tokens):
            raise ValueError("the row's tokens do not extend this draft state's tokens; build a new state.")
        fed = list(row_tokens[len(self.tokens) :])
        device = next(self.model.parameters()).device
        position = len(self.tokens)
        ids = torch.tensor([fed], device=device)
        drafts: list[int] = []
        for layer in self.layers:
            layer.feeding = True
        with torch.inference_mode():
            for step in range(length):
                positions = torch.arange(position, position + ids.shape[1], device=device)[None]
                logits = self.model(
                    input_ids=ids, position_ids=positions, past_key_values=self.cache, logits_to_keep=1
                ).logits
                if step == 0:
                    self._commit_fed()
                position += ids.shape[1]
                token = int(logits[0, -1].argmax())
                drafts.append(token)
                ids = torch.tensor([[token]], device=device)
            for layer in self.layers:
                layer.store.rollback_draft()
        self.tokens.extend(fed)
        self.pending = drafts
        return drafts

    def accepted(self, row_tokens: Sequence[int]) -> int:
        """How many of the last round's drafts the row kept (the row extends this state)."""
        count = 0
        for drafted, kept in zip(self.pending, row_tokens[len(self.tokens) :], strict=False):
            if drafted != kept:
                break
            count += 1
        return count

    def _commit_fed(self) -> None:
        for layer in self.layers:
            keys, values = layer.fed
            layer.fed, layer.feeding = None, False
            layer.store.commit(
                keys, values, torch.ones((1, keys.shape[2]), dtype=torch.bool, device=keys.device)
            )


def _num_layers(model: nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config.num_hidden_layers
