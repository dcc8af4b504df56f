"""`VeriCache`: a transformers `Cache` whose layers pair a draft tier (compressed, on device) with a full tier (exact,
on the host), driven through explicit phases. Each phase is a context manager that owns its setup and undoes it on
exit, error included; nothing outside this class writes the phase.

- `prefilling(model, valid)`: the prompt's exact K/V go to the full tier and the compressor builds the draft tier
  from them (with each layer's queries, for compressors that score with them), or, on a layer that reads
  its full tier in place, leaves that to `build_draft_tier` when drafting starts (holding the queries a
  query-aware compressor reads until then);
- `drafting(k)`: drafted tokens go after the draft tier's committed slots; the full tier starts streaming to the
  device for the next verify pass; on exit the drafts are rolled back (the draft tier holds only committed tokens);
- `verifying()`: attention reads the whole full tier, then the new tokens, whose exact K/V are kept as pending;
  `commit(count, valid)` then keeps as many of them as were accepted, in both tiers.

Every forward is an ordinary transformers forward with stock attention: the cache hands attention one (B, H, T, D)
tensor per layer, the draft tier's or the full tier's. Nothing about the model is changed, so calls on other
threads (VeriCache or plain `generate`) are unaffected. A layer on the CPU reads its full tier in place; a layer on
an accelerator gets it through the `TransferEngine`, layer by layer into staging buffers, queued when drafting
starts so that the copies overlap the draft. The full tier only changes at `commit`, after the verify pass, so a
transfer queued after one commit and read before the next sees exactly the committed tokens (checked).

Every length this cache reports is *physical* (slots held), which is what transformers' mask code works in. Rows may
hold masked slots (left padding, or tokens another row accepted that this row did not), so the loop always passes
explicit `position_ids`, and the 2-D `attention_mask` built by `attention_mask()` (None while a tier has no masked
slot, as a stock decode step passes none).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer

from ..attention import ACTIVE_CAPTURE, CAPTURE_KWARG
from ..checks import check_int
from ..stats import VeriCacheStats
from ..timeline import Timeline
from ..verify_attention import VERIFY_KWARG, VerifyPass, resolve_kernel
from .capture import QueryCapture
from .compressor import CompressionContext, Compressor
from .draft_tier import DraftStore
from .full_tier import HostKVStore
from .recurrent import RecurrentLayer
from .refresh import RefreshClock, RefreshPolicy, check_refreshable, compress_prompt, refresh_draft_layer
from .staging import buffer_tokens
from .transfer import LayerTransfer, TransferEngine

#: Tokens a staging buffer leaves free after the full tier when no draft length was announced.
DEFAULT_ROOM = 64


class PrefixNotLoaded(RuntimeError):
    """A verify pass reached a layer whose stored prefix did not arrive (the store failed or timed out)."""


class VeriCacheLayer(CacheLayerMixin):
    """One decoder layer's two tiers."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, owner: VeriCache) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner
        self.full = HostKVStore(owner.chunk_tokens)
        self.draft: DraftStore | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pending_in_place = False
        self.prompt_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # until the layer's queries arrive

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    @property
    def reads_in_place(self) -> bool:
        """A layer on the CPU attends to its host full tier itself, unless `stage_on_cpu` asks for the copies."""
        return self.device.type == "cpu" and not self.owner.stage_on_cpu

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        phase = self.owner.phase
        if phase == "drafting":
            return self._draft(key_states, value_states)
        if phase == "verifying":
            return self._verify(key_states, value_states)
        if phase == "prefilling":
            return self._prefill(key_states, value_states)
        raise RuntimeError(
            f"a forward wrote to VeriCache layer {self.layer_idx} outside a phase; run it inside the cache's "
            "prefilling(), drafting() or verifying() block."
        )

    def _prefill(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self.owner
        seeded = owner.seeded_tokens  # a shared prefix's exact K/V, already in the full tier (`seed_prefix`)
        if self.full.length != seeded:
            raise RuntimeError("VeriCache supports a single prefill; create a new cache for a new prompt.")
        if seeded and not self.reads_in_place:  # attention and the compressor read the prefix on the device
            past = owner.layer_full_tier(self.layer_idx)
        owner.stats.bytes_to_host += self.full.append(keys, values)
        if seeded:
            keys, values = (
                self.full.view()
                if self.reads_in_place
                else (torch.cat([past[0], keys], dim=2), torch.cat([past[1], values], dim=2))
            )
        if owner.compressor.scores_with_queries:
            # the layer's queries reach attention after this update: `prompt_queries` compresses then
            self.prompt_kv = keys, values
        elif not owner.defers_compression(self):
            self.build_from_prompt(CompressionContext(self.layer_idx, owner.prompt_valid))
        return keys, values

    def build_from_prompt(self, context: CompressionContext) -> None:
        """Build the draft tier from the prompt's K/V, which are on the layer's device now."""
        keys, values = self.prompt_kv if self.prompt_kv is not None else self.full.view()
        self.prompt_kv = None
        started = time.perf_counter()
        self.draft = self.owner.compressor.compress(keys, values, context)
        self.owner.stats.compress_seconds += time.perf_counter() - started

    def _draft(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft tier then the drafted tokens. A drafting model of another float type (`draft_dtype`) gets
        them in its own: a store that can converts itself once, any other is cast each pass."""
        if not self.draft.to_dtype(keys.dtype):
            keys_read, values_read = self.draft.extend_draft(keys, values)
            return keys_read.to(keys.dtype), values_read.to(values.dtype)
        return self.draft.extend_draft(keys, values)

    def _verify(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The full tier then the q new tokens, as one tensor each; the new tokens are kept as pending."""
        if self.owner.full_tier_loading:
            self.owner.await_layer(self.layer_idx)
        self.pending = (keys, values)
        self.pending_in_place = self.reads_in_place
        if self.pending_in_place:
            return self.full.extend_view(keys, values)
        if self.owner.streams(self.layer_idx):  # attention reads the full tier chunk by chunk, then these
            return keys, values
        staged_keys, staged_values = self.owner.staged(self.layer_idx)
        stored, end = self.full.length, self.full.length + keys.shape[-2]
        if staged_keys.shape[2] < end:  # more tokens than the room announced when drafting started
            staged_keys = torch.cat([staged_keys[:, :, :stored], keys], dim=2)
            staged_values = torch.cat([staged_values[:, :, :stored], values], dim=2)
            return staged_keys, staged_values
        staged_keys[:, :, stored:end] = keys
        staged_values[:, :, stored:end] = values
        return staged_keys[:, :, :end], staged_values[:, :, :end]

    def commit(self, count: int, valid: torch.Tensor) -> None:
        """Keep the first `count` verified tokens in both tiers; forget the rest."""
        keys, values = self.pending
        keys, values = keys[:, :, :count], values[:, :, :count]
        if self.pending_in_place:
            self.owner.stats.bytes_to_host += self.full.commit_in_place(count)
        else:
            self.owner.stats.bytes_to_host += self.full.append(keys, values)
        if self.draft is not None:  # a deferred or freed draft tier is built from the full tier, not kept up
            self.draft.commit(keys, values, valid.to(keys.device))
        self.pending = None

    def get_seq_length(self) -> int:
        if self.owner.phase == "drafting":
            return self.draft.num_committed + self.draft.num_drafted
        if self.owner.full_tier_loading:  # the mask is built before this layer's prefix has arrived
            return self.owner.full_valid.shape[-1]
        return self.full.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class PairedLayer(RecurrentLayer, VeriCacheLayer):
    """A layer that holds attention K/V and a recurrent state side by side (Zamba, Falcon-H1; transformers' hybrid
    cache layer): the two tiers for its attention, one rolled-back state for the rest."""

    is_compileable = False

    def __init__(self, layer_idx: int, owner: VeriCache, number_of_states: int = 1) -> None:
        VeriCacheLayer.__init__(self, layer_idx, owner)
        RecurrentLayer.__init__(self, layer_idx, number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:  # attention's K/V
            VeriCacheLayer.lazy_initialization(self, *args)
        else:  # a conv or recurrent state
            RecurrentLayer.lazy_initialization(self, *args, **kwargs)

    def get_seq_length(self) -> int:
        return VeriCacheLayer.get_seq_length(self)

    def get_max_length(self) -> int:
        return VeriCacheLayer.get_max_length(self)


class VeriCache(Cache):
    """Two-tier cache for draft-then-verify decoding. Build one per request.

    `chunk_tokens` is the granule the host full tier grows by; `staging_buffers` is how many pieces of the full tier
    may be on an accelerator at once, each a layer that fits in `staging_chunk_tokens` or one chunk of that many
    tokens of a longer layer (None: whole layers, however long); `verify_attention` is the verify pass's kernel
    (`verify_attention.KERNELS`); `transfer_timeout` bounds every wait on a transfer; `stage_on_cpu` copies the
    full tier through the staging buffers even when a layer's device is the CPU, where by default it is read in
    place. Pass a shared `transfers` engine to serve several caches through one queue (its own buffer count,
    timeout and link then apply); `link_bytes_per_s` emulates a slower link for a private one (benchmarks only),
    and its copies are recorded in `timeline` when one is given.
    """

    def __init__(
        self,
        num_layers: int,
        compressor: Compressor,
        stats: VeriCacheStats | None = None,
        chunk_tokens: int = 2048,
        staging_buffers: int = 2,
        transfer_timeout: float = 60.0,
        transfers: TransferEngine | None = None,
        refresh_policy: RefreshPolicy | None = None,
        stage_on_cpu: bool = False,
        link_bytes_per_s: float | None = None,
        timeline: Timeline | None = None,
        staging_chunk_tokens: int | None = 3072,
        verify_attention: str = "auto",
        recurrent: dict[int, int] | None = None,
        paired: set[int] | None = None,
        stateless: set[int] | None = None,
    ) -> None:
        if staging_chunk_tokens is not None:
            check_int("staging_chunk_tokens", staging_chunk_tokens)
        resolve_kernel(verify_attention, torch.device("cpu"))  # checks the name
        self.staging_chunk_tokens = staging_chunk_tokens
        self.verify_attention = verify_attention
        if refresh_policy is not None:
            check_refreshable(compressor)
        self.refresh_policy = refresh_policy
        # this cache's own count towards the policy: one config may serve many calls at once
        self.refresh_clock = RefreshClock(refresh_policy) if refresh_policy is not None else None
        self.compressor = compressor
        self.chunk_tokens = chunk_tokens
        self.stage_on_cpu = stage_on_cpu
        self.stats = stats if stats is not None else VeriCacheStats()
        self.transfers = (
            transfers
            if transfers is not None
            else TransferEngine(staging_buffers, transfer_timeout, link_bytes_per_s, timeline=timeline)
        )
        self._owns_transfers = transfers is None  # its own engine's worker lives as long as the cache
        self.phase = "idle"
        self.prompt_valid: torch.Tensor | None = None
        self.full_valid: torch.Tensor | None = None
        self._capture: QueryCapture | None = None
        self._held: dict[int, CompressionContext] = {}  # layer inputs a deferred query-aware build reads
        # the next verify pass's transfers, by layer: one for a whole layer, one per chunk for a streamed layer
        self._round: dict[int, list[LayerTransfer]] | None = None
        self._streamed: set[int] = set()  # layers of this round's pass that arrive in chunks
        self._staged: list[LayerTransfer] = []  # transfers the running verify pass has read
        self._verify_pass: VerifyPass | None = None
        self._draft_valid: torch.Tensor | None = None  # (B, drafted slots marked by `keep_drafted`)
        # no masked slot in the tier (no padding, nothing a row rejected): passes need no explicit mask
        self._full_dense = self._draft_dense = False
        self.full_tier_loading = False  # a stored prefix is being appended to the full tier by a loader
        self.seeded_tokens = 0  # leading prompt tokens whose K/V `seed_prefix` put in the full tier
        self._layer_ready: list[threading.Event] = []
        self._layer_loaded: list[bool] = []
        self._load_timeout = 60.0
        recurrent, paired, stateless = recurrent or {}, paired or set(), stateless or set()
        super().__init__(
            layers=[
                PairedLayer(i, self, recurrent[i])
                if i in paired
                else RecurrentLayer(i, recurrent[i])
                if i in recurrent
                else DummyLayer()
                if i in stateless
                else VeriCacheLayer(i, self)
                for i in range(num_layers)
            ]
        )
        #: the attention layers, each a draft tier and a full tier; the recurrent ones keep one state each (a paired
        #: layer is both)
        self.tiered: list[VeriCacheLayer] = [
            layer for layer in self.layers if isinstance(layer, VeriCacheLayer)
        ]
        self.recurrent: list[RecurrentLayer] = [
            layer for layer in self.layers if isinstance(layer, RecurrentLayer)
        ]

    # -- phases --------------------------------------------------------------------------------------------------
    @contextmanager
    def _phase(self, name: str, *allowed_from: str) -> Iterator[None]:
        if self.phase not in allowed_from:
            raise RuntimeError(f"VeriCache cannot start {name} while {self.phase}.")
        self.phase = name
        try:
            yield
        finally:
            self.phase = "idle"

    @contextmanager
    def prefilling(self, model, prompt_valid: torch.Tensor) -> Iterator[None]:
        """The prompt's forward pass. `prompt_valid` (B, T) is False on left padding."""
        if self.full_valid is not None:
            raise RuntimeError("VeriCache supports a single prefill; create a new cache for a new prompt.")
        self.prompt_valid = prompt_valid.bool()
        self.full_valid = self.prompt_valid.clone()
        self._full_dense = bool(self.prompt_valid.all())
        capture = (
            QueryCapture(
                self.prompt_valid,
                model,
                last=self.compressor.queries_read,
                inputs=self.compressor.reads_layer_inputs,
                on_layer=self._prompt_queries,
            )
            if self.compressor.scores_with_queries
            else None
        )
        with self._phase("prefilling", "idle"), self.capturing(capture):
            yield
        held = sorted({layer.full.length for layer in self.tiered if layer.is_initialized})
        if held and held != [self.prompt_valid.shape[-1]] and not self.full_tier_loading:
            for layer in self.tiered:
                layer.prompt_kv = None
            raise ValueError(
                f"the model cached {held} tokens per layer for a {self.prompt_valid.shape[-1]}-token prompt: it adds "
                "tokens of its own to the cache, which VeriCache's masks and positions do not count. Use stock "
                "generate() for this model."
            )
        missed = [layer.layer_idx for layer in self.tiered if layer.prompt_kv is not None]
        if missed:
            for layer in self.tiered:
                layer.prompt_kv = None
            raise ValueError(
                f"{type(self.compressor).__name__} scores tokens with each layer's queries, but layers {missed} "
                "did not pass theirs through transformers' attention interface, nor return their attention "
                "probabilities. Use a compressor that reads K/V alone (streaming_llm, knorm, kivi, ...) with this "
                "model."
            )
        if 0 < len(self._unbuilt()) < len(self.tiered):
            # a model split between an accelerator and the CPU: the CPU layers deferred, the others compressed; a
            # draft pass needs every layer's draft tier over the same tokens, so the rest are built from the prompt
            self.build_draft_tier()

    @contextmanager
    def capturing(self, capture: QueryCapture | None) -> Iterator[QueryCapture | None]:
        """Hand `capture` to the attention layers of the passes run inside (`pass_kwargs`)."""
        self._capture = capture
        active = ACTIVE_CAPTURE.set(capture)
        try:
            yield capture
        finally:
            ACTIVE_CAPTURE.reset(active)
            self._capture = None

    def pass_kwargs(self) -> dict:
        """What a forward on this cache passes the model besides it: the capture, while one is open, and in a
        verify pass what its attention needs (`verify_attention.VerifyPass`)."""
        kwargs = {CAPTURE_KWARG: self._capture} if self._capture is not None else {}
        if self._verify_pass is not None:
            kwargs[VERIFY_KWARG] = self._verify_pass
        return kwargs

    def _prompt_queries(self, context: CompressionContext) -> None:
        """A prefill layer's queries arrived: compress its prompt K/V now, or hold them for `build_draft_tier`."""
        layer = self.layers[context.layer_idx]
        if self.defers_compression(layer):
            if context.layer_idx == 0 and layer.prompt_kv is not None:
                self.compressor.check_layer(
                    *layer.prompt_kv, context
                )  # a refusal comes before the first token
            layer.prompt_kv = None
            self._held[context.layer_idx] = context.detached()
        else:
            layer.build_from_prompt(context)

    def seed_prefix(self, layers: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Start the full tier with a shared prefix's exact K/V: per layer, its (1, H, n, D) pieces in order, copied
        in once; the prefill that follows passes the rest of the prompt only, at positions P onwards, and its
        `prompt_valid` covers the whole prompt. The compressor must read no more queries than that rest holds
        (`Compressor.queries_read`)."""
        if self.full_valid is not None or self.seeded_tokens:
            raise RuntimeError("seed_prefix comes before the prefill; create a new cache for a new prompt.")
        if len(layers) != len(self.tiered):
            raise ValueError(f"got a prefix of {len(layers)} layers for {len(self.tiered)} layers")
        length = sum(keys.shape[-2] for keys, _ in layers[0])
        for layer, pieces in zip(self.tiered, layers, strict=True):
            layer.full.reserve(length, *pieces[0])
            for keys, values in pieces:
                layer.full.append(keys, values)
        self.seeded_tokens = length

    def adopt_prefix(
        self, drafts: list[DraftStore], length: int, like: torch.Tensor, timeout: float = 60.0
    ) -> None:
        """Start from a stored prefix of `length` tokens instead of a prefill: `drafts` are the layers' draft tiers,
        restored on the device; `like` is a tensor of the K/V's dtype and device. The full tier is left to a loader,
        which appends the prefix to each layer's `full` while drafting runs and reports each layer with
        `layer_loaded`. A verify pass on the CPU may start before the loader is done: each layer waits (up to
        `timeout`) for its own prefix, so the pass runs behind the load; elsewhere verifying waits for
        `full_tier_loaded()`."""
        if self.full_valid is not None:
            raise RuntimeError("adopt_prefix replaces the prefill; create a new cache for a new prompt.")
        if len(drafts) != len(self.tiered):
            raise ValueError(f"got {len(drafts)} draft tiers for {len(self.tiered)} layers")
        for layer, draft in zip(self.tiered, drafts, strict=True):
            layer.draft = draft
            layer.lazy_initialization(like, like)  # the K/V dtype and device, as a prefill sets them
        batch = drafts[0].valid.shape[0]
        self.prompt_valid = self.full_valid = torch.ones((batch, length), dtype=torch.bool)
        self._full_dense, self.full_tier_loading = True, True
        self._layer_ready = [threading.Event() for _ in self.layers]
        self._layer_loaded = [False] * len(self.layers)
        self._load_timeout = timeout

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots held by attention layer `layer_idx`; a recurrent or stateless layer has none, and answers for the
        first attention layer (what transformers asks layer 0 about is the sequence)."""
        if layer_idx >= len(self.layers):
            return 0
        layer = self.layers[layer_idx]
        return (layer if isinstance(layer, VeriCacheLayer) else self.tiered[0]).get_seq_length()

    def rows_changed(self, valid: torch.Tensor) -> None:
        """Rows joined or left between rounds (`rows.py` rewrote each layer's tiers): `valid` (B, T) marks the full
        tier's real slots now."""
        self.prompt_valid = self.full_valid = valid.bool()
        self._full_dense = bool(self.full_valid.all())

    def layer_loaded(self, layer_idx: int) -> None:
        """The loader appended layer `layer_idx`'s whole prefix: a verify pass may read it."""
        self._layer_loaded[layer_idx] = True
        self._layer_ready[layer_idx].set()

    def loading_stopped(self) -> None:
        """The loader ended, done or not: a verify pass waiting on a layer it did not load raises at once."""
        for event in self._layer_ready:
            event.set()

    def await_layer(self, layer_idx: int) -> None:
        started = time.perf_counter()
        self._layer_ready[layer_idx].wait(self._load_timeout)
        self.stats.prefix_wait_seconds += time.perf_counter() - started
        if not self._layer_loaded[layer_idx]:
            raise PrefixNotLoaded(
                f"layer {layer_idx}'s stored prefix did not arrive in {self._load_timeout} s"
            )

    def reads_in_place(self) -> bool:
        """Every layer reads its full tier on the host, in place (known after the first forward)."""
        return all(layer.is_initialized and layer.reads_in_place for layer in self.tiered)

    def full_tier_loaded(self) -> None:
        """The loader `adopt_prefix` left the full tier to is done: verify passes may read it."""
        lengths = {layer.full.length for layer in self.tiered}
        if lengths != {self.full_valid.shape[-1]}:
            raise RuntimeError(
                f"the full tier holds {sorted(lengths)} tokens per layer, the adopted prefix {self.full_valid.shape[-1]}"
            )
        self.full_tier_loading = False

    def defers_compression(self, layer: VeriCacheLayer) -> bool:
        """Whether the prefill leaves this layer's draft tier to `build_draft_tier`: a layer that reads its full
        tier in place compresses the same K/V later at no transfer cost. The first token then does not wait for
        compression (H2O's scoring costs about two more attention passes of the prompt), and a call whose rounds
        are all plain never compresses. A query-aware compressor's queries are held until then (the last
        `queries_read` of them; H2O reads them all, as many floats as the layer input), unless a stored prefix
        seeded the prompt: its queries are the suffix's alone. On an accelerator the prompt's K/V are compressed
        while they are on the device."""
        return layer.reads_in_place and (self.draft_tier_rebuildable or not self.seeded_tokens)

    @property
    def draft_tier_buildable(self) -> bool:
        """Whether `build_draft_tier` can build the draft tier now: from the full tier alone, or with the queries
        held since the prefill (a query-aware build declined once has released them)."""
        return self.draft_tier_rebuildable or all(layer.layer_idx in self._held for layer in self._unbuilt())

    @property
    def draft_tier_held(self) -> bool:
        """False while any layer's draft tier is deferred (see `defers_compression`; on a model split between an
        accelerator and the CPU, only the CPU layers defer) or freed, until `build_draft_tier`."""
        return not self._unbuilt()

    def _unbuilt(self) -> list[VeriCacheLayer]:
        return [layer for layer in self.tiered if layer.draft is None]

    @property
    def draft_tier_rebuildable(self) -> bool:
        """Whether the compressor can build the draft tier from the full tier alone (no prompt queries needed)."""
        return not self.compressor.scores_with_queries

    def free_draft_tier(self) -> None:
        """Drop every layer's draft tier (its device memory) while rounds are plain: commits then write the full
        tier alone, and `build_draft_tier` compresses it anew before the next draft. Only for compressors that
        work from K/V alone; query-aware ones cannot rebuild after the prefill. Its size is recorded first."""
        check_refreshable(self.compressor)
        if self.phase != "idle":
            raise RuntimeError(f"VeriCache cannot free its draft tier while {self.phase}.")
        self.stats.draft_tier_bytes = max(self.stats.draft_tier_bytes, self.draft_tier_bytes())
        for layer in self.tiered:
            layer.draft = None
        self.stats.draft_tier_frees += 1

    def build_draft_tier(
        self, afford: Callable[[float], bool] | None = None, price: float | None = None
    ) -> bool:
        """Compress the full tier into the draft tier, deferred at prefill or freed (its time in compress_seconds).

        `afford`, when given, is asked after the first two layers whether the whole build, priced at the faster
        one's time per layer (the first pays one-off costs: KIVI's took 0.29 s of a 1.2k-token prompt, the next
        a few ms), is worth paying; when not, they are dropped again and nothing more is built (a build can cost
        more than a whole answer's drafting could save: HQQ's takes about a prefill's time on a CPU). Returns
        whether the draft tier was built. `price`, when an earlier build was measured, is asked of `afford` instead,
        before any layer is built. A query-aware compressor builds from the layer inputs held since the prefill
        (`_prompt_queries`), which a build uses up and a refusal releases: its tier is then never built."""
        if not self.draft_tier_buildable:
            raise RuntimeError(
                f"{type(self.compressor).__name__} scores tokens with the prompt's layer inputs, and none are held "
                "(they were used by an earlier build, or released when one was declined): its draft tier cannot be "
                "built again. Rebuilding needs a K/V-only compressor (streaming_llm, knorm, kivi, ...)."
            )
        if afford is not None and price is not None:
            if not afford(price):
                self._held.clear()
                return False
            afford = None  # paid at the price measured before, not priced again
        unbuilt = self._unbuilt()
        if not unbuilt:
            return True
        priced, rest = unbuilt[:2], unbuilt[2:]
        seconds = min(self._build_layer(layer) for layer in priced)
        if afford is not None and not afford(seconds * len(unbuilt)):
            for layer in priced:
                layer.draft = None
            self._held.clear()
            return False
        for layer in rest:
            self._build_layer(layer)
        self._held.clear()
        self.stats.draft_tier_builds += 1
        return True

    def _build_layer(self, layer: VeriCacheLayer) -> float:
        held = self._held.get(layer.layer_idx)
        if held is None:
            return refresh_draft_layer(self, layer)
        return compress_prompt(self, layer, held, self.prompt_valid.shape[-1])

    @contextmanager
    def drafting(self, draft_length: int) -> Iterator[None]:
        """Up to `draft_length` draft steps. The full tier starts streaming in for the verify pass that follows;
        the drafted tokens are rolled back on exit."""
        if not self.draft_tier_held:
            raise RuntimeError(
                "the draft tier is not built (deferred at prefill, or freed); call build_draft_tier() before drafting."
            )
        self.prefetch(room=draft_length + 1)
        self._draft_dense = bool(self.tiered[0].draft.valid.all())
        for layer in self.recurrent:
            layer.save_state()
        try:
            with self._phase("drafting", "idle"):
                yield
        except BaseException:
            self.end_round()
            raise
        finally:
            self._draft_valid = None
            for layer in self.tiered:
                layer.draft.rollback_draft()
            for layer in self.recurrent:
                layer.restore_state()

    def keep_drafted(self, valid: torch.Tensor) -> None:
        """Mask drafted slots a row does not keep. `valid` (B, q) covers the last q drafted slots (a multi-token
        draft pass whose tail a row rejected); slots never marked count as kept. Drafting only."""
        if self.phase != "drafting":
            raise RuntimeError("keep_drafted marks draft slots; call it inside drafting().")
        drafted, query = self.tiered[0].draft.num_drafted, valid.shape[-1]
        marks = self._draft_marks(drafted - query)
        self._draft_valid = torch.cat([marks, valid.to(marks.device, torch.bool)], dim=-1)
        self._draft_dense = self._draft_dense and bool(valid.all())

    def _draft_marks(self, slots: int) -> torch.Tensor:
        """(B, slots) validity of the first `slots` drafted slots."""
        committed = self.tiered[0].draft.valid
        marks = (
            self._draft_valid
            if self._draft_valid is not None
            else committed.new_ones((committed.shape[0], 0))
        )
        unmarked = committed.new_ones((committed.shape[0], slots - marks.shape[-1]))
        return torch.cat([marks[:, :slots], unmarked], dim=-1)

    @contextmanager
    def verifying(self) -> Iterator[None]:
        """One pass over the full tier. On success the pass's tokens wait for `commit`; on error they are dropped
        and the round's transfers cancelled."""
        if self.full_tier_loading and not self.reads_in_place():
            raise RuntimeError(
                "the full tier is still loading a stored prefix; wait for it before verifying."
            )
        if self._round is None or self._stale():
            self.prefetch()
        self._verify_pass = self.verify_pass()
        for layer in self.recurrent:
            layer.record_states()
        try:
            with self._phase("verifying", "idle"):
                yield
            self._check_served()
            self._record_round()
        except BaseException:
            for layer in self.tiered:
                layer.pending = None
            for layer in self.recurrent:
                layer.restore_state()
            raise
        finally:
            self._verify_pass = None
            self.end_round()

    def verify_pass(self) -> VerifyPass:
        """What the coming verify pass hands its attention layers: the kernel for the layers' device, whether every
        row's slots are real (a plain lower-right causal block), and the streamed layers' chunks."""
        device = self.tiered[0].device if self.tiered[0].is_initialized else torch.device("cpu")
        return VerifyPass(
            kernel=resolve_kernel(self.verify_attention, device),
            dense=self._full_dense,
            chunks=self.stream_chunks,
        )

    def _check_served(self) -> None:
        """A streamed layer handed attention only the block's tokens: its attention must have read the chunks."""
        missed = sorted(self._verify_pass.streamed - self._verify_pass.served)
        if missed:
            raise RuntimeError(
                f"the verify pass's attention did not read the full tier of layers {missed}, which arrives in "
                "chunks: run VeriCache passes on vericache_hf.pass_model.pass_model(model), whose attention does."
            )

    def commit(self, count: int, valid: torch.Tensor) -> None:
        """Commit the first `count` tokens of the last verify pass; `valid` (B, count) masks the ones a row rejected."""
        if self.tiered[0].pending is None:
            raise RuntimeError("commit follows a verify pass; there is nothing to commit.")
        for layer in self.tiered:
            layer.commit(count, valid)
        for layer in self.recurrent:
            layer.keep_states(count, valid)
        self.full_valid = torch.cat([self.full_valid, valid.to(self.full_valid.device)], dim=-1)
        self._full_dense = self._full_dense and bool(valid.all())

    def attention_mask(self, query_length: int) -> torch.Tensor | None:
        """(B, slots + query_length) mask over the physical slots of the tier the next pass reads, or None when
        every slot holds a real token: then the pass is causal over physical slots, which transformers builds
        itself, and a one-token pass needs no mask at all (sdpa's fastest path, as in a stock decode step)."""
        if self.phase == "drafting":
            if self._draft_dense:
                return None
            draft = self.tiered[0].draft
            committed = torch.cat([draft.valid, self._draft_marks(draft.num_drafted)], dim=-1)
        else:
            if self._full_dense:
                return None
            committed = self.full_valid
        fresh = committed.new_ones((committed.shape[0], query_length))
        return torch.cat([committed.to(fresh.device), fresh], dim=-1).long()

    def draft_tier_bytes(self) -> int:
        return sum(layer.draft.nbytes() for layer in self.tiered if layer.draft is not None)

    def recurrent_state_bytes(self) -> int:
        return sum(layer.state_bytes() for layer in self.recurrent)

    def full_tier_bytes(self) -> int:
        return sum(layer.full.nbytes() for layer in self.tiered)

    # -- streaming the full tier ---------------------------------------------------------------------------------
    def prefetch(self, room: int = DEFAULT_ROOM) -> None:
        """Queue every staged layer's full tier for the next verify pass, with `room` slots for its new tokens.
        Layers that read their full tier in place need no transfer."""
        if not self.tiered[0].full.length or self.full_tier_loading:
            return
        if self._round is not None and not self._stale():
            return
        self.end_round()
        self._round = {
            layer.layer_idx: self._submit_layer(layer, room)
            for layer in self.tiered
            if not layer.reads_in_place
        }
        self._streamed = {index for index, transfers in self._round.items() if transfers[0].end is not None}
        self.stats.peak_draft_tier_bytes = max(self.stats.peak_draft_tier_bytes, self.draft_tier_bytes())

    def _submit_layer(self, layer: VeriCacheLayer, room: int) -> list[LayerTransfer]:
        """Queue a layer's full tier for the verify pass: whole, with `room` slots after it, when that fits in one
        staging chunk (or no chunk size is set); else as chunks of `staging_chunk_tokens`, each into a buffer of
        that fixed size, which attention merges as they arrive (`verify_attention.streamed_attention`)."""
        chunk, stored = self.staging_chunk_tokens, layer.full.length
        if chunk is None or stored + room <= chunk:
            # a buffer grows with a short layer (a quarter ahead) up to a chunk's size, and stays there
            capacity = None if chunk is None else min(chunk, buffer_tokens(stored + room))
            return [
                self.transfers.submit(
                    layer.full, layer.device, group=self, label=layer.layer_idx, room=room, capacity=capacity
                )
            ]
        return [
            self.transfers.submit(
                layer.full,
                layer.device,
                group=self,
                label=layer.layer_idx,
                span=(start, min(start + chunk, stored)),
                capacity=chunk,
            )
            for start in range(0, stored, chunk)
        ]

    def streams(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s full tier reaches the running verify pass in chunks; the pass is told, so
        that its attention reads them (`VerifyPass.streamed`)."""
        if layer_idx not in self._streamed:
            return False
        if self._verify_pass is not None:
            self._verify_pass.streamed.add(layer_idx)
        return True

    def _layer_transfers(self, layer_idx: int) -> list[LayerTransfer]:
        transfers = self._round.get(layer_idx) if self._round is not None else None
        if not transfers:
            raise RuntimeError(f"layer {layer_idx}'s full tier was not queued for this verify pass.")
        stored = self.layers[layer_idx].full.length
        if transfers[0].tokens != stored:
            raise RuntimeError(
                f"layer {layer_idx}'s full tier changed while its transfer was in flight ({transfers[0].tokens} -> "
                f"{stored} tokens); commit only after the verify pass."
            )
        return transfers

    def _read(self, transfer: LayerTransfer) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for a transfer of this pass; the one read before it has been attended to, so its buffers go back
        to the engine first (so that a single staging buffer can serve the next)."""
        if self._staged:
            self.transfers.release(self._staged[-1])
        self._staged.append(transfer)
        return self.transfers.wait(transfer)

    def staged(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s (B, H, capacity, D) staging buffers, holding its whole full tier, once its transfer
        is done."""
        transfers = self._layer_transfers(layer_idx)
        if layer_idx in self._streamed:
            raise RuntimeError(
                f"layer {layer_idx}'s full tier arrives in chunks: read it with stream_chunks()."
            )
        return self._read(transfers[0])

    def stream_chunks(self, layer_idx: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Layer `layer_idx`'s full tier as (B, H, n, D) chunks on its device, in order, each as its transfer is
        done; each chunk's buffers go back to the engine when the next is asked for."""
        for transfer in self._layer_transfers(layer_idx):
            keys, values = self._read(transfer)
            yield keys[:, :, : transfer.count], values[:, :, : transfer.count]

    def layer_full_tier(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s whole full tier on its device (for a refresh, or a prefill after a seeded prefix,
        which read a layer at once: device memory for it is one layer, briefly, outside the staging buffers,
        which it passes through in chunks)."""
        layer = self.layers[layer_idx]
        if layer.reads_in_place:
            return layer.full.view()
        transfers = (
            self._submit_layer(layer, 0)
            if self.staging_chunk_tokens
            else [self.transfers.submit(layer.full, layer.device, group=self, label=layer_idx)]
        )
        pieces = []
        try:
            for transfer in transfers:
                keys, values = self.transfers.wait(transfer)
                pieces.append((keys[:, :, : transfer.count].clone(), values[:, :, : transfer.count].clone()))
                self.transfers.release(transfer)  # the next chunk may take its buffer
                self.stats.bytes_to_device += transfer.bytes
        finally:  # after an error, those not read yet (a release is a no-op on a released transfer)
            for transfer in transfers:
                self.transfers.release(transfer)
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat([p[0] for p in pieces], dim=2), torch.cat([p[1] for p in pieces], dim=2)

    def end_round(self) -> None:
        """Release (or cancel) the transfers of the current round."""
        for transfers in (self._round or {}).values():
            for transfer in transfers:
                self.transfers.release(transfer)
        self._round, self._staged, self._streamed = None, [], set()

    def close(self) -> None:
        """Drop pending transfers and stop a private engine's worker (the cache stays readable: a later transfer
        starts another)."""
        self.end_round()
        self.transfers.cancel(self)
        if self._owns_transfers:
            self.transfers.stop_worker()
        self._held.clear()

    def _stale(self) -> bool:
        return any(transfers[0].tokens != self.layers[i].full.length for i, transfers in self._round.items())

    def _record_round(self) -> None:
        stats = self.stats
        transfers = [t for layer in (self._round or {}).values() for t in layer]  # none while a prefix loads
        for transfer in transfers:
            self.transfers.settle(transfer)
            stats.chunk_transfers += 1
            stats.bytes_to_device += transfer.bytes
            stats.transfer_seconds += transfer.seconds
            stats.transfer_wait_seconds += transfer.waited
        stats.peak_staging_bytes = max(stats.peak_staging_bytes, self.transfers.buffers.peak_bytes)

    def staging_bytes(self) -> int:
        """Device bytes of the full tier now: its staging buffers."""
        return self.transfers.buffers.device_bytes()
