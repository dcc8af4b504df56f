"""`VeriCache`: a transformers `Cache` whose layers pair a draft tier (compressed, on device) with a full tier (exact,
on the host). The loop sets the `mode` before each forward pass, and attention writes to the tier that pass uses:

- `prefill`: the prompt's exact K/V go to the full tier, and the compressor builds the draft tier from them;
- `draft`:   drafted tokens go after the draft tier's committed slots;
- `verify`:  the full tier is staged on the device layer by layer, the new tokens after it; their exact K/V are kept
             as `pending` until `commit` decides how many were accepted.

Every length this cache reports is *physical* (slots held), which is what transformers' mask code works in. Rows may
hold masked slots (left padding, or tokens another row accepted that this row did not), so the loop always passes
explicit `position_ids` and a 2-D `attention_mask` built by `attention_mask()`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..compressors.base import CompressionContext, Compressor
from ..stats import VeriCacheStats
from .draft_tier import DraftStore
from .full_tier import HostKVStore
from .staging import StagingBuffers

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
        if mode == "verify":
            keys, values, moved = self.owner.staging.stage(self.layer_idx, self.full, key_states, value_states)
            self.owner.stats.bytes_to_device += moved
            self.pending = (key_states, value_states)
            return keys, values
        return self._prefill(key_states, value_states)

    def _prefill(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.full.length:
            raise RuntimeError("VeriCache supports a single prefill; create a new cache for a new prompt.")
        self.owner.stats.bytes_to_host += self.full.append(keys, values)
        context = self.context or CompressionContext(layer_idx=self.layer_idx, valid=self.owner.prompt_valid)
        self.context = None  # release the captured hidden states
        self.draft = self.owner.compressor.compress(keys, values, context)
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
    """Two-tier cache for draft-then-verify decoding. Build one per `generate` call."""

    def __init__(
        self,
        num_layers: int,
        compressor: Compressor,
        stats: VeriCacheStats | None = None,
        chunk_tokens: int = 1024,
        staging_buffers: int = 2,
    ) -> None:
        self.compressor = compressor
        self.chunk_tokens = chunk_tokens
        self.stats = stats if stats is not None else VeriCacheStats()
        self.staging = StagingBuffers(staging_buffers)
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
        for layer in self.layers:
            layer.commit(count, valid)
        self.full_valid = torch.cat([self.full_valid, valid.to(self.full_valid.device)], dim=-1)
        self.mode = "draft"

    def draft_tier_bytes(self) -> int:
        return sum(layer.draft.nbytes() for layer in self.layers if layer.draft is not None)

    def full_tier_bytes(self) -> int:
        return sum(layer.full.nbytes() for layer in self.layers)
