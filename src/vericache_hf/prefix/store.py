"""The byte store that prefix chunks live in (`PrefixStore`), and a wrapper that emulates a network for benchmarks.

A store maps string keys to bytes and knows nothing about tensors: the cache above it encodes, checks and decodes.
Every key is prefixed with the store's namespace (`vericache@<namespace>@<key>`), so tenants sharing one server or
directory never see each other's entries. A store never raises into decoding because of the backend: a read that
fails is a miss (None) with a warning, and a write that fails is dropped with a warning.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

from .keys import check_namespace

__all__ = ["PrefixStore", "ThrottledStore"]


class PrefixStore(ABC):
    """Bytes under string keys, separated by namespace. Backends implement `get`, `put`, `exists` and `delete`,
    and override the batch forms when the backend can batch (one round trip instead of one per key)."""

    def __init__(self, namespace: str = "default") -> None:
        self.namespace = check_namespace(namespace)

    def full_key(self, key: str) -> str:
        """The key as the backend stores it, with this tenant's prefix."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must be a non-empty str, got {key!r}")
        return f"vericache@{self.namespace}@{key}"

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The bytes under `key`, or None when absent or unreachable."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key`, replacing any previous value."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether `key` is present (False when unreachable)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key` if present: used to drop entries that were refused on read, so a later save repairs them."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(key) for key in keys]

    def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        for key, value in items:
            self.put(key, value)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.exists(key) for key in keys]


def check_bytes(value: object) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(
            f"value must be bytes, got {type(value).__name__}: encode it first (see prefix.codec)"
        )
    return bytes(value)


class ThrottledStore(PrefixStore):
    """Benchmark-only: `inner` behind an emulated link. Each request (a batch counts as one, as a pipelined
    round trip would) sleeps `latency_s` plus its bytes over `bandwidth_bytes_per_s`. It sleeps rather than spins,
    so it costs no CPU; nothing wraps a store in it unless asked."""

    def __init__(self, inner: PrefixStore, bandwidth_bytes_per_s: float, latency_s: float = 0.0) -> None:
        if not isinstance(inner, PrefixStore):
            raise TypeError(f"inner must be a PrefixStore, got {type(inner).__name__}")
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s!r}")
        if not latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s!r}")
        self.inner, self.bandwidth, self.latency = inner, float(bandwidth_bytes_per_s), float(latency_s)
        self.slept_s = 0.0  # total emulated time, for a benchmark to report

    @property
    def namespace(self) -> str:  # type: ignore[override]
        return self.inner.namespace

    def _wait(self, nbytes: int) -> None:
        delay = self.latency + nbytes / self.bandwidth
        self.slept_s += delay
        time.sleep(delay)

    def get(self, key: str) -> bytes | None:
        value = self.inner.get(key)
        self._wait(len(value or b""))
        return value

    def put(self, key: str, value: bytes) -> None:
        self._wait(len(value))
        self.inner.put(key, value)

    def exists(self, key: str) -> bool:
        self._wait(0)
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self._wait(0)
        self.inner.delete(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values = self.inner.get_many(keys)
        self._wait(sum(len(v or b"") for v in values))
        return values

    def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        items = list(items)
        self._wait(sum(len(v) for _, v in items))
        self.inner.put_many(items)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        self._wait(0)
        return self.inner.exists_many(keys)
