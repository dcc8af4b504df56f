"""Device staging buffers for verification: the full tier is brought in one layer at a time.

A fixed number of buffer slots (default 2) exists; a layer's transfer must hold a slot, and gives it back once the
verify pass has read that layer. Device memory for the full tier is therefore bounded by a few layers, however many
layers the model has. (Each buffer holds one whole layer, since attention reads a layer's K/V at once: its size
follows the context length, its count does not.)
"""

from __future__ import annotations

from collections import deque

import torch

#: Buffers are sized in whole granules of tokens, plus some slack when they grow, so that a context growing by a
#: few tokens each round reallocates rarely.
GRANULE_TOKENS = 256


def buffer_tokens(tokens: int) -> int:
    """Token capacity of a buffer that must hold `tokens`: rounded up to whole granules."""
    return -(-max(tokens, 1) // GRANULE_TOKENS) * GRANULE_TOKENS


class StagingBuffers:
    """`num_buffers` slots, each holding at most one (keys, values) buffer pair per device."""

    def __init__(self, num_buffers: int = 2) -> None:
        if isinstance(num_buffers, bool) or not isinstance(num_buffers, int) or num_buffers < 1:
            raise ValueError(
                f"staging buffers must be a positive integer (2 lets one layer copy while another computes), "
                f"got {num_buffers!r}."
            )
        self.num_buffers = num_buffers
        self.free: deque[int] = deque(range(num_buffers))
        self.pairs: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.peak_bytes = 0

    def try_acquire(self) -> int | None:
        """A free slot, or None when every slot is held (the caller must wait for a release)."""
        return self.free.popleft() if self.free else None

    def release(self, slot: int) -> None:
        if slot in self.free or not 0 <= slot < self.num_buffers:
            raise RuntimeError(f"staging slot {slot} released twice or never acquired.")
        self.free.append(slot)

    @property
    def held(self) -> int:
        return self.num_buffers - len(self.free)

    def buffers(
        self,
        slot: int,
        device: torch.device,
        dtype: torch.dtype,
        shape: tuple[int, int, int, int],
        tokens: int,
        keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's (B, H, capacity, D) key/value buffers on `device`, holding at least `tokens` tokens.

        `shape` is (batch, heads, key_dim, value_dim). A buffer that is too small or of another shape is replaced;
        its first `keep` tokens are carried over (a device-to-device copy).
        """
        batch, heads, key_dim, value_dim = shape
        current = self.pairs.get((slot, device))
        if current is not None:
            keys, values = current
            fits = keys.shape[-2] >= tokens and keys.dtype == dtype
            if fits and (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3]) == tuple(shape):
                return current
        grown = tokens + tokens // 8 if current is not None else tokens
        capacity = buffer_tokens(grown)
        keys = torch.empty((batch, heads, capacity, key_dim), dtype=dtype, device=device)
        values = torch.empty((batch, heads, capacity, value_dim), dtype=dtype, device=device)
        if current is not None and keep:
            keys[:, :, :keep] = current[0][:, :, :keep]
            values[:, :, :keep] = current[1][:, :, :keep]
        self.pairs[(slot, device)] = (keys, values)
        self.peak_bytes = max(self.peak_bytes, self.device_bytes())
        return keys, values

    def device_bytes(self) -> int:
        """Bytes of every staging buffer now allocated (all devices)."""
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.pairs.values()
        )
