"""A stored prefix reaching a `VeriCache`'s full tier: copied in at once before a prefill, or appended by a loader
thread while drafting runs.

The loader writes each layer's host full tier and reports it (`layer_loaded`); a verify pass on the caller's
thread reads that layer only once the report came, so each layer's events are the only thing the two threads
share. A verify pass on the CPU can then run behind the load, a layer waiting only for its own prefix; one on an
accelerator waits for the whole tier (`finish`), since its transfers copy whole layers ahead of the pass.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .vericache import VeriCache


class PrefixNotLoaded(RuntimeError):
    """A verify pass reached a layer whose stored prefix did not arrive (the store failed or timed out)."""


class PrefixLoad:
    """Keeps a cache's verify passes in step with a stored prefix that reaches its full tier outside a prefill."""

    def __init__(self, owner: VeriCache) -> None:
        self.owner = owner
        self.loading = False  # a stored prefix is being appended to the full tier by a loader
        self.seeded_tokens = 0  # leading prompt tokens whose K/V `seed` put in the full tier
        self._layer_ready: list[threading.Event] = []
        self._layer_loaded: list[bool] = []
        self._timeout = 60.0

    def seed(self, layers: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Start the full tier with a shared prefix's exact K/V: per layer, its (1, H, n, D) pieces in order, copied
        in once; the prefill that follows passes the rest of the prompt only, at positions P onwards, and its
        `prompt_valid` covers the whole prompt. The compressor must read no more queries than that rest holds
        (`Compressor.queries_read`)."""
        tiered = self.owner.tiered
        if self.owner.full_valid is not None or self.seeded_tokens:
            raise RuntimeError("a prefix is seeded before the prefill; create a new cache for a new prompt.")
        if len(layers) != len(tiered):
            raise ValueError(f"got a prefix of {len(layers)} layers for {len(tiered)} layers")
        length = sum(keys.shape[-2] for keys, _ in layers[0])
        for layer, pieces in zip(tiered, layers, strict=True):
            layer.full.reserve(length, *pieces[0])
            for keys, values in pieces:
                layer.full.append(keys, values)
        self.seeded_tokens = length

    def start(self, timeout: float) -> None:
        """A loader is about to append a stored prefix to every layer's full tier (`VeriCache.adopt_prefix`); a
        verify pass waits up to `timeout` for each layer's."""
        self.loading = True
        self._layer_ready = [threading.Event() for _ in self.owner.layers]
        self._layer_loaded = [False] * len(self.owner.layers)
        self._timeout = timeout

    def layer_loaded(self, layer_idx: int) -> None:
        """The loader appended layer `layer_idx`'s whole prefix: a verify pass may read it."""
        self._layer_loaded[layer_idx] = True
        self._layer_ready[layer_idx].set()

    def loading_stopped(self) -> None:
        """The loader ended, done or not: a verify pass waiting on a layer it did not load raises at once."""
        for event in self._layer_ready:
            event.set()

    def await_layer(self, layer_idx: int) -> None:
        """Wait for layer `layer_idx`'s prefix; raise `PrefixNotLoaded` when the loader stopped or timed out
        without it."""
        started = time.perf_counter()
        self._layer_ready[layer_idx].wait(self._timeout)
        self.owner.stats.prefix_wait_seconds += time.perf_counter() - started
        if not self._layer_loaded[layer_idx]:
            raise PrefixNotLoaded(f"layer {layer_idx}'s stored prefix did not arrive in {self._timeout} s")

    def finish(self) -> None:
        """The loader `start` announced is done: verify passes may read the whole full tier."""
        expected = self.owner.full_valid.shape[-1]
        lengths = {layer.full.length for layer in self.owner.tiered}
        if lengths != {expected}:
            raise RuntimeError(
                f"the full tier holds {sorted(lengths)} tokens per layer, the adopted prefix {expected}"
            )
        self.loading = False
