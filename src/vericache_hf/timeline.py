"""`Timeline`: when each request prefilled, drafted, verified and had its full tier copied, as spans that a benchmark
can plot, to see whether requests stagger (one drafts while another's full tier streams in and it verifies).

Pass one as `VeriCacheConfig(timeline=Timeline())`. Spans go to the track of the thread that did the work: the
serving engine names it after the request (`track`), a plain call after its thread. A staging copy runs on the
transfer worker, so it is recorded on the track of the thread that queued it. Recording is thread-safe and costs a
lock and a tuple per span; with no timeline nothing is recorded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

KINDS = ("prefill", "draft", "transfer", "verify")


@dataclass(frozen=True)
class Span:
    track: str
    kind: str  # one of KINDS
    start: float  # time.perf_counter() seconds
    end: float


class Timeline:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.spans: list[Span] = []

    def current_track(self) -> str:
        return getattr(self._local, "track", None) or threading.current_thread().name

    @contextmanager
    def track(self, name: str) -> Iterator[None]:
        """Record this thread's spans on track `name` (the engine: one per request) inside the block."""
        outer = getattr(self._local, "track", None)
        self._local.track = name
        try:
            yield
        finally:
            self._local.track = outer

    def add(self, kind: str, start: float, end: float, track: str | None = None) -> None:
        span = Span(track or self.current_track(), kind, start, end)
        with self._lock:
            self.spans.append(span)

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Record the block as a `kind` span on this thread's track (also when it raises)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, started, time.perf_counter())

    def to_dicts(self) -> list[dict]:
        """The spans in start order, times in seconds from the first span's start (for JSON and plots)."""
        with self._lock:
            spans = sorted(self.spans, key=lambda span: span.start)
        origin = spans[0].start if spans else 0.0
        return [asdict(span) | {"start": span.start - origin, "end": span.end - origin} for span in spans]

    def busy_seconds(self, kind: str) -> float:
        """Wall time during which at least one `kind` span ran (overlapping spans counted once)."""
        with self._lock:
            spans = [(span.start, span.end) for span in self.spans if span.kind == kind]
        return _measure(_union(spans))

    def overlap_seconds(self, first: str, second: str) -> float:
        """Wall time during which a `first` span and a `second` span ran at once, on different tracks or the
        same (a copy behind its own request's draft counts: that is the overlap drafting is for)."""
        with self._lock:
            a = [(s.start, s.end) for s in self.spans if s.kind == first]
            b = [(s.start, s.end) for s in self.spans if s.kind == second]
        return _measure(_intersect(_union(a), _union(b)))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _measure(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)
