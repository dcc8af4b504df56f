"""The full tier: every committed token's exact K/V for one layer, kept off the accelerator.

Storage is one (B, H_kv, capacity, D) buffer per keys and values in host memory (pinned when CUDA is present, so
host->device copies can run asynchronously), grown by whole chunks of `chunk_tokens`, geometrically. Appends write in
place past `length`; rollback is a length change. A verify pass on the CPU reads the buffer itself: its new tokens
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

    def nbytes(self) -> int:
        return tensor_bytes(self.keys[:, :, : self.length], self.values[:, :, : self.length])

    def copy_into(self, keys_out: torch.Tensor, values_out: torch.Tensor) -> int:
        """Copy the stored tokens into the first slots of (B, H, >=length, D) buffers; returns the bytes moved.

        One copy per (row, head): each is a contiguous block on both sides, so on CUDA with pinned memory every copy
        is an asynchronous DMA on the caller's current stream (a strided slice would go through a pageable
        temporary and block)."""
        for source, target in ((self.keys, keys_out), (self.values, values_out)):
            rows_in = source.flatten(0, 1)  # (B*H, capacity, D)
            rows_out = target.flatten(0, 1)
            for row in range(rows_in.shape[0]):
                rows_out[row, : self.length].copy_(rows_in[row, : self.length], non_blocking=True)
        return self.nbytes()


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
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
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
        old = (self.keys, self.values)
        self.keys, self.values = (
            torch.empty(
                (*like.shape[:2], capacity, like.shape[3]),
                dtype=like.dtype,
                device="cpu",
                pin_memory=self.pin_memory,
            )
            for like in (keys, values)
        )
        if old[0] is not None and self.length:
            if self.pin_memory:  # appends from any device may still be in flight into the old buffers
                for device in range(torch.cuda.device_count()):
                    torch.cuda.synchronize(device)
            self.keys[:, :, : self.length] = old[0][:, :, : self.length]
            self.values[:, :, : self.length] = old[1][:, :, : self.length]

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
