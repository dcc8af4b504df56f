"""When a `VeriCache`'s draft tier exists: built at prefill, deferred to the first draft, freed while rounds are
plain, built again from the full tier, refreshed as decoding runs long.

A draft tier is only worth its compression when a round drafts, so a layer that reads its full tier in place
defers it (`defers_compression`) and the loop builds it when drafting first needs it, if the build can repay
itself (`build`). A compressor that scores with the prompt's queries cannot rebuild from the full tier alone: the
queries it needs are held from the prefill until that one build (`prompt_queries`), and its tier is never freed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .compressor import CompressionContext
from .layers import VeriCacheLayer
from .refresh import RefreshClock, RefreshPolicy, check_refreshable, compress_prompt, refresh_draft_layer

if TYPE_CHECKING:
    from .vericache import VeriCache


class DraftTierLifecycle:
    """Builds, frees and refreshes one cache's draft tier, and holds what a deferred build reads.

    `refresh_policy` rebuilds the tier from the full tier as decoding runs long; its `refresh_clock` is this
    cache's own count towards the policy, since one config may serve many calls at once."""

    def __init__(self, owner: VeriCache, refresh_policy: RefreshPolicy | None = None) -> None:
        if refresh_policy is not None:
            check_refreshable(owner.compressor)
        self.owner = owner
        self.refresh_policy = refresh_policy
        self.refresh_clock = RefreshClock(refresh_policy) if refresh_policy is not None else None
        # layer inputs a deferred query-aware build reads, by layer
        self.prompt_inputs: dict[int, CompressionContext] = {}

    @property
    def rebuildable(self) -> bool:
        """Whether the compressor can build the draft tier from the full tier alone (no prompt queries needed)."""
        return not self.owner.compressor.scores_with_queries

    @property
    def buildable(self) -> bool:
        """Whether `build` can build the draft tier: from the full tier alone, or with the queries held since the
        prefill (a query-aware build declined once has released them)."""
        return self.rebuildable or all(layer.layer_idx in self.prompt_inputs for layer in self.unbuilt())

    @property
    def held(self) -> bool:
        """False while any layer's draft tier is deferred (see `defers_compression`; on a model split between an
        accelerator and the CPU, only the CPU layers defer) or freed, until `build`."""
        return not self.unbuilt()

    def unbuilt(self) -> list[VeriCacheLayer]:
        """The attention layers without a draft tier."""
        return [layer for layer in self.owner.tiered if layer.draft is None]

    def defers_compression(self, layer: VeriCacheLayer) -> bool:
        """Whether the prefill leaves this layer's draft tier to `build`: a layer that reads its full tier in place
        compresses the same K/V later at no transfer cost. The first token then does not wait for compression
        (H2O's scoring costs about two more attention passes of the prompt), and a call whose rounds are all plain
        never compresses. A query-aware compressor's queries are held until then (the last `queries_read` of them;
        H2O reads them all, as many floats as the layer input), unless a stored prefix seeded the prompt: its
        queries are the suffix's alone. On an accelerator the prompt's K/V are compressed while they are on the
        device."""
        return layer.reads_in_place and (self.rebuildable or not self.owner.prefix_load.seeded_tokens)

    def prompt_queries(self, context: CompressionContext) -> None:
        """A prefill layer's queries arrived: compress its prompt K/V at once, or hold them for `build`."""
        owner = self.owner
        layer = owner.layers[context.layer_idx]
        if layer not in owner.tiered:  # a window layer keeps its tokens exact
            return
        if self.defers_compression(layer):
            # a refusal comes before the first token
            if layer is owner.tiered[0] and layer.prompt_kv is not None:
                owner.compressor.check_layer(*layer.prompt_kv, context)
            layer.prompt_kv = None
            self.prompt_inputs[context.layer_idx] = context.detached()
        else:
            layer.build_from_prompt(context)

    def free(self) -> None:
        """Drop every layer's draft tier (its device memory) while rounds are plain: commits then write the full
        tier alone, and `build` compresses it anew before the next draft. Only for compressors that work from K/V
        alone; query-aware ones cannot rebuild after the prefill. Its size is recorded first."""
        owner = self.owner
        check_refreshable(owner.compressor)
        if owner.phase != "idle":
            raise RuntimeError(f"VeriCache cannot free its draft tier while {owner.phase}.")
        owner.stats.draft_tier_bytes = max(owner.stats.draft_tier_bytes, owner.draft_tier_bytes())
        for layer in owner.tiered:
            layer.draft = None
        owner.stats.draft_tier_frees += 1

    def build(self, afford: Callable[[float], bool] | None = None, price: float | None = None) -> bool:
        """Compress the full tier into the draft tier, deferred at prefill or freed (its time in compress_seconds).

        `afford`, when given, is asked after the first two layers whether the whole build, priced at the faster
        one's time per layer (the first pays one-off costs: KIVI's took 0.29 s of a 1.2k-token prompt, the next
        a few ms), is worth paying; when not, they are dropped again and nothing more is built (a build can cost
        more than a whole answer's drafting could save: HQQ's takes about a prefill's time on a CPU). Returns
        whether the draft tier was built. `price`, when an earlier build was measured, is asked of `afford` instead,
        before any layer is built. A query-aware compressor builds from the layer inputs held since the prefill
        (`prompt_queries`), which a build uses up and a refusal releases: its tier is then never built."""
        if not self.buildable:
            raise RuntimeError(
                f"{type(self.owner.compressor).__name__} scores tokens with the prompt's layer inputs, and none are "
                "held (they were used by an earlier build, or released when one was declined): its draft tier cannot "
                "be built again. Rebuilding needs a K/V-only compressor (streaming_llm, knorm, kivi, ...)."
            )
        if afford is not None and price is not None:
            if not afford(price):
                self.prompt_inputs.clear()
                return False
            afford = None  # paid at the price measured before, not priced again
        unbuilt = self.unbuilt()
        if not unbuilt:
            return True
        priced, rest = unbuilt[:2], unbuilt[2:]
        seconds = min(self._build_layer(layer) for layer in priced)
        if afford is not None and not afford(seconds * len(unbuilt)):
            for layer in priced:
                layer.draft = None
            self.prompt_inputs.clear()
            return False
        for layer in rest:
            self._build_layer(layer)
        self.prompt_inputs.clear()
        self.owner.stats.draft_tier_builds += 1
        return True

    def _build_layer(self, layer: VeriCacheLayer) -> float:
        held = self.prompt_inputs.get(layer.layer_idx)
        if held is None:
            return refresh_draft_layer(self.owner, layer)
        return compress_prompt(self.owner, layer, held, self.owner.prompt_valid.shape[-1])
