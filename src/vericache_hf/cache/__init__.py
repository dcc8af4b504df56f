"""The ground floor: the two tiers (draft tier on device, full tier on the host), the transfers that bring the full
tier in for verification, the `Cache` that pairs them and drives them through phases, and the interface
compressors implement (`Compressor`, `CompressionContext`)."""

from .capture import QueryCapture
from .compressor import CompressionContext, Compressor
from .draft_tier import DraftStore, TokenStore
from .full_tier import HostKVStore
from .layers import VeriCacheLayer
from .refresh import RefreshPolicy
from .staging import StagingBuffers
from .transfer import TransferEngine, TransferError
from .vericache import VeriCache

__all__ = [
    "CompressionContext",
    "Compressor",
    "DraftStore",
    "HostKVStore",
    "QueryCapture",
    "RefreshPolicy",
    "StagingBuffers",
    "TokenStore",
    "TransferEngine",
    "TransferError",
    "VeriCache",
    "VeriCacheLayer",
]
