"""The full tier: every committed token's exact K/V for one layer, kept off the accelerator.

Storage is a list of fixed-size chunks in host memory (pinned when CUDA is present). Appends write in place into the
tail chunk, growing by whole chunks, so nothing already stored is ever copied again; rollback is a length change.
"""

from __future__ import annotations

import torch


def pinned_memory_available() -> bool:
    """Page-locked host memory only exists alongside a CUDA runtime; on a CPU-only torch `pin_memory` raises."""
    return torch.cuda.is_available()


class HostKVStore:
    """Append-only, chunked K/V store of one layer: keys/values laid out as (B, H_kv, T, D) across chunks."""

    def __init__(self, chunk_tokens: int = 1024, pin_memory: bool | None = None) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}.")
        self.chunk_tokens = chunk_tokens
        self.pin_memory = pinned_memory_available() if pin_memory is None else pin_memory
        self.key_chunks: list[torch.Tensor] = []
        self.value_chunks: list[torch.Tensor] = []
        self.length = 0

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
            self.value_chunks[chunk][:, :, offset : offset + take].copy_(values[:, :, source], non_blocking=True)
            written += take
        self.length += count
        return 2 * keys.element_size() * keys.numel()

    def truncate(self, length: int) -> None:
        """Roll back to `length` tokens: only the counter moves."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a store of {self.length} tokens to {length}.")
        self.length = length

    def copy_into(self, keys_out: torch.Tensor, values_out: torch.Tensor) -> int:
        """Copy the stored tokens into the first `length` slots of device buffers; returns the bytes moved."""
        copied = 0
        for chunk in range(len(self.key_chunks)):
            start = chunk * self.chunk_tokens
            take = min(self.chunk_tokens, self.length - start)
            if take <= 0:
                break
            keys_out[:, :, start : start + take].copy_(self.key_chunks[chunk][:, :, :take], non_blocking=True)
            values_out[:, :, start : start + take].copy_(self.value_chunks[chunk][:, :, :take], non_blocking=True)
            copied += take
        if not copied:
            return 0
        reference = self.key_chunks[0]
        return 2 * copied * reference.shape[0] * reference.shape[1] * reference.shape[3] * reference.element_size()

    def nbytes(self) -> int:
        """Host bytes held by the stored tokens (not the unused tail of the last chunk)."""
        if not self.key_chunks:
            return 0
        reference = self.key_chunks[0]
        per_token = reference.shape[0] * reference.shape[1] * reference.shape[3] * reference.element_size()
        return 2 * self.length * per_token
