"""vericache-hf: lossless KV-cache compression for HuggingFace Transformers.

`import vericache_hf` adds `generation_mode="vericache"` to `model.generate` (see `registration.py`): the model
drafts on a compressed KV cache and verifies against the full one, so greedy output equals stock `generate`'s.
"""

from .cache import VeriCache
from .cache.refresh import RefreshPolicy
from .cache.transfer import TransferError
from .compressors import Compressor, available_compressors
from .config import VeriCacheConfig
from .decoding import VeriCacheGenerateOutput, generate
from .registration import register, set_default_mode, vericache_generate
from .stats import VeriCacheStats

register()

__version__ = "0.1.0"

__all__ = [
    "Compressor",
    "RefreshPolicy",
    "TransferError",
    "VeriCache",
    "VeriCacheConfig",
    "VeriCacheGenerateOutput",
    "VeriCacheStats",
    "available_compressors",
    "generate",
    "register",
    "set_default_mode",
    "vericache_generate",
]
