"""The full tier: every committed token's exact K/V for one layer, kept off the accelerator.

Storage is a list of fixed-size chunks in host memory (pinned when CUDA is present, so host->device copies can run
asynchronously). Appends write in place into the tail chunk, growing by whole chunks, so nothing already stored is
ever copied again; rollback is a length change.

A transfer to the device reads a `HostSnapshot`: the chunk list and length at the moment it was requested. Appends
only write past that length (and may add chunks the snapshot does not list), so they never race with a transfer in
flight. Truncation could let a later append overwrite slots a transfer is still reading, so it is refused while any
transfer of the store is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int


def pinned_memory_available() -> bool:
    """Page-locked host memory only exists alongside a CUDA runtime; on a CPU-only torch `pin_memory` raises."""
    return torch.cuda.is_available()


@dataclass(frozen=True)
class HostSnapshot:
    """The first `length` tokens of a store, as (B, H_kv, chunk_tokens, D) key/value chunks."""

    length: int
    chunk_tokens: int
    key_chunks: tuple[torch.Tensor, ...]
    value_chunks: tuple[torch.Tensor, ...]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, heads, key_dim, value_dim) of the stored tokens."""
        keys, values = self.key_chunks[0], self.value_chunks[0]
        return keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.key_chunks[0].dtype

    def nbytes(self) -> int:
        batch, heads, key_dim, value_dim = self.shape
        return self.length * batch * heads * (key_dim + value_dim) * self.key_chunks[0].element_size()

    @property
    def num_chunks(self) -> int:
        return len(self.key_chunks)

    def chunk_span(self, chunk: int) -> tuple[int, int]:
        """(first token, token count) of chunk `chunk`."""
        start = chunk * self.chunk_tokens
        return start, min(self.chunk_tokens, self.length - start)

    def copy_chunk_into(self, chunk: int, keys_out: torch.Tensor, values_out: torch.Tensor) -> int:
        """Copy chunk `chunk`'s tokens into the first slots of (B, H, >=chunk_tokens, D) buffers; returns the bytes
        moved. Copies are `non_blocking`: on CUDA with pinned chunks they run on the caller's current stream."""
        _, take = self.chunk_span(chunk)
        keys, values = self.key_chunks[chunk][:, :, :take], self.value_chunks[chunk][:, :, :take]
        keys_out[:, :, :take].copy_(keys, non_blocking=True)
        values_out[:, :, :take].copy_(values, non_blocking=True)
        return keys.numel() * keys.element_size() + values.numel() * values.element_size()


class HostKVStore:
    """Append-only, chunked K/V store of one layer: keys/values laid out as (B, H_kv, T, D) across chunks."""

    def __init__(self, chunk_tokens: int = 1024, pin_memory: bool | None = None) -> None:
        check_int("chunk_tokens", chunk_tokens)
        if pin_memory and not pinned_memory_available():
            raise ValueError(
                "pin_memory=True needs a CUDA runtime; pass pin_memory=None to choose automatically."
            )
        self.chunk_tokens = chunk_tokens
        self.pin_memory = pinned_memory_available() if pin_memory is None else pin_memory
        self.key_chunks: list[torch.Tensor] = []
        self.value_chunks: list[torch.Tensor] = []
        self.length = 0
        self.transfers_in_flight = 0

    @property
    def capacity(self) -> int:
        return len(self.key_chunks) * self.chunk_tokens

    def _new_chunk(self, like: torch.Tensor) -> torch.Tensor:
        batch, heads, _, dim = like.shape
        return torch.empty(
            (batch, heads, self.chunk_tokens, dim), dtype=like.dtype, device="cpu", pin_memory=self.pin_memory
        )

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Write (B, H, n, D) keys/values after the stored ones; returns the bytes moved to the host."""
        count = keys.shape[-2]
        while self.capacity < self.length + count:
            self.key_chunks.append(self._new_chunk(keys))
            self.value_chunks.append(self._new_chunk(values))
        written = 0
        while written < count:
            chunk, offset = divmod(self.length + written, self.chunk_tokens)
            take = min(count - written, self.chunk_tokens - offset)
            source = slice(written, written + take)
            self.key_chunks[chunk][:, :, offset : offset + take].copy_(keys[:, :, source], non_blocking=True)
            self.value_chunks[chunk][:, :, offset : offset + take].copy_(
                values[:, :, source], non_blocking=True
            )
            written += take
        self.length += count
        return keys.element_size() * keys.numel() + values.element_size() * values.numel()

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
        used = -(-self.length // self.chunk_tokens)
        return HostSnapshot(
            self.length, self.chunk_tokens, tuple(self.key_chunks[:used]), tuple(self.value_chunks[:used])
        )

    def nbytes(self) -> int:
        """Host bytes held by the stored tokens (not the unused tail of the last chunk)."""
        return self.snapshot().nbytes() if self.length else 0
