"""The two tiers (draft tier on device, full tier on the host), the staging that brings the full tier in for
verification, and the `Cache` that pairs them."""

from .draft_tier import DraftStore, TokenStore
from .full_tier import HostKVStore
from .staging import StagingBuffers
from .vericache import VeriCache, VeriCacheLayer

__all__ = ["DraftStore", "HostKVStore", "StagingBuffers", "TokenStore", "VeriCache", "VeriCacheLayer"]
