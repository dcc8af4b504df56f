"""Writes behind decoding: one background thread per store, so saving a prefix never waits on the store.

A request hands its save to `write_behind` and decodes on; the store's writer thread serialises, checksums and
writes. A failed write is dropped with a warning (the prefix is simply not reused). `flush` waits for a store's
writes, for tests, benchmarks and `warm_prefix`.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from .store import PrefixStore

__all__ = ["flush", "write_behind"]

_lock = threading.Lock()
_writers: weakref.WeakKeyDictionary[PrefixStore, tuple[ThreadPoolExecutor, set[Future]]] = (
    weakref.WeakKeyDictionary()
)


def _writer(store: PrefixStore) -> tuple[ThreadPoolExecutor, set[Future]]:
    with _lock:
        if store not in _writers:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vericache-prefix-writer")
            _writers[store] = (executor, set())
        return _writers[store]


def _report(future: Future, pending: set[Future]) -> None:
    with _lock:
        pending.discard(future)
    if future.exception() is not None:
        error = future.exception()
        warnings.warn(
            f"vericache prefix store: a save failed and was dropped ({type(error).__name__}: {error})",
            stacklevel=2,
        )


def write_behind(store: PrefixStore, job: Callable[[], object]) -> Future:
    """Run `job` (a save into `store`) on the store's writer thread; writes to one store keep their order."""
    executor, pending = _writer(store)
    future = executor.submit(job)
    with _lock:
        pending.add(future)
    future.add_done_callback(lambda done: _report(done, pending))
    return future


def flush(store: PrefixStore, timeout: float | None = None) -> bool:
    """Wait until every save queued for `store` so far is written (or dropped); False if `timeout` ran out."""
    with _lock:
        pending = set(_writers[store][1]) if store in _writers else set()
    return not wait(pending, timeout=timeout).not_done
