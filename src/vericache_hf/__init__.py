"""vericache-hf: lossless KV-cache compression for HuggingFace Transformers.

`import vericache_hf` adds `generation_mode="vericache"` to `model.generate` (see `registration.py`): the model
drafts on a compressed KV cache and verifies against the full one, so greedy output equals stock `generate`'s.
"""

from ._threads import release_workers
from .cache import VeriCache
from .cache.refresh import RefreshPolicy
from .cache.transfer import TransferError
from .compressors import Compressor, available_compressors
from .config import VeriCacheConfig
from .decoding import VeriCacheGenerateOutput, generate, warm_prefix
from .registration import register, set_default_mode, vericache_generate
from .serving.engine import GenerationOutput, RequestStatus, VeriCacheEngine, generate_batch
from .stats import VeriCacheStats
from .timeline import Timeline

register(generate_batch)

__version__ = "0.1.0"

__all__ = [
    "Compressor",
    "GenerationOutput",
    "RefreshPolicy",
    "RequestStatus",
    "Timeline",
    "TransferError",
    "VeriCache",
    "VeriCacheConfig",
    "VeriCacheEngine",
    "VeriCacheGenerateOutput",
    "VeriCacheStats",
    "available_compressors",
    "generate",
    "generate_batch",
    "register",
    "release_workers",
    "set_default_mode",
    "vericache_generate",
    "warm_prefix",
]
