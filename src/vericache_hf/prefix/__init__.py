"""Prefix KV stores: reuse a shared prompt prefix's KV across requests, compressed tier first.

`VeriCacheConfig(prefix_store=DiskStore())` is all `generate` needs (see `reuse.py` for what happens on a hit and
a miss); `vericache_hf.warm_prefix` stores a prefix without generating, and `flush(store)` waits for queued saves.

A prompt's KV is saved in chunks of 256 tokens under chained sha256 keys that include a `KVFingerprint` of the
model, dtype, layout and compressor, and loaded back as the longest leading run of chunks that hit. Stores:
`DiskStore` (a local directory, LRU-bounded), `RedisStore` (a shared server; `pip install 'vericache-hf[redis]'`),
and `ThrottledStore` (an emulated network link, for benchmarks only). Nothing read from a store is executed: the
tensors are safetensors, the metadata JSON, and every entry is checksummed.

    from vericache_hf.prefix import DiskStore, PrefixCache, fingerprint_for

    cache = PrefixCache(DiskStore())
    fingerprint = fingerprint_for(model)
    cache.save(input_ids[0], [(layer.keys, layer.values) for layer in past.layers], fingerprint)
    hit_tokens, per_layer_kv = cache.load(input_ids[0], fingerprint)
"""

from .cache import PrefixCache
from .codec import FORMAT_VERSION
from .disk import DiskStore
from .keys import TIERS, KVFingerprint, chunk_hashes, fingerprint_for
from .redis_store import RedisStore
from .store import PrefixStore, ThrottledStore
from .writer import flush

__all__ = [
    "FORMAT_VERSION",
    "TIERS",
    "DiskStore",
    "KVFingerprint",
    "PrefixCache",
    "PrefixStore",
    "RedisStore",
    "ThrottledStore",
    "chunk_hashes",
    "fingerprint_for",
    "flush",
]
