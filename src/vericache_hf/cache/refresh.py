"""Refreshing the draft tier: re-compress it from the full tier as decoding runs long.

A draft tier built at prefill drifts from what its method would keep now (new tokens are only appended or
windowed). A `RefreshPolicy` rebuilds every layer's draft tier from the exact full tier every `every_tokens` committed
tokens, or when the mean accepted run of recent rounds falls below `min_accepted`. Verification makes any draft tier
lossless, so a refresh changes speed, never output. It costs one host-to-device copy of the full tier (streamed
through the transfer engine, one layer on the device at a time) plus one compression per layer; `refresh_seconds` records it.

Only compressors that work from K/V alone can refresh (`scores_with_queries` False: StreamingLLM, KNorm, the
quantizers, compositions of these); query-aware methods (SnapKV, H2O, kvpress presses) need the prompt's
queries, which a prefill on the CPU holds only until the draft tier's one deferred build (`compress_prompt`), and
which are otherwise gone after prefill. One case gets them later: a prompt whose prefix came from a prefix store,
whose draft tier was scored by the prefix's own last queries. Its first verify pass computes the suffix's queries
exactly, and `rescore_draft_tier` builds the draft tier a prefill of the whole prompt would have.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace

from ..checks import check_int
from .compressor import CompressionContext, Compressor


def check_refreshable(compressor: Compressor) -> None:
    if compressor.scores_with_queries:
        raise ValueError(
            f"{type(compressor).__name__} scores tokens with the layer's queries, which are not kept after prefill, "
            "so its draft tier cannot be refreshed. Use refresh with a K/V-only compressor (streaming_llm, knorm, "
            "kivi, ...) or drop the refresh policy."
        )


def refresh_draft_tier(cache) -> None:
    """Rebuild every layer's draft tier from its full tier with the cache's compressor.

    Call between rounds (after `commit`, before the next draft): the full tier then holds every committed token but
    each row's pending one, which is exactly what the draft tier must hold.
    """
    check_refreshable(cache.compressor)
    for layer in cache.layers:
        refresh_draft_layer(cache, layer)


def refresh_draft_layer(cache, layer) -> float:
    """Rebuild one layer's draft tier from its full tier (see `refresh_draft_tier`); returns the seconds it took."""
    if not layer.full.length:
        raise RuntimeError("refresh_draft_tier needs a prefilled cache.")
    keys, values = cache.stream.layer_full_tier(layer.layer_idx)
    context = CompressionContext(layer_idx=layer.layer_idx, valid=cache.full_valid.to(layer.device))
    started = time.perf_counter()
    layer.draft = cache.compressor.compress(keys.to(layer.dtype), values.to(layer.dtype), context)
    seconds = time.perf_counter() - started
    cache.stats.compress_seconds += seconds
    return seconds


def rescores(compressor: Compressor, suffix_length: int) -> bool:
    """Whether `rescore_draft_tier` applies: a compressor that scores with a bounded window of the prompt's last
    queries, all of them in a suffix of `suffix_length` tokens."""
    window = compressor.queries_read
    return compressor.scores_with_queries and window is not None and 0 < window <= suffix_length


def rescore_draft_tier(
    cache, contexts: dict[int, CompressionContext], prompt_length: int, suffix_length: int
) -> None:
    """Rebuild every layer's draft tier from its full tier, scored with the prompt's last queries: `contexts` are
    the layer queries of a pass whose first `suffix_length` positions ended the prompt at `prompt_length` (captured
    after a stored prefix, see `rescores`). The prompt's tokens are compressed as a prefill of the whole prompt
    would have; the tokens committed after it are appended whole, as commits append them.

    Call between rounds, as `refresh_draft_tier`."""
    for layer in cache.layers:
        # the pass's first `suffix_length` positions are the prompt's last tokens
        context = contexts[layer.layer_idx].at_positions(slice(0, suffix_length))
        valid = cache.full_valid[:, :prompt_length].to(context.queries.device)
        compress_prompt(cache, layer, replace(context, valid=valid), prompt_length)


def compress_prompt(cache, layer, context: CompressionContext, prompt_length: int) -> float:
    """Build one layer's draft tier from its full tier as a prefill would have: the first `prompt_length` tokens
    compressed with the prompt's queries in `context`, the tokens committed since appended whole. Returns the
    seconds it took."""
    keys, values = cache.stream.layer_full_tier(layer.layer_idx)
    started = time.perf_counter()
    layer.draft = cache.compressor.compress(
        keys[:, :, :prompt_length].to(layer.dtype), values[:, :, :prompt_length].to(layer.dtype), context
    )
    if keys.shape[-2] > prompt_length:
        layer.draft.commit(
            keys[:, :, prompt_length:].to(layer.dtype),
            values[:, :, prompt_length:].to(layer.dtype),
            cache.full_valid[:, prompt_length:].to(layer.device),
        )
    seconds = time.perf_counter() - started
    cache.stats.compress_seconds += seconds
    return seconds


@dataclass(frozen=True)
class RefreshPolicy:
    """When to rebuild the draft tier from the full tier. Plain settings, shared by every call that uses the
    config: each cache counts for itself in its own `RefreshClock`.

    Parameters:
        every_tokens: refresh after this many tokens were committed since the last refresh (None: never by count).
        min_accepted: refresh when the mean accepted drafts per round over the last `window_rounds` rounds falls
            below this (None: never by acceptance).
        window_rounds: rounds averaged for `min_accepted`; the window restarts after a refresh.
    """

    every_tokens: int | None = None
    min_accepted: float | None = None
    window_rounds: int = 4

    def __post_init__(self) -> None:
        if self.every_tokens is None and self.min_accepted is None:
            raise ValueError("RefreshPolicy needs every_tokens, min_accepted or both.")
        if self.every_tokens is not None:
            check_int("every_tokens", self.every_tokens)
        if self.min_accepted is not None and (
            isinstance(self.min_accepted, bool)
            or not isinstance(self.min_accepted, (int, float))
            or not self.min_accepted >= 0
        ):
            raise ValueError(f"min_accepted must be a non-negative number, got {self.min_accepted!r}.")
        check_int("window_rounds", self.window_rounds)

    def to_dict(self) -> dict:
        """The settings as a JSON-friendly dict; `RefreshPolicy(**d)` reads it back."""
        return asdict(self)


@dataclass
class RefreshClock:
    """One cache's count towards its `policy`: tokens committed since the last refresh and the recent rounds'
    mean accepted drafts."""

    policy: RefreshPolicy
    since: int = 0
    recent: deque = field(default_factory=deque)

    def due(self, committed: int, mean_accepted: float | None) -> bool:
        """Record a round (tokens committed, mean accepted drafts, None for a round that drafted nothing); True
        when a refresh is due."""
        policy = self.policy
        self.since += committed
        if mean_accepted is not None:
            self.recent.append(mean_accepted)
        while len(self.recent) > policy.window_rounds:
            self.recent.popleft()
        if policy.every_tokens is not None and self.since >= policy.every_tokens:
            return True
        full_window = len(self.recent) == policy.window_rounds
        return (
            policy.min_accepted is not None
            and full_window
            and sum(self.recent) / len(self.recent) < policy.min_accepted
        )

    def after_commit(self, cache, committed: int, mean_accepted: float | None) -> bool:
        """The loop's hook: call after `cache.commit`; refreshes when due, counted in the cache's stats. Returns
        whether it refreshed."""
        if not self.due(committed, mean_accepted):
            return False
        started = time.perf_counter()
        refresh_draft_tier(cache)
        cache.stats.refresh_seconds += time.perf_counter() - started
        cache.stats.draft_tier_refreshes += 1
        self.since = 0
        self.recent.clear()
        return True
