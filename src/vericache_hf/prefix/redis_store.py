"""`RedisStore`: prefix chunks in a Redis (or Valkey) server, shared by every process and host that reaches it.

A remote store sits on the decoding path, so it must never hang and never raise into decoding: socket timeouts are
finite and small (2 s by default), redis-py's own retries are switched off (its default retries a refused connection
ten times with backoff), and a failed request is a miss (`get` returns None) or a dropped write, with a warning.
After a failure the server is skipped for `cooldown_s`, so a prompt of many chunks pays one timeout, not one per
request. Batches are one round trip: `MGET` for reads, a `MULTI` pipeline for writes (a chunk's metadata and bytes
land together). Size bounds belong to the server (`maxmemory` with `maxmemory-policy allkeys-lru`), or `ttl_s`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from .store import PrefixStore, check_bytes

__all__ = ["RedisStore"]

T = TypeVar("T")


class RedisStore(PrefixStore):
    """Prefix chunks in the Redis server at `url`, under keys `vericache@<namespace>@...`."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        namespace: str = "default",
        timeout: float = 2.0,
        ttl_s: float | None = None,
        cooldown_s: float = 5.0,
    ) -> None:
        super().__init__(namespace)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as error:
            raise ImportError(
                "RedisStore needs the redis client: pip install 'vericache-hf[redis]'"
            ) from error
        if not (isinstance(timeout, int | float) and 0 < timeout < float("inf")):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be None (no expiry) or seconds > 0, got {ttl_s!r}")
        if not cooldown_s >= 0:
            raise ValueError(f"cooldown_s must be >= 0 seconds, got {cooldown_s!r}")
        self.url, self.timeout, self.ttl_s, self.cooldown_s = url, float(timeout), ttl_s, float(cooldown_s)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._down_until = 0.0
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )

    def _guarded(self, what: str, fallback: T, action: Callable[[], T]) -> T:
        """`action()`, or `fallback` with a warning when the server fails or is cooling down after a failure."""
        if time.monotonic() < self._down_until:
            return fallback
        try:
            return action()
        except self._errors as error:
            self._down_until = time.monotonic() + self.cooldown_s
            warnings.warn(
                f"vericache RedisStore at {self.url}: {what} failed ({type(error).__name__}: {error}); "
                f"treated as a miss / dropped write, and the server is skipped for {self.cooldown_s:g} s",
                stacklevel=3,
            )
            return fallback

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        full = [self.full_key(key) for key in keys]
        if not full:
            return []
        return self._guarded(
            f"reading {keys[0]!r} and {len(keys) - 1} more",
            [None] * len(full),
            lambda: self.client.mget(full),
        )

    def put(self, key: str, value: bytes) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        items = [(self.full_key(key), check_bytes(value)) for key, value in items]
        if not items:
            return

        def write() -> None:
            pipe = self.client.pipeline(transaction=True)
            for key, value in items:
                pipe.set(key, value, px=None if self.ttl_s is None else int(self.ttl_s * 1000))
            pipe.execute()

        self._guarded(f"writing {len(items)} entries", None, write)

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        full = [self.full_key(key) for key in keys]
        if not full:
            return []

        def check() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key in full:
                pipe.exists(key)
            return [bool(found) for found in pipe.execute()]

        return self._guarded(f"probing {len(full)} keys", [False] * len(full), check)

    def delete(self, key: str) -> None:
        self._guarded(f"deleting {key!r}", None, lambda: self.client.delete(self.full_key(key)))

    def close(self) -> None:
        self.client.close()
