"""Requests' draft tiers outside `generate`: each built from its request's tokens (and, where given, exact K/V of
its leading tokens), then drafted on greedily, round after round, by a transformers model with the same weights,
every drafting request in one batched pass per drafted token (`draft_rows`).

A state knows exactly which tokens its K/V stand for (`tokens`), so whoever holds it can check that a row's tokens
still extend them before drafting on it (`extends`). Nothing here knows about vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache.capture import QueryCapture
from ..cache.compressor import CompressionContext, Compressor
from ..cache.draft_tier import DraftStore
from ..compat import cache_kwargs
from ..pass_model import pass_model


class _PassLayer(CacheLayerMixin):
    """Base of the layers below: a cache layer read by one model pass at a time, never cropped or compiled."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class PromptLayer(_PassLayer):
    """One layer while a state is built: any given leading K/V, then the build pass's own."""

    def __init__(self, leading: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        super().__init__()
        self.leading = leading
        self.prompt_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.leading is not None:
            key_states = torch.cat([self.leading[0].to(key_states.dtype), key_states], dim=2)
            value_states = torch.cat([self.leading[1].to(value_states.dtype), value_states], dim=2)
            self.leading = None
        self.prompt_kv = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, *args) -> int:
        return 0 if self.leading is None else self.leading[0].shape[2]


class RoundLayer(_PassLayer):
    """One layer's K/V for a round that several rows draft at once: each row's draft tier, left-padded to the
    longest (`width` slots), then the round's passes. The round's first pass feeds each row's new tokens, left-padded
    to the most any row feeds; they are kept (`fed`) for the rows' tiers to commit once the round has drafted."""

    def __init__(self, stores: list[DraftStore], width: int, capacity: int) -> None:
        super().__init__()
        self.stores, self.width, self.capacity = stores, width, capacity
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = width
        self.fed: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys is None:
            self._gather(key_states, value_states)
            self.fed = key_states, value_states
        count = key_states.shape[2]
        self.keys[:, :, self.length : self.length + count] = key_states
        self.values[:, :, self.length : self.length + count] = value_states
        self.length += count
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def _gather(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads = key_states.shape[:2]
        self.keys = key_states.new_zeros((batch, heads, self.capacity, key_states.shape[-1]))
        self.values = value_states.new_zeros((batch, heads, self.capacity, value_states.shape[-1]))
        for row, store in enumerate(self.stores):
            keys, values = store.extend_draft(key_states[:1, :, :0], value_states[:1, :, :0])
            store.rollback_draft()
            start = self.width - keys.shape[2]
            self.keys[row, :, start : self.width] = keys[0]
            self.values[row, :, start : self.width] = values[0]

    def get_seq_length(self, *args) -> int:
        return self.length


class DraftState:
    """A request's draft tier and the tokens it stands for.

    `tokens` are the tokens whose K/V the draft tier (`stores`, one per layer) holds, in order: the request's prompt
    (compressed) then every token a round fed since. `pending` holds the last round's drafts until the row shows
    which were kept.
    """

    def __init__(self, drafter: nn.Module, stores: list[DraftStore], tokens: list[int]) -> None:
        self.model, self.stores = drafter, stores
        self.tokens = tokens
        self.pending: list[int] = []

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
            PromptLayer(None if leading is None else kv) for kv in (leading or [None] * _num_layers(model))
        ]
        builder = pass_model(model)
        device = next(model.parameters()).device
        valid = torch.ones((1, len(tokens)), dtype=torch.bool, device=device)
        capture = QueryCapture(valid, model=builder, last=read or None, inputs=compressor.reads_layer_inputs)
        ids = torch.tensor([tokens[known:]], device=device)
        positions = torch.arange(known, len(tokens), device=device)[None]
        kwargs = {"vericache_capture": capture} if compressor.scores_with_queries else {}
        stores = []
        with torch.inference_mode():
            builder(
                input_ids=ids,
                position_ids=positions,
                **cache_kwargs(builder, Cache(layers=layers)),
                logits_to_keep=1,
                **kwargs,
            )
            for index, layer in enumerate(layers):
                context = capture.pop(index) or CompressionContext(index, valid)
                stores.append(compressor.compress(*layer.prompt_kv, context))
                layer.prompt_kv = None
        return cls(drafter or builder, stores, tokens)

    def extends(self, row_tokens: Sequence[int]) -> bool:
        """Whether a row's tokens start with this state's tokens and go further (a round needs one new token)."""
        count = len(self.tokens)
        return len(row_tokens) > count and list(row_tokens[:count]) == self.tokens

    def draft(self, row_tokens: Sequence[int], length: int) -> list[int]:
        """Feed the row's tokens this state has not seen, commit them, then draft `length` tokens greedily."""
        return draft_rows([self], [row_tokens], [length])[0]

    def accepted(self, row_tokens: Sequence[int]) -> int:
        """How many of the last round's drafts the row kept (the row extends this state)."""
        count = 0
        for drafted, kept in zip(self.pending, row_tokens[len(self.tokens) :], strict=False):
            if drafted != kept:
                break
            count += 1
        return count


def draft_rows(
    states: list[DraftState], rows: Sequence[Sequence[int]], lengths: Sequence[int]
) -> list[list[int]]:
    """One round for several rows at once: each state is fed its row's new tokens and drafts its `lengths[i]`
    tokens greedily, all rows in one pass per drafted token (a draft step reads the weights once for the batch,
    which is what a step of a small batch costs). Rows draft up to the longest length; each keeps its own.

    The states change only once every pass has run: a round that raises leaves them as they were."""
    drafter = states[0].model
    if any(state.model is not drafter for state in states):
        raise ValueError("draft_rows drafts with one model: the states were built for different drafters.")
    for state, tokens in zip(states, rows, strict=True):
        if not state.extends(tokens):
            raise ValueError("the row's tokens do not extend this draft state's tokens; build a new state.")
    feeds = [list(tokens[len(state.tokens) :]) for state, tokens in zip(states, rows, strict=True)]
    device = next(drafter.parameters()).device
    batch, most, steps = len(states), max(map(len, feeds)), max(lengths)
    committed = [state.stores[0] for state in states]
    width = max(store.num_committed for store in committed)
    # one mask for every layer: each tier's slots are valid alike across its layers (as VeriCache's own)
    valid = torch.ones((batch, width + most + steps), dtype=torch.bool, device=device)
    ids = torch.zeros((batch, most), dtype=torch.long, device=device)
    positions = torch.zeros((batch, most), dtype=torch.long, device=device)
    for row, (state, feed, store) in enumerate(zip(states, feeds, committed, strict=True)):
        valid[row, : width - store.num_committed] = False
        valid[row, width - store.num_committed : width] = store.valid[0]
        valid[row, width : width + most - len(feed)] = False
        ids[row, most - len(feed) :] = torch.tensor(feed, device=device)
        start = len(state.tokens)
        positions[row] = torch.arange(start + len(feed) - most, start + len(feed), device=device).clamp(
            min=start
        )
    layers = [
        RoundLayer([state.stores[index] for state in states], width, width + most + steps)
        for index in range(len(states[0].stores))
    ]
    cache = Cache(layers=layers)
    drafted = []
    with torch.inference_mode():
        for _ in range(steps):
            slots = layers[0].length + ids.shape[1]
            logits = drafter(
                input_ids=ids,
                position_ids=positions,
                attention_mask=valid[:, :slots],
                **cache_kwargs(drafter, cache),
                logits_to_keep=1,
            ).logits
            ids = logits[:, -1].argmax(-1)[:, None]
            drafted.append(ids[:, 0])
            positions = positions[:, -1:] + 1
        fed_valid = [torch.ones((1, len(feed)), dtype=torch.bool, device=device) for feed in feeds]
        for layer in layers:
            keys, values = layer.fed
            for row, (store, feed) in enumerate(zip(layer.stores, feeds, strict=True)):
                fed = slice(most - len(feed), most)
                store.commit(keys[row : row + 1, :, fed], values[row : row + 1, :, fed], fed_valid[row])
    tokens = torch.stack(drafted, dim=1).tolist()
    for state, feed, row, length in zip(states, feeds, tokens, lengths, strict=True):
        state.tokens.extend(feed)
        state.pending = row[:length]
    return [state.pending for state in states]


def _num_layers(model: nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config.num_hidden_layers
