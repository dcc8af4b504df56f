"""`SharedPrefixes`: prompt prefixes' exact K/V kept in host memory by one serving engine, for the requests after.

Requests to a server often share a long prefix (a system prompt, a document, a conversation so far). After a
request's prefill its prompt's whole chunks are copied here; a later request whose prompt starts with some of them
has its full tier seeded with their K/V and prefills the rest only (`PrefixLoad.seed`): the same values a
prefill of the whole prompt would compute, so outputs stay exact, for a fraction of the prefill. Its draft tier is
then built as usual, over the whole prompt, so the request decodes like any other (in a cohort, in the engine).

Chunks are keyed by chained hashes (`keys.chunk_hashes`: chunk i only matches when every token before it does) and
each keeps its tokens, which a match compares. Memory is bounded (`max_bytes`); the least recently used chunks go
first, and a prompt's later chunks are always older than its earlier ones, so eviction shortens prefixes from their
end and never strands a chunk whose predecessor is gone. This is the engine's own memory, in-process: prefixes that
outlive the process or are shared between processes go through a `PrefixStore` instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..cache.draft_tier import tensor_bytes
from ..cache.vericache import VeriCache
from ..checks import check_int
from .keys import chunk_hashes, fingerprint_for

__all__ = ["SharedPrefixes"]


@dataclass(frozen=True)
class _Chunk:
    tokens: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, (1, H, chunk, D) keys and values on the host
    nbytes: int


class SharedPrefixes:
    """Whole chunks of `chunk_tokens` prompt tokens and their exact K/V, at most `max_bytes` of them, LRU.
    Thread-safe: one instance serves every request of an engine."""

    def __init__(self, model, max_bytes: int, chunk_tokens: int = 256) -> None:
        check_int("max_bytes", max_bytes)
        check_int("chunk_tokens", chunk_tokens)
        self.max_bytes, self.chunk_tokens = max_bytes, chunk_tokens
        self._fingerprint = fingerprint_for(model)
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.bytes_held = self.hits = self.misses = self.tokens_reused = self.evictions = 0

    def _hashes(self, prompt: torch.Tensor) -> list[str]:
        return chunk_hashes(prompt, self.chunk_tokens, self._fingerprint)

    def seed(self, cache: VeriCache, prompt: torch.Tensor, leave: int) -> int:
        """Seed `cache`'s full tier with the longest run of stored chunks `prompt` (1, T) starts with, leaving at
        least `leave` tokens to prefill; returns how many tokens it seeded (0: nothing matched)."""
        ids = prompt[0].tolist()
        usable = max(0, len(ids) - max(leave, 1)) // self.chunk_tokens
        hashes = self._hashes(prompt[:, : usable * self.chunk_tokens])
        with self._lock:
            found = []
            for index, key in enumerate(hashes):
                chunk = self._chunks.get(key)
                start = index * self.chunk_tokens
                if chunk is None or chunk.tokens != tuple(ids[start : start + self.chunk_tokens]):
                    break
                found.append(key)
            for key in reversed(found):  # the earlier chunks stay the more recently used
                self._chunks.move_to_end(key)
            chunks = [self._chunks[key] for key in found]
            self.hits, self.misses = self.hits + bool(chunks), self.misses + (not chunks)
            self.tokens_reused += len(chunks) * self.chunk_tokens
        if not chunks:
            return 0
        cache.prefix_load.seed([[chunk.layers[i] for chunk in chunks] for i in range(len(cache.layers))])
        return len(chunks) * self.chunk_tokens

    def keep(self, cache: VeriCache, prompt: torch.Tensor) -> None:
        """Copy the whole chunks of `prompt` (1, T), just prefilled into `cache`'s full tier, that are not held."""
        ids, hashes = prompt[0].tolist(), self._hashes(prompt)
        with self._lock:
            missing = [index for index, key in enumerate(hashes) if key not in self._chunks]
        copies = {index: self._copy(cache, ids, index) for index in missing}  # outside the lock: large copies
        with self._lock:
            for index in reversed(range(len(hashes))):  # the earlier chunks end the more recently used
                key = hashes[index]
                if key not in self._chunks and index in copies:
                    self._chunks[key] = copies[index]
                    self.bytes_held += copies[index].nbytes
                if key in self._chunks:
                    self._chunks.move_to_end(key)
            self._evict()

    def _copy(self, cache: VeriCache, ids: list[int], index: int) -> _Chunk:
        start, stop = index * self.chunk_tokens, (index + 1) * self.chunk_tokens
        layers = [
            (layer.full.keys[:1, :, start:stop].clone(), layer.full.values[:1, :, start:stop].clone())
            for layer in cache.layers
        ]
        return _Chunk(tuple(ids[start:stop]), layers, sum(tensor_bytes(*kv) for kv in layers))

    def _evict(self) -> None:
        while self.bytes_held > self.max_bytes:
            _, chunk = self._chunks.popitem(last=False)
            self.bytes_held -= chunk.nbytes
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        """Requests that reused a prefix and that did not, tokens reused, bytes held, chunks evicted."""
        with self._lock:
            return {
                "prefix_hits": self.hits,
                "prefix_misses": self.misses,
                "prefix_tokens_reused": self.tokens_reused,
                "prefix_bytes_held": self.bytes_held,
                "prefix_chunks_held": len(self._chunks),
                "prefix_evictions": self.evictions,
            }
