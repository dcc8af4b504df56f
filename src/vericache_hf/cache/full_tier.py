"""The full tier: every committed token's exact K/V for one layer, kept off the accelerator.

Storage is one (B, H_kv, capacity, D) buffer per keys and values in host memory (pinned when CUDA is present, so
host->device copies can run asynchronously), grown by whole chunks of `chunk_tokens`, geometrically. Appends write in
place past `length`; rollback is a length change. Rows (a cohort's requests) join and leave in place too: the buffers
keep spare rows, also grown geometrically. A verify pass on the CPU reads the buffer itself: its new tokens
are written after `length` (`extend_view`), and a commit only moves the length (`commit_in_place`).

A transfer to the device reads a `HostSnapshot`: the buffers and the length at the moment it was requested. Appends
only write past that length, and growing moves later appends to new buffers, so neither races with a transfer in
flight. Truncation could let a later append overwrite slots a transfer is still reading, so it is refused while any
transfer of the store is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int
from .draft_tier import tensor_bytes


def pinned_memory_available() -> bool:
    """Page-locked host memory only exists alongside a CUDA runtime; on a CPU-only torch `pin_memory` raises."""
    return torch.cuda.is_available()


def round_up(tokens: int, granule: int) -> int:
    return -(-max(tokens, 1) // granule) * granule


@dataclass(frozen=True)
class HostSnapshot:
    """The first `length` tokens of a store, in its (B, H_kv, capacity, D) key/value buffers."""

    length: int
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, heads, key_dim, value_dim) of the stored tokens."""
        return self.keys.shape[0], self.keys.shape[1], self.keys.shape[3], self.values.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    def nbytes(self, start: int = 0, end: int | None = None) -> int:
        """Bytes of the stored tokens, or of those in [start, end)."""
        end = self.length if end is None else end
        return tensor_bytes(self.keys[:, :, start:end], self.values[:, :, start:end])

    def copy_into(
        self, keys_out: torch.Tensor, values_out: torch.Tensor, start: int = 0, end: int | None = None
    ) -> int:
        """Copy the stored tokens in [start, end) (all of them by default) into the first slots of (B, H, >=n, D)
        buffers; returns the bytes moved.

        One copy per (row, head): each is a contiguous block on both sides, so on CUDA with pinned memory every copy
        is an asynchronous DMA on the caller's current stream (a strided slice would go through a pageable
        temporary and block)."""
        end = self.length if end is None else end
        count = end - start
        for source, target in ((self.keys, keys_out), (self.values, values_out)):
            rows_in = source.flatten(0, 1)  # (B*H, capacity, D)
            rows_out = target.flatten(0, 1)
            for row in range(rows_in.shape[0]):
                rows_out[row, :count].copy_(rows_in[row, start:end], non_blocking=True)
        return self.nbytes(start, end)


class HostKVStore:
    """Append-only K/V store of one layer: keys/values laid out as (B, H_kv, T, D) in one growable buffer."""

    def __init__(self, chunk_tokens: int = 2048, pin_memory: bool | None = None) -> None:
        check_int("chunk_tokens", chunk_tokens)
        if pin_memory and not pinned_memory_available():
            raise ValueError(
                "pin_memory=True needs a CUDA runtime; pass pin_memory=None to choose automatically."
            )
        self.chunk_tokens = chunk_tokens
        self.pin_memory = pinned_memory_available() if pin_memory is None else pin_memory
        self.keys: torch.Tensor | None = None  # the rows in use of `_buffers`
        self.values: torch.Tensor | None = None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._row_capacity = 0
        self.length = 0
        self.uncommitted = 0  # tokens `extend_view` wrote after `length`
        self.transfers_in_flight = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reserve(self, needed: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make room for `needed` tokens shaped like (B, H, *, D) `keys`/`values`, doubling at least."""
        if needed <= self.capacity:
            return
        capacity = round_up(max(needed, 2 * self.capacity), self.chunk_tokens)
        rows = self.keys.shape[0] if self.keys is not None else keys.shape[0]
        self._grow(rows, max(rows, self._row_capacity), capacity, keys, values)

    def _grow(
        self, rows: int, row_capacity: int, capacity: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """New buffers of `row_capacity` rows and `capacity` slots (their first `rows` rows in use), holding what
        the old ones held. `keys`/`values` give the head count, head sizes and dtype."""
        old = (self.keys, self.values)
        self._buffers = tuple(
            torch.empty(
                (row_capacity, like.shape[1], capacity, like.shape[3]),
                dtype=like.dtype,
                device="cpu",
                pin_memory=self.pin_memory,
            )
            for like in (keys, values)
        )
        self._row_capacity = row_capacity
        self.keys, self.values = (buffer[:rows] for buffer in self._buffers)
        if old[0] is not None and self.length:
            if self.pin_memory:  # appends from any device may still be in flight into the old buffers
                for device in range(torch.cuda.device_count()):
                    torch.cuda.synchronize(device)
            kept = min(rows, old[0].shape[0])
            self.keys[:kept, :, : self.length] = old[0][:kept, :, : self.length]
            self.values[:kept, :, : self.length] = old[1][:kept, :, : self.length]

    # -- rows joining and leaving (a cohort's requests, between rounds) ------------------------------------------
    def add_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add (m, H, n, D) rows after the stored ones, without moving those: the store grows to the longer of
        the two lengths, each side padded with zeros (masked slots): the stored rows after their tokens, the new
        rows in front of theirs."""
        self._check_no_transfer("add rows to")
        rows, extra, length = self.keys.shape[0], keys.shape[0], max(self.length, keys.shape[2])
        if rows + extra > self._row_capacity or length > self.capacity:
            capacity = max(self.capacity, round_up(length, self.chunk_tokens))
            self._grow(rows, max(rows + extra, 2 * self._row_capacity), capacity, keys, values)
        self.keys, self.values = (buffer[: rows + extra] for buffer in self._buffers)
        pad = length - keys.shape[2]
        for stored, new in ((self.keys, keys), (self.values, values)):
            stored[:rows, :, self.length : length].zero_()
            stored[rows:, :, :pad].zero_()
            stored[rows:, :, pad:length].copy_(new)
        self.length = length

    def keep_rows(self, rows: list[int], drop_front: int = 0) -> None:
        """Keep only `rows` (ascending), moved up in place, and drop the first `drop_front` slots (masked in every
        kept row)."""
        self._check_no_transfer("drop rows of")
        if rows != sorted(set(rows)):
            raise ValueError(f"keep_rows takes ascending, distinct row indices; got {rows}.")
        for target, source in enumerate(rows):
            if target != source:
                self.keys[target, :, : self.length] = self.keys[source, :, : self.length]
                self.values[target, :, : self.length] = self.values[source, :, : self.length]
        self.keys, self.values = (buffer[: len(rows)] for buffer in self._buffers)
        if drop_front:
            kept = slice(drop_front, self.length)
            self.keys[:, :, : self.length - drop_front] = self.keys[:, :, kept].clone()
            self.values[:, :, : self.length - drop_front] = self.values[:, :, kept].clone()
            self.length -= drop_front

    def _check_no_transfer(self, what: str) -> None:
        if self.transfers_in_flight or self.uncommitted:
            raise RuntimeError(f"cannot {what} a full-tier store while a transfer or a verify pass reads it.")

    def _write(self, at: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        count = keys.shape[-2]
        self.reserve(at + count, keys, values)
        self.keys[:, :, at : at + count].copy_(keys, non_blocking=True)
        self.values[:, :, at : at + count].copy_(values, non_blocking=True)
        return tensor_bytes(keys, values)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Write (B, H, n, D) keys/values after the stored ones; returns the bytes moved to the host."""
        self.uncommitted = 0
        written = self._write(self.length, keys, values)
        self.length += keys.shape[-2]
        return written

    def extend_view(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write uncommitted (B, H, q, D) keys/values after the stored ones, without committing them; return
        views of the stored tokens followed by these (what a verify pass on the CPU attends to, copy-free)."""
        if self.transfers_in_flight:
            raise RuntimeError("a verify pass may not write into a full tier that is being transferred.")
        self._write(self.length, keys, values)
        self.uncommitted = keys.shape[-2]
        end = self.length + self.uncommitted
        return self.keys[:, :, :end], self.values[:, :, :end]

    def commit_in_place(self, count: int) -> int:
        """Keep the first `count` tokens written by `extend_view`; returns their bytes."""
        if not 0 <= count <= self.uncommitted:
            raise ValueError(f"cannot commit {count} tokens: the last verify pass wrote {self.uncommitted}.")
        start, self.length, self.uncommitted = self.length, self.length + count, 0
        return tensor_bytes(self.keys[:, :, start : self.length], self.values[:, :, start : self.length])

    def truncate(self, length: int) -> None:
        """Roll back to `length` tokens: only the counter moves."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a store of {self.length} tokens to {length}.")
        if self.transfers_in_flight:
            raise RuntimeError(
                f"cannot truncate a full-tier store while {self.transfers_in_flight} transfer(s) of it are in "
                "flight: a later append would overwrite slots they still read. Release the transfers first."
            )
        self.length = length

    def snapshot(self) -> HostSnapshot:
        """The stored tokens as they are now, for a transfer to read while later tokens are appended."""
        if not self.length:
            raise ValueError("the full-tier store is empty: run the prefill pass before verifying.")
        return HostSnapshot(self.length, self.keys, self.values)

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, length, D) views of the stored tokens, on the host."""
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def nbytes(self) -> int:
        """Host bytes held by the stored tokens (not the unused capacity)."""
        return self.snapshot().nbytes() if self.length else 0
