"""Device staging buffers for verification: the full tier is brought in one layer at a time.

At most `num_buffers` layer buffers exist per device, reused round-robin, so device memory for the full tier is
bounded by a few layers whatever the context length.
"""

from __future__ import annotations

import torch

from .full_tier import HostKVStore


class StagingBuffers:
    """Round-robin (B, H_kv, capacity, D) key/value buffers, one ring per device."""

    def __init__(self, num_buffers: int = 2) -> None:
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be at least 1, got {num_buffers}.")
        self.num_buffers = num_buffers
        self.rings: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}

    def buffer_for(
        self, slot: int, like: torch.Tensor, tokens: int, value_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A key/value buffer pair for `slot` on `like`'s device holding at least `tokens` tokens."""
        ring = self.rings.setdefault(like.device, [None] * self.num_buffers)
        index = slot % self.num_buffers
        current = ring[index]
        batch, heads, _, dim = like.shape
        if current is None or current[0].shape[-2] < tokens or current[0].shape[:2] != (batch, heads):
            capacity = max(tokens, int((current[0].shape[-2] if current else 0) * 1.5), 256)
            keys = like.new_empty((batch, heads, capacity, dim))
            values = like.new_empty((batch, heads, capacity, value_dim))
            current = ring[index] = (keys, values)
        return current

    def stage(
        self, slot: int, store: HostKVStore, new_keys: torch.Tensor, new_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Stored tokens then the new ones, in one device buffer; returns views and the bytes moved in."""
        stored = store.length
        total = stored + new_keys.shape[-2]
        keys, values = self.buffer_for(slot, new_keys, total, new_values.shape[-1])
        moved = store.copy_into(keys, values)
        keys[:, :, stored:total] = new_keys
        values[:, :, stored:total] = new_values
        return keys[:, :, :total], values[:, :, :total], moved

    def device_bytes(self) -> int:
        return sum(
            pair[0].numel() * pair[0].element_size() + pair[1].numel() * pair[1].element_size()
            for ring in self.rings.values()
            for pair in ring
            if pair is not None
        )
