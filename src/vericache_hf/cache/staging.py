"""Device staging buffers for verification: the full tier visits the device a piece at a time.

A fixed number of buffer slots (default 2) exists; a transfer must hold a slot, and gives it back once the verify
pass has attended to what it holds. A buffer holds at most `staging_chunk_tokens`, and one of two things
(`FullTierStream.prefetch` chooses):
- a whole layer that fits: its stored tokens plus room for the tokens the verify pass checks, which attention reads
  as one (B, H, T, D) tensor, as stock attention expects (the buffer a quarter longer, up to a chunk's size);
- one chunk of a longer layer, which the verify pass's attention merges with the others as they arrive
  (`verify_attention.streamed_attention`).
Device memory for the full tier is therefore `num_buffers` chunks, whatever the context and the number of layers.
Without a chunk size (`staging_chunk_tokens=None`) a buffer holds a whole layer: `num_buffers` layers of a quarter
more than the context (`buffer_tokens`), which grows with it.
"""

from __future__ import annotations

from collections import deque

import torch

from ..checks import check_int
from .full_tier import round_up

#: Buffers grow in whole granules, and a quarter ahead, so they are replaced rarely as the context grows.
GRANULE_TOKENS = 256


def buffer_tokens(needed: int) -> int:
    """Token capacity of a new staging buffer that must hold `needed` tokens."""
    return round_up(needed + needed // 4, GRANULE_TOKENS)


class StagingBuffers:
    """`num_buffers` slots, each holding at most one (keys, values) buffer pair per device."""

    def __init__(self, num_buffers: int = 2) -> None:
        check_int("staging buffers", num_buffers, why=" (2 let one layer copy while another is read)")
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
        needed: int,
        capacity: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's (B, H, >=needed, D) key/value buffers on `device`; `shape` is (batch, heads, key_dim,
        value_dim). A slot's buffers are reused while they are large enough for the same shape, else replaced by
        buffers of `capacity` tokens (a chunk's, fixed), or of `buffer_tokens(needed)` (a whole layer's, which grow
        a quarter ahead of the context)."""
        batch, heads, key_dim, value_dim = shape
        current = self.pairs.get((slot, device))
        if current is not None:
            keys, values = current
            same = (keys.shape[:2], keys.shape[3], values.shape[3]) == ((batch, heads), key_dim, value_dim)
            if same and keys.dtype == dtype and keys.shape[2] >= needed:
                return current
            del self.pairs[(slot, device)], current, keys, values  # free the old pair before allocating
        tokens = buffer_tokens(needed) if capacity is None else max(capacity, needed)
        keys = torch.empty((batch, heads, tokens, key_dim), dtype=dtype, device=device)
        values = torch.empty((batch, heads, tokens, value_dim), dtype=dtype, device=device)
        self.pairs[(slot, device)] = (keys, values)
        self.peak_bytes = max(self.peak_bytes, self.device_bytes())
        return keys, values

    def device_bytes(self) -> int:
        """Bytes of every staging buffer now allocated (all devices)."""
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.pairs.values()
        )
