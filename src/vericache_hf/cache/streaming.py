"""Bringing the full tier to the device for a verify pass, through a `TransferEngine`.

A round's transfers are queued when drafting starts (`prefetch`), layer by layer in the order the pass reads them,
so that the copies overlap the draft; the verify pass then reads each layer from its staging buffers (`staged`), or
a layer longer than a staging chunk as chunks its attention merges (`stream_chunks`). The full tier only changes at
`commit`, after the verify pass, so a round queued after one commit and read before the next sees exactly the
committed tokens; every read checks that it does. A layer that reads its full tier in place (on the CPU) is never
queued.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ..stats import VeriCacheStats
from .layers import VeriCacheLayer, draft_tier_bytes
from .staging import buffer_tokens
from .transfer import LayerTransfer, TransferEngine

if TYPE_CHECKING:
    from .prefix_load import PrefixLoad

#: Tokens a staging buffer leaves free after the full tier when no draft length was announced.
DEFAULT_ROOM = 64


class FullTierStream:
    """One cache's transfers of its full tier to the device: the round queued for the next verify pass, and the
    one-off copies a refresh or a seeded prefill reads.

    `layers` are the cache's attention layers; `staging_chunk_tokens` is the most a staging buffer holds (None:
    whole layers, however long); `transfers` is the engine that copies them, which the stream stops on `close`
    when it `owns_transfers`; `prefix_load` says when a stored prefix is still reaching the full tier, which no
    round may copy yet."""

    def __init__(
        self,
        layers: list[VeriCacheLayer],
        stats: VeriCacheStats,
        transfers: TransferEngine,
        owns_transfers: bool,
        staging_chunk_tokens: int | None,
        prefix_load: PrefixLoad,
    ) -> None:
        self.layers = layers
        self._by_index = {layer.layer_idx: layer for layer in layers}
        self.stats = stats
        self.transfers = transfers
        self._owns_transfers = owns_transfers  # its own engine's worker lives as long as the cache
        self.staging_chunk_tokens = staging_chunk_tokens
        self.prefix_load = prefix_load
        # the next verify pass's transfers, by layer: one for a whole layer, one per chunk for a streamed layer
        self._round: dict[int, list[LayerTransfer]] | None = None
        self._streamed: set[int] = set()  # layers of this round's pass that arrive in chunks
        self._staged: list[LayerTransfer] = []  # transfers the running verify pass has read

    def prefetch(self, room: int = DEFAULT_ROOM) -> None:
        """Queue every staged layer's full tier for the next verify pass, with `room` slots for its new tokens,
        unless the queued round still matches the full tier. Layers that read their full tier in place need no
        transfer."""
        if not self.layers[0].full.length or self.prefix_load.loading:
            return
        if self._round is not None and not self._stale():
            return
        self.end_round()
        self._round = {
            layer.layer_idx: self._submit_layer(layer, room)
            for layer in self.layers
            if not layer.reads_in_place
        }
        self._streamed = {index for index, transfers in self._round.items() if transfers[0].end is not None}
        self.stats.peak_draft_tier_bytes = max(
            self.stats.peak_draft_tier_bytes, draft_tier_bytes(self.layers)
        )

    def _submit_layer(self, layer: VeriCacheLayer, room: int) -> list[LayerTransfer]:
        """Queue a layer's full tier for the verify pass: whole, with `room` slots after it, when that fits in one
        staging chunk (or no chunk size is set); else as chunks of `staging_chunk_tokens`, each into a buffer of
        that fixed size, which attention merges as they arrive (`verify_attention.streamed_attention`)."""
        chunk, stored = self.staging_chunk_tokens, layer.full.length
        if chunk is None or stored + room <= chunk:
            # a buffer grows with a short layer (a quarter ahead) up to a chunk's size, and stays there
            capacity = None if chunk is None else min(chunk, buffer_tokens(stored + room))
            return [
                self.transfers.submit(
                    layer.full, layer.device, group=self, label=layer.layer_idx, room=room, capacity=capacity
                )
            ]
        return [
            self.transfers.submit(
                layer.full,
                layer.device,
                group=self,
                label=layer.layer_idx,
                span=(start, min(start + chunk, stored)),
                capacity=chunk,
            )
            for start in range(0, stored, chunk)
        ]

    def streams(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s full tier reaches this round's verify pass in chunks, which its attention
        reads (`stream_chunks`) instead of a whole staged layer."""
        return layer_idx in self._streamed

    def _layer_transfers(self, layer_idx: int) -> list[LayerTransfer]:
        transfers = self._round.get(layer_idx) if self._round is not None else None
        if not transfers:
            raise RuntimeError(f"layer {layer_idx}'s full tier was not queued for this verify pass.")
        stored = self._by_index[layer_idx].full.length
        if transfers[0].tokens != stored:
            raise RuntimeError(
                f"layer {layer_idx}'s full tier changed while its transfer was in flight ({transfers[0].tokens} -> "
                f"{stored} tokens); commit only after the verify pass."
            )
        return transfers

    def _read(self, transfer: LayerTransfer) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for a transfer of this pass; the one read before it has been attended to, so its buffers go back
        to the engine first (so that a single staging buffer can serve the next)."""
        if self._staged:
            self.transfers.release(self._staged[-1])
        self._staged.append(transfer)
        return self.transfers.wait(transfer)

    def staged(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s (B, H, capacity, D) staging buffers, holding its whole full tier, once its transfer
        is done."""
        transfers = self._layer_transfers(layer_idx)
        if layer_idx in self._streamed:
            raise RuntimeError(
                f"layer {layer_idx}'s full tier arrives in chunks: read it with stream_chunks()."
            )
        return self._read(transfers[0])

    def stream_chunks(self, layer_idx: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Layer `layer_idx`'s full tier as (B, H, n, D) chunks on its device, in order, each as its transfer is
        done; each chunk's buffers go back to the engine when the next is asked for."""
        for transfer in self._layer_transfers(layer_idx):
            keys, values = self._read(transfer)
            yield keys[:, :, : transfer.count], values[:, :, : transfer.count]

    def layer_full_tier(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s whole full tier on its device (for a refresh, or a prefill after a seeded prefix,
        which read a layer at once: device memory for it is one layer, briefly, outside the staging buffers,
        which it passes through in chunks)."""
        layer = self._by_index[layer_idx]
        if layer.reads_in_place:
            return layer.full.view()
        transfers = (
            self._submit_layer(layer, 0)
            if self.staging_chunk_tokens
            else [self.transfers.submit(layer.full, layer.device, group=self, label=layer_idx)]
        )
        pieces = []
        try:
            for transfer in transfers:
                keys, values = self.transfers.wait(transfer)
                pieces.append((keys[:, :, : transfer.count].clone(), values[:, :, : transfer.count].clone()))
                self.transfers.release(transfer)  # the next chunk may take its buffer
                self.stats.bytes_to_device += transfer.bytes
        finally:  # after an error, those not read yet (a release is a no-op on a released transfer)
            for transfer in transfers:
                self.transfers.release(transfer)
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat([p[0] for p in pieces], dim=2), torch.cat([p[1] for p in pieces], dim=2)

    def end_round(self) -> None:
        """Release (or cancel) the transfers of the current round."""
        for transfers in (self._round or {}).values():
            for transfer in transfers:
                self.transfers.release(transfer)
        self._round, self._staged, self._streamed = None, [], set()

    def record_round(self) -> None:
        """Count the round's transfers in the stats, once the verify pass has read them all."""
        stats = self.stats
        transfers = [t for layer in (self._round or {}).values() for t in layer]  # none while a prefix loads
        for transfer in transfers:
            self.transfers.settle(transfer)
            stats.chunk_transfers += 1
            stats.bytes_to_device += transfer.bytes
            stats.transfer_seconds += transfer.seconds
            stats.transfer_wait_seconds += transfer.waited
        stats.peak_staging_bytes = max(stats.peak_staging_bytes, self.transfers.buffers.peak_bytes)

    def close(self) -> None:
        """Drop pending transfers and stop a private engine's worker (a later transfer starts another)."""
        self.end_round()
        self.transfers.cancel(self)
        if self._owns_transfers:
            self.transfers.stop_worker()

    def _stale(self) -> bool:
        return any(
            transfers[0].tokens != self._by_index[i].full.length for i, transfers in self._round.items()
        )

    def staging_bytes(self) -> int:
        """Device bytes of the full tier: its staging buffers."""
        return self.transfers.buffers.device_bytes()
