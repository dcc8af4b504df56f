"""A sliding-window or chunked layer's one exact tier, on the model's device: the tokens its next queries reach.

A sliding layer attends to at most its window, and a chunked layer (Llama 4) to the tokens of its query's chunk, so
what it needs is bounded however long the context grows; stock keeps just that for a sliding layer. VeriCache does
the same for a model whose other layers are full attention: the window's exact K/V stay on the device and serve the
draft passes and the verify passes alike. Drafting over them is exact, so compression, the offloaded full tier and
its transfers are spent only on the full-attention layers, whose KV grows with the context.

Slots: the layer holds the last `length` committed slots of the full tier's layout (left padding and the slots
rows rejected included, masked by the same validity), then a pass's drafted or verified tokens. A verify pass
reads the full tier's layout, where the window is its tail (`kv_offset` = the full tier's length minus ours). A
draft pass reads the draft tier's layout for the full-attention layers; the window's slots follow that layout in
the pass's 2-D mask (`VeriCache.attention_mask`), so each kind of layer sizes its part of one mask through
`get_mask_sizes` and `query_offset`, as transformers' own sliding layers do. The window's span is counted in
positions, not slots (`window_mask.py`), so the holes that ragged acceptance leaves are not counted against it.

A chunk needs absolute positions (a query at p sees the keys at q <= p with q // C == p // C), which the window's
own slots do not give once its first tokens are gone: the layer counts, per row, the real tokens it has dropped
(`dropped`), and a draft pass hands them to its chunked masks (`window_mask.WINDOW_DROPPED`). A verify pass reads
the full tier's layout, whose slots before the window count them already. Either way a chunked window's pass always
builds its mask: fewer slots than a chunk may still cross a chunk boundary.

After each commit the layer forgets the slots before every row's last `window` real tokens (a chunked layer: before
the chunk of the row's next position), in steps of at least `TRIM_STEP` slots, so that trimming copies rarely.
"""

from __future__ import annotations

import torch

from .draft_tier import TokenStore, tensor_bytes
from .layers import PhasedLayer

#: Slots a window layer may hold past its need before it trims them (one copy of its tail per this many tokens).
TRIM_STEP = 64


def held_slots(tokens: int, block: int) -> int:
    """The most slots a window layer's buffer holds when a row's window spans `tokens` and a pass adds `block`: the
    window, up to `TRIM_STEP` slots before a trim, and a buffer's headroom of two steps."""
    return tokens + 3 * TRIM_STEP + block


def first_needed(valid: torch.Tensor, window: int, dropped: torch.Tensor | None = None) -> int:
    """The first of (B, n) `valid`'s slots that some row's last `window` real tokens reach (n if none does); one
    device sync, since every window layer of a cache holds the same slots and the cache asks once per commit. With
    `dropped` (B,), the real tokens each row had before these slots, `window` is a chunk: a row needs only its
    tokens from the start of its next position's chunk, since no later query reaches further back."""
    later = valid.flip(-1).long().cumsum(-1).flip(-1)  # real tokens at or after each slot, per row
    if dropped is None:
        keep: int | torch.Tensor = window
    else:  # the row's tokens so far, past the last chunk boundary
        keep = ((dropped.to(valid.device) + valid.sum(-1)) % window)[:, None]
    needed = (valid & (later <= keep)).any(dim=0)
    first = torch.where(
        needed.any(), torch.argmax(needed.int()), needed.new_tensor(valid.shape[-1], dtype=torch.long)
    )
    return int(first.item())


class WindowLayer(PhasedLayer):
    """One sliding-window or chunked (`chunked`, chunks of `window` tokens) layer's exact K/V, on the device, read
    by draft and verify passes alike."""

    is_sliding = True

    def __init__(self, layer_idx: int, window: int, owner, chunked: bool = False) -> None:
        super().__init__(layer_idx, owner)
        self.window = window
        self.chunked = chunked
        self.store: TokenStore | None = None
        #: (B,) real tokens each row had before the held slots (its absolute position of the first held token)
        self.dropped: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Committed slots held: the tail of the full tier's layout."""
        return self.store.num_committed if self.store is not None else 0

    @property
    def valid(self) -> torch.Tensor:
        """(B, length) validity of the committed slots: the full tier's, over the same slots."""
        return self.store.valid

    def _prefill(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        valid = self.owner.prompt_valid.to(keys.device)
        self.store = TokenStore(keys, values, valid, headroom=0)
        self.dropped = valid.new_zeros(valid.shape[0], dtype=torch.long)
        self.trim(at_least=1)  # the prompt's K/V are the pass's; the layer keeps its window of them
        return keys, values

    def _verify(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.pending = (keys, values)
        return self._draft(keys, values)

    def _draft(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The window then the pass's tokens; a drafting model of another float type gets them in its own."""
        dtype = self.store.keys.dtype
        held_keys, held_values = self.store.extend_draft(keys.to(dtype), values.to(dtype))
        return held_keys.to(keys.dtype), held_values.to(values.dtype)

    def rollback(self) -> None:
        """Forget a pass's drafted or verified tokens."""
        if self.store is not None:
            self.store.rollback_draft()
        self.pending = None

    def commit(self, count: int, valid: torch.Tensor) -> None:
        """Keep the first `count` tokens of the verify pass (the cache trims its window layers after)."""
        keys, values = self.pending
        dtype = self.store.keys.dtype
        self.store.commit(
            keys[:, :, :count].to(dtype), values[:, :, :count].to(dtype), valid.to(self.store.keys.device)
        )
        self.pending = None

    def first_needed(self) -> int:
        """The first held slot that some row's next queries can reach (`first_needed`)."""
        return first_needed(self.valid, self.window, self.dropped if self.chunked else None)

    def trim(self, at_least: int = TRIM_STEP, first: int | None = None) -> None:
        """Keep the slots from `first` on (by default the first that some row's window reaches, `first_needed`) in a
        buffer of their own with room for a window, `TRIM_STEP` more and a round's tokens, once `at_least` slots can
        go: the buffer stays bounded by the window, however long the context. (A chunked layer keeps what its row
        wrote since the chunk began, which varies; the room for a whole chunk keeps its buffer's size fixed.)"""
        store = self.store
        valid = store.valid
        first = self.first_needed() if first is None else first
        if first < at_least:
            return
        self.dropped = self.dropped + valid[:, :first].sum(-1).to(self.dropped.device)
        end = store.num_committed
        self.store = TokenStore(
            store.keys[:, :, first:end],
            store.values[:, :, first:end],
            valid[:, first:],
            headroom=2 * TRIM_STEP + max(0, self.window - (end - first)),
        )

    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The committed keys, values and validity, (B, H, n, D) and (B, n), and each row's dropped tokens (B,)."""
        store, end = self.store, self.store.num_committed
        return store.keys[:, :, :end], store.values[:, :, :end], store.valid, self.dropped

    def rows(
        self, index: torch.Tensor, start: int = 0, end: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`view()` of the rows `index` and the committed slots `start:end`, each row's dropped tokens counting the
        real ones before `start` too (what `hold` takes)."""
        keys, values, valid, dropped = self.view()
        valid = valid[index]
        before = dropped[index.to(dropped.device)] + valid[:, :start].sum(-1).to(dropped.device)
        return keys[index][:, :, start:end], values[index][:, :, start:end], valid[:, start:end], before

    def hold(
        self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, dropped: torch.Tensor
    ) -> None:
        """Hold these committed slots, after each row's `dropped` (B,) real tokens (rows that joined, left or moved:
        `cache/rows.py`), then trim."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.store = TokenStore(keys, values, valid.to(keys.device), headroom=2 * TRIM_STEP)
        self.dropped = dropped.to(keys.device, torch.long)
        self.trim()

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Our slots and the pass's, where they sit in the pass's 2-D mask: the tail of the full tier's layout in a
        verify pass, after the draft tier's layout in a draft pass (`VeriCache.window_start`)."""
        drafted = self.store.num_drafted if self.store is not None else 0
        return self.length + drafted + query_length, self.owner.window_start(self.length)

    def query_offset(self) -> int:
        """Where the pass's first query sits in the pass's 2-D mask."""
        drafted = self.store.num_drafted if self.store is not None else 0
        return self.owner.window_start(self.length) + self.length + drafted

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        if self.store is None:
            return 0
        return tensor_bytes(self.store.keys, self.store.values)
