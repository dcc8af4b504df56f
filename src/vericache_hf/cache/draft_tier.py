"""The draft tier: one layer's compressed K/V on the model's device, plus room for this round's drafted tokens.

A `DraftStore` keeps the *committed* tokens in whatever form its compressor chose (a subset of tokens, a quantized
copy, ...) and a per-slot validity mask. Drafted tokens are uncommitted: they are written after the committed slots
and forgotten by `rollback_draft`, so a rejected draft costs no copy. Committed tokens arrive through `commit`, with
their exact K/V from the verify pass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class DraftStore(ABC):
    """Interface of one layer's draft tier. Keys/values are (B, H_kv, T, D); `valid` is (B, T) bool."""

    num_drafted: int = 0

    @property
    @abstractmethod
    def num_committed(self) -> int:
        """Physical slots holding committed tokens (some may be masked out)."""

    @property
    @abstractmethod
    def valid(self) -> torch.Tensor:
        """(B, num_committed) bool: which committed slots hold real tokens."""

    @abstractmethod
    def extend_draft(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append drafted (uncommitted) tokens; return the K/V attention reads: committed then drafted."""

    @abstractmethod
    def rollback_draft(self) -> None:
        """Forget every drafted token of this round."""

    @abstractmethod
    def commit(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """Take newly committed tokens (exact K/V, (B, H, m, D)) with their (B, m) validity."""

    @abstractmethod
    def nbytes(self) -> int:
        """Device bytes of the committed representation."""

    def to_dtype(self, dtype: torch.dtype) -> bool:
        """Hold the K/V in `dtype` from now on (a drafting model of another float type); False if this store
        cannot, and its reads must be cast instead."""
        return False

    def export(self) -> dict[str, torch.Tensor]:
        """The committed state as named tensors (copies), each with the batch as its first dimension, for a prefix
        store; the compressor's `restore` reads it back. Stores that cannot be exported say so."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot be exported to a prefix store; use a token-dropping or quantizing "
            "compressor (snapkv, streaming_llm, knorm, h2o, kivi...) with prefix_store."
        )


class TokenStore(DraftStore):
    """Full-precision tokens in a preallocated buffer that grows geometrically; drafts sit after the committed slots."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, headroom: int = 128
    ) -> None:
        batch, heads, length, dim = keys.shape
        capacity = length + headroom
        self.keys = keys.new_empty((batch, heads, capacity, dim))
        self.values = values.new_empty((batch, heads, capacity, values.shape[-1]))
        self.valid_slots = torch.zeros((batch, capacity), dtype=torch.bool, device=keys.device)
        self.keys[:, :, :length] = keys
        self.values[:, :, :length] = values
        self.valid_slots[:, :length] = valid.to(keys.device)
        self.length = length
        self.num_drafted = 0

    @property
    def num_committed(self) -> int:
        return self.length

    @property
    def valid(self) -> torch.Tensor:
        return self.valid_slots[:, : self.length]

    def to_dtype(self, dtype: torch.dtype) -> bool:
        if self.keys.dtype != dtype:
            self.keys, self.values = self.keys.to(dtype), self.values.to(dtype)
        return True

    def _reserve(self, needed: int) -> None:
        capacity = self.keys.shape[-2]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity)
        used = self.length + self.num_drafted
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], new_capacity, old.shape[-1]))
            new[:, :, :used] = old[:, :, :used]
            setattr(self, name, new)
        valid = self.valid_slots.new_zeros((self.valid_slots.shape[0], new_capacity))
        valid[:, :used] = self.valid_slots[:, :used]
        self.valid_slots = valid

    def extend_draft(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.length + self.num_drafted
        count = keys.shape[-2]
        self._reserve(start + count)
        self.keys[:, :, start : start + count] = keys
        self.values[:, :, start : start + count] = values
        self.num_drafted += count
        end = start + count
        return self.keys[:, :, :end], self.values[:, :, :end]

    def rollback_draft(self) -> None:
        self.num_drafted = 0

    def commit(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        self.rollback_draft()
        count = keys.shape[-2]
        self._reserve(self.length + count)
        self.keys[:, :, self.length : self.length + count] = keys
        self.values[:, :, self.length : self.length + count] = values
        self.valid_slots[:, self.length : self.length + count] = valid
        self.length += count

    def export(self) -> dict[str, torch.Tensor]:
        return {
            "keys": self.keys[:, :, : self.length].clone(),
            "values": self.values[:, :, : self.length].clone(),
            "valid": self.valid.clone(),
        }

    def drop_slots(self, start: int, end: int) -> None:
        """Remove committed slots [start, end) by moving the tail left (all rows and heads alike)."""
        removed = end - start
        if removed <= 0:
            return
        tail = slice(end, self.length)
        moved = slice(start, self.length - removed)
        self.keys[:, :, moved] = self.keys[:, :, tail].clone()
        self.values[:, :, moved] = self.values[:, :, tail].clone()
        self.valid_slots[:, moved] = self.valid_slots[:, tail].clone()
        self.length -= removed

    def nbytes(self) -> int:
        return tensor_bytes(self.keys[:, :, : self.length], self.values[:, :, : self.length])
