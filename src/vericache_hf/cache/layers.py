"""The layers of a `VeriCache`: what one decoder layer's forward writes to and reads from in each phase.

A `VeriCacheLayer` pairs the layer's two tiers, the draft tier (compressed, on the device) and the full tier
(exact, on the host), and answers each cache update with the tier the phase reads. A `PairedLayer` adds a
recurrent state beside them. The cache that owns a layer decides the phase and brings the full tier to the
device; a layer only asks it (`owner`), so nothing here holds phase or transfer state.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

try:
    from transformers.cache_utils import DummyLayer
except (
    ImportError
):  # transformers before 5.20 has no layer type with nothing to cache, nor a model that needs one
    DummyLayer = CacheLayerMixin

from .compressor import CompressionContext
from .draft_tier import DraftStore
from .full_tier import HostKVStore
from .recurrent import RecurrentLayer

if TYPE_CHECKING:
    from .vericache import VeriCache


class PhasedLayer(CacheLayerMixin):
    """A layer whose update is the owning cache's phase's: `_prefill`, `_draft` or `_verify`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, owner: VeriCache) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        # the K/V live in the tiers; empty keys answer a model that asks every layer whether it holds any (Mllama)
        self.keys = self.values = key_states.new_empty(0)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        phase = self.owner.phase
        if phase == "drafting":
            return self._draft(key_states, value_states)
        if phase == "verifying":
            return self._verify(key_states, value_states)
        if phase == "prefilling":
            return self._prefill(key_states, value_states)
        raise RuntimeError(
            f"a forward wrote to VeriCache layer {self.layer_idx} outside a phase; run it inside the cache's "
            "prefilling(), drafting() or verifying() block."
        )

    def _prefill(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _draft(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _verify(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class VeriCacheLayer(PhasedLayer):
    """One decoder layer's two tiers."""

    def __init__(self, layer_idx: int, owner: VeriCache) -> None:
        super().__init__(layer_idx, owner)
        self.full = HostKVStore(owner.chunk_tokens)
        self.draft: DraftStore | None = None
        self.pending_in_place = False
        self.prompt_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # until the layer's queries arrive

    @property
    def reads_in_place(self) -> bool:
        """A layer on the CPU attends to its host full tier itself, unless `stage_on_cpu` asks for the copies."""
        return self.device.type == "cpu" and not self.owner.stage_on_cpu

    def _prefill(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self.owner
        # a shared prefix's exact K/V, already in the full tier (`PrefixLoad.seed`)
        seeded = owner.prefix_load.seeded_tokens
        if self.full.length != seeded:
            raise RuntimeError("VeriCache supports a single prefill; create a new cache for a new prompt.")
        if seeded and not self.reads_in_place:  # attention and the compressor read the prefix on the device
            past = owner.stream.layer_full_tier(self.layer_idx)
        owner.stats.bytes_to_host += self.full.append(keys, values)
        if seeded:
            keys, values = (
                self.full.view()
                if self.reads_in_place
                else (torch.cat([past[0], keys], dim=2), torch.cat([past[1], values], dim=2))
            )
        if owner.compressor.scores_with_queries:
            # the layer's queries reach attention after this update: `prompt_queries` compresses then
            self.prompt_kv = keys, values
        elif not owner.draft_tier.defers_compression(self):
            self.build_from_prompt(CompressionContext(self.layer_idx, owner.prompt_valid))
        return keys, values

    def build_from_prompt(self, context: CompressionContext) -> None:
        """Build the draft tier from the prompt's K/V, which are on the layer's device now."""
        keys, values = self.prompt_kv if self.prompt_kv is not None else self.full.view()
        self.prompt_kv = None
        started = time.perf_counter()
        self.draft = self.owner.compressor.compress(keys, values, context)
        self.owner.stats.compress_seconds += time.perf_counter() - started

    def _draft(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft tier then the drafted tokens. A drafting model of another float type (`draft_dtype`) gets
        them in its own: a store that can converts itself once, any other is cast each pass."""
        if not self.draft.to_dtype(keys.dtype):
            keys_read, values_read = self.draft.extend_draft(keys, values)
            return keys_read.to(keys.dtype), values_read.to(values.dtype)
        return self.draft.extend_draft(keys, values)

    def _verify(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The full tier then the q new tokens, as one tensor each; the new tokens are kept as pending."""
        owner = self.owner
        if owner.prefix_load.loading:
            owner.prefix_load.await_layer(self.layer_idx)
        self.pending = (keys, values)
        self.pending_in_place = self.reads_in_place
        start = owner.verify_start  # a sliding model's pass reads the tail its windows reach
        if self.pending_in_place:
            full_keys, full_values = self.full.extend_view(keys, values)
            return full_keys[:, :, start:], full_values[:, :, start:]
        if owner.stream.streams(self.layer_idx):  # attention reads the full tier chunk by chunk, then these
            if owner.running_pass is not None:  # the pass is told, so that its attention reads them
                owner.running_pass.streamed.add(self.layer_idx)
            return keys, values
        staged_keys, staged_values = owner.stream.staged(self.layer_idx)
        stored, end = self.full.length, self.full.length + keys.shape[-2]
        if staged_keys.shape[2] < end:  # more tokens than the room announced when drafting started
            staged_keys = torch.cat([staged_keys[:, :, start:stored], keys], dim=2)
            staged_values = torch.cat([staged_values[:, :, start:stored], values], dim=2)
            return staged_keys, staged_values
        staged_keys[:, :, stored:end] = keys
        staged_values[:, :, stored:end] = values
        return staged_keys[:, :, start:end], staged_values[:, :, start:end]

    def commit(self, count: int, valid: torch.Tensor) -> None:
        """Keep the first `count` verified tokens in both tiers; forget the rest."""
        keys, values = self.pending
        keys, values = keys[:, :, :count], values[:, :, :count]
        if self.pending_in_place:
            self.owner.stats.bytes_to_host += self.full.commit_in_place(count)
        else:
            self.owner.stats.bytes_to_host += self.full.append(keys, values)
        if self.draft is not None:  # a deferred or freed draft tier is built from the full tier, not kept up
            self.draft.commit(keys, values, valid.to(keys.device))
        self.pending = None

    def get_seq_length(self) -> int:
        if self.owner.phase == "drafting":
            return self.draft.num_committed + self.draft.num_drafted
        if self.owner.prefix_load.loading:  # the mask is built before this layer's prefix has arrived
            return self.owner.full_valid.shape[-1]
        return self.full.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        start = self.owner.verify_start if self.owner.phase == "verifying" else 0
        return self.get_seq_length() + query_length - start, start

    def get_max_length(self) -> int:
        return -1


class EmptyLayer(DummyLayer):
    """A layer with nothing to cache: a feed-forward block alone, or cross-attention to images a text-only call
    does not give. Its keys are empty rather than None, so a model that asks whether the layer holds any (Mllama's
    cross-attention layers skip themselves while theirs hold none) reads no."""

    def __init__(self) -> None:
        super().__init__()
        self.keys = self.values = torch.empty(0)


class PairedLayer(RecurrentLayer, VeriCacheLayer):
    """A layer that holds attention K/V and a recurrent state side by side (Zamba, Falcon-H1; transformers' hybrid
    cache layer): the two tiers for its attention, one rolled-back state for the rest."""

    is_compileable = False

    def __init__(self, layer_idx: int, owner: VeriCache, number_of_states: int = 1) -> None:
        VeriCacheLayer.__init__(self, layer_idx, owner)
        RecurrentLayer.__init__(self, layer_idx, number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:  # attention's K/V
            VeriCacheLayer.lazy_initialization(self, *args)
        else:  # a conv or recurrent state
            RecurrentLayer.lazy_initialization(self, *args, **kwargs)

    def get_seq_length(self) -> int:
        return VeriCacheLayer.get_seq_length(self)

    def get_max_length(self) -> int:
        return VeriCacheLayer.get_max_length(self)


def draft_tier_bytes(layers: Iterable[VeriCacheLayer]) -> int:
    """Device bytes of the layers' draft tiers (a deferred or freed one holds none)."""
    return sum(layer.draft.nbytes() for layer in layers if layer.draft is not None)
