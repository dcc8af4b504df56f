"""`VeriCache`: a transformers `Cache` whose layers pair a draft tier (compressed, on device) with a full tier (exact,
on the host). The loop sets the `mode` before each forward pass, and attention writes to the tier that pass uses:

- `prefill`: the prompt's exact K/V go to the full tier, and the compressor builds the draft tier from them;
- `draft`:   drafted tokens go after the draft tier's committed slots;
- `verify`:  the new tokens' exact K/V are kept as `pending` until `commit` decides how many were accepted, and
             attention (`cache/attention.py`) reads the full tier chunk by chunk from `chunks_for_verify`.

Streaming the full tier: `prefetch_for_verify` (called when drafting starts) queues every layer's chunks, in the
order the verify pass reads them, on the `TransferEngine`; the engine copies them into a bounded set of chunk-sized
staging buffers, so the first chunks are on the device before the verify pass begins and chunk c+1 copies while
chunk c computes. Once a chunk has been attended to, its buffer is released for the next transfer. This is valid
because the full tier only changes at `commit`, which comes after the verify pass: a transfer queued after one
commit and read before the next sees exactly the committed tokens (each transfer carries the length it copied,
which is checked).

Every length this cache reports is *physical* (slots held), which is what transformers' mask code works in. Rows may
hold masked slots (left padding, or tokens another row accepted that this row did not), so the loop always passes
explicit `position_ids`, and a 2-D `attention_mask` built by `attention_mask()` when drafting.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..compressors.base import CompressionContext, Compressor
from ..stats import VeriCacheStats
from .draft_tier import DraftStore
from .full_tier import HostKVStore
from .refresh import RefreshPolicy, check_refreshable
from .transfer import ChunkTransfer, TransferEngine

MODES = ("prefill", "draft", "verify")


class VeriCacheLayer(CacheLayerMixin):
    """One decoder layer's two tiers."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, owner: VeriCache) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner
        self.full = HostKVStore(owner.chunk_tokens)
        self.draft: DraftStore | None = None
        self.context: CompressionContext | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        mode = self.owner.mode
        if mode == "draft":
            return self.draft.extend_draft(key_states, value_states)
        if mode == "verify":  # attention reads the stored tokens from `chunks_for_verify`
            self.pending = (key_states, value_states)
            return key_states, value_states
        return self._prefill(key_states, value_states)

    def _prefill(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.full.length:
            raise RuntimeError("VeriCache supports a single prefill; create a new cache for a new prompt.")
        self.owner.stats.bytes_to_host += self.full.append(keys, values)
        context = self.context or CompressionContext(layer_idx=self.layer_idx, valid=self.owner.prompt_valid)
        self.context = None  # release the captured hidden states
        started = time.perf_counter()
        self.draft = self.owner.compressor.compress(keys, values, context)
        self.owner.stats.compress_seconds += time.perf_counter() - started
        return keys, values

    def commit(self, count: int, valid: torch.Tensor) -> None:
        """Keep the first `count` verified tokens in both tiers; forget the drafts."""
        keys, values = self.pending
        keys, values = keys[:, :, :count], values[:, :, :count]
        self.owner.stats.bytes_to_host += self.full.append(keys, values)
        self.draft.commit(keys, values, valid.to(keys.device))
        self.pending = None

    def get_seq_length(self) -> int:
        mode = self.owner.mode
        if mode == "draft":
            return self.draft.num_committed + self.draft.num_drafted
        if mode == "verify":
            return self.full.length
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class VeriCache(Cache):
    """Two-tier cache for draft-then-verify decoding. Build one per `generate` call.

    `chunk_tokens` sizes the host chunks of the full tier, which are also the unit of transfer; `staging_buffers`
    is how many chunks of the full tier may be on the device at once; `transfer_timeout` bounds every wait on a
    transfer; `stage_on_cpu` copies the full tier through the staging buffers even when a layer's device is the
    CPU, where by default it is read in place. Pass a shared `transfers` engine to serve several caches through one
    queue (its own buffer count, timeout and `stage_on_cpu` then apply).
    """

    def __init__(
        self,
        num_layers: int,
        compressor: Compressor,
        stats: VeriCacheStats | None = None,
        chunk_tokens: int = 2048,
        staging_buffers: int = 2,
        transfer_timeout: float = 60.0,
        transfers: TransferEngine | None = None,
        refresh_policy: RefreshPolicy | None = None,
        stage_on_cpu: bool = False,
    ) -> None:
        if refresh_policy is not None:
            check_refreshable(compressor)
        self.refresh_policy = refresh_policy
        self.compressor = compressor
        self.chunk_tokens = chunk_tokens
        self.stats = stats if stats is not None else VeriCacheStats()
        if transfers is None:
            transfers = TransferEngine(staging_buffers, transfer_timeout, stage_on_cpu)
        self.transfers = transfers
        self.verify_round: list[list[ChunkTransfer]] | None = None
        self.round_read = False
        self.mode = "prefill"
        self.prompt_valid: torch.Tensor | None = None
        self.full_valid: torch.Tensor | None = None
        super().__init__(layers=[VeriCacheLayer(i, self) for i in range(num_layers)])

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        if mode == "verify":
            for layer in self.layers:
                layer.draft.rollback_draft()
        self.mode = mode

    def start(self, prompt_valid: torch.Tensor) -> None:
        """Record which prompt slots are real tokens (False on left padding) before the prefill pass."""
        self.prompt_valid = prompt_valid.bool()
        self.full_valid = self.prompt_valid.clone()
        self.mode = "prefill"

    def attention_mask(self, query_length: int) -> torch.Tensor:
        """(B, slots + query_length) mask over the physical slots of the tier the next pass reads."""
        committed = self.layers[0].draft.valid if self.mode == "draft" else self.full_valid
        drafted = self.layers[0].draft.num_drafted if self.mode == "draft" else 0
        batch = committed.shape[0]
        fresh = committed.new_ones((batch, drafted + query_length))
        return torch.cat([committed.to(fresh.device), fresh], dim=-1).long()

    def commit(self, count: int, valid: torch.Tensor) -> None:
        """Commit the first `count` tokens of the last verify pass; `valid` (B, count) masks the ones a row rejected."""
        self.end_verify_round()
        for layer in self.layers:
            layer.commit(count, valid)
        self.full_valid = torch.cat([self.full_valid, valid.to(self.full_valid.device)], dim=-1)
        self.mode = "draft"

    def draft_tier_bytes(self) -> int:
        return sum(layer.draft.nbytes() for layer in self.layers if layer.draft is not None)

    def full_tier_bytes(self) -> int:
        return sum(layer.full.nbytes() for layer in self.layers)

    # -- streaming the full tier for verification ---------------------------------------------------------------
    def prefetch_for_verify(self) -> None:
        """Queue every layer's full-tier chunks for the next verify pass. Call it when drafting starts: the first
        chunks then copy while the draft runs."""
        if self.mode == "prefill" or not self.layers[0].full.length:
            return
        if self.verify_round is not None and not self.round_read and not self._stale():
            return
        self.end_verify_round()
        self.verify_round = [
            self.transfers.submit(layer.full, layer.device, group=self, label=layer.layer_idx)
            for layer in self.layers
        ]
        self.round_read = False
        self.stats.peak_draft_tier_bytes = max(self.stats.peak_draft_tier_bytes, self.draft_tier_bytes())

    def chunks_for_verify(self, layer_idx: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Layer `layer_idx`'s stored tokens as (keys, values, valid) chunks on its device, each (B, H, n, D) with a
        (B, n) validity mask; a chunk's buffer is released once the consumer asks for the next one."""
        if layer_idx == 0:
            if self.verify_round is None or self.round_read or self._stale():
                self.prefetch_for_verify()
            self.round_read = True
        elif self.verify_round is None:
            raise RuntimeError("a verify pass must run its layers in order from layer 0.")
        chunks = self.verify_round[layer_idx]
        copied = chunks[0].snapshot.length  # a layer's chunks share one snapshot
        stored = self.layers[layer_idx].full.length
        if copied != stored:
            raise RuntimeError(
                f"layer {layer_idx}'s full tier changed while its transfer was in flight ({copied} -> {stored} "
                "tokens); commit only after the verify pass."
            )
        for transfer in chunks:
            keys, values = self.transfers.wait(transfer)
            valid = self.full_valid[:, transfer.start : transfer.start + transfer.tokens]
            yield keys, values, valid.to(keys.device, non_blocking=True)
            self.transfers.release(transfer)  # its attention has run
        if layer_idx == len(self.layers) - 1:
            self._record_round()

    def layer_full_tier(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s whole full tier on its device, streamed through the engine (for a refresh, which
        compresses a layer at once: device memory for it is one layer, briefly)."""
        layer = self.layers[layer_idx]
        snapshot = layer.full.snapshot()
        batch, heads, key_dim, value_dim = snapshot.shape
        keys = torch.empty(
            (batch, heads, snapshot.length, key_dim), dtype=snapshot.dtype, device=layer.device
        )
        values = torch.empty(
            (batch, heads, snapshot.length, value_dim), dtype=snapshot.dtype, device=layer.device
        )
        for transfer in self.transfers.submit(layer.full, layer.device, group=self, label=layer_idx):
            chunk_keys, chunk_values = self.transfers.wait(transfer)
            keys[:, :, transfer.start : transfer.start + transfer.tokens] = chunk_keys
            values[:, :, transfer.start : transfer.start + transfer.tokens] = chunk_values
            self.transfers.release(transfer)
            self.stats.bytes_to_device += transfer.bytes
        return keys, values

    def end_verify_round(self) -> None:
        """Release (or cancel) the transfers of the current round."""
        for layer_round in self.verify_round or ():
            for transfer in layer_round:
                self.transfers.release(transfer)
        self.verify_round = None

    def close(self) -> None:
        """Drop pending transfers and stop the worker (a private engine); the cache stays readable."""
        self.end_verify_round()
        self.transfers.cancel(self)

    def _stale(self) -> bool:
        pairs = zip(self.verify_round, self.layers, strict=True)
        return any(chunks[0].snapshot.length != layer.full.length for chunks, layer in pairs)

    def _record_round(self) -> None:
        stats = self.stats
        for transfer in (transfer for chunks in self.verify_round for transfer in chunks):
            self.transfers.settle(transfer)
            stats.chunk_transfers += 1
            stats.bytes_to_device += transfer.bytes
            stats.transfer_seconds += transfer.seconds
            stats.transfer_wait_seconds += transfer.waited
        stats.peak_staging_bytes = max(stats.peak_staging_bytes, self.transfers.buffers.peak_bytes)

    def staging_bytes(self) -> int:
        """Device bytes of the full tier now: its staging buffers."""
        return self.transfers.buffers.device_bytes()
