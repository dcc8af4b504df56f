"""`VeriCache`: a transformers `Cache` whose layers pair a draft tier (compressed, on device) with a full tier (exact,
on the host), driven through explicit phases. Each phase is a context manager that owns its setup and undoes it on
exit, error included; nothing outside this class writes the phase.

- `prefilling(model, valid)`: the prompt's exact K/V go to the full tier and the compressor builds the draft tier
  from them (with each layer's input captured, for compressors that score with queries), or, on a layer that reads
  its full tier in place, leaves that to `build_draft_tier` when drafting starts (holding the layer inputs a
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
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..stats import VeriCacheStats
from ..timeline import Timeline
from .capture import LayerInputCapture
from .compressor import CompressionContext, Compressor
from .draft_tier import DraftStore
from .full_tier import HostKVStore
from .refresh import RefreshPolicy, check_refreshable, compress_prompt, refresh_draft_layer
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
        captured = owner.captured(self.layer_idx)
        if owner.defers_compression(self):
            # `build_draft_tier` compresses these very K/V (with the held input) when drafting needs them
            if captured is not None:
                owner.hold_layer_input(captured)
            return keys, values
        context = captured or CompressionContext(self.layer_idx, owner.prompt_valid)
        started = time.perf_counter()
        self.draft = owner.compressor.compress(keys, values, context)
        owner.stats.compress_seconds += time.perf_counter() - started
        return keys, values

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


class VeriCache(Cache):
    """Two-tier cache for draft-then-verify decoding. Build one per request.

    `chunk_tokens` is the granule the host full tier grows by; `staging_buffers` is how many layers of the full tier
    may be on an accelerator at once; `transfer_timeout` bounds every wait on a transfer; `stage_on_cpu` copies the
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
    ) -> None:
        if refresh_policy is not None:
            check_refreshable(compressor)
        self.refresh_policy = refresh_policy
        self.compressor = compressor
        self.chunk_tokens = chunk_tokens
        self.stage_on_cpu = stage_on_cpu
        self.stats = stats if stats is not None else VeriCacheStats()
        self.transfers = (
            transfers
            if transfers is not None
            else TransferEngine(staging_buffers, transfer_timeout, link_bytes_per_s, timeline=timeline)
        )
        self.phase = "idle"
        self.prompt_valid: torch.Tensor | None = None
        self.full_valid: torch.Tensor | None = None
        self._capture: LayerInputCapture | None = None
        self._held: dict[int, CompressionContext] = {}  # layer inputs a deferred query-aware build reads
        self._round: dict[int, LayerTransfer] | None = None  # the next verify pass's transfers, by layer
        self._staged: list[LayerTransfer] = []  # transfers the running verify pass has read
        self._draft_valid: torch.Tensor | None = None  # (B, drafted slots marked by `keep_drafted`)
        # no masked slot in the tier (no padding, nothing a row rejected): passes need no explicit mask
        self._full_dense = self._draft_dense = False
        self.full_tier_loading = False  # a stored prefix is being appended to the full tier by a loader
        self.seeded_tokens = 0  # leading prompt tokens whose K/V `seed_prefix` put in the full tier
        self._layer_ready: list[threading.Event] = []
        self._layer_loaded: list[bool] = []
        self._load_timeout = 60.0
        super().__init__(layers=[VeriCacheLayer(i, self) for i in range(num_layers)])

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
            LayerInputCapture(model, self, self.prompt_valid)
            if self.compressor.needs_hidden_states
            else nullcontext()
        )
        with self._phase("prefilling", "idle"), capture as self._capture:
            try:
                yield
            finally:
                self._capture = None
        if 0 < len(self._unbuilt()) < len(self.layers):
            # a model split between an accelerator and the CPU: the CPU layers deferred, the others compressed; a
            # draft pass needs every layer's draft tier over the same tokens, so the rest are built from the prompt
            self.build_draft_tier()

    def seed_prefix(self, layers: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Start the full tier with a shared prefix's exact K/V: per layer, its (1, H, n, D) pieces in order, copied
        in once; the prefill that follows passes the rest of the prompt only, at positions P onwards, and its
        `prompt_valid` covers the whole prompt. The compressor must read no more queries than that rest holds
        (`Compressor.queries_read`)."""
        if self.full_valid is not None or self.seeded_tokens:
            raise RuntimeError("seed_prefix comes before the prefill; create a new cache for a new prompt.")
        if len(layers) != len(self.layers):
            raise ValueError(f"got a prefix of {len(layers)} layers for {len(self.layers)} layers")
        length = sum(keys.shape[-2] for keys, _ in layers[0])
        for layer, pieces in zip(self.layers, layers, strict=True):
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
        if len(drafts) != len(self.layers):
            raise ValueError(f"got {len(drafts)} draft tiers for {len(self.layers)} layers")
        for layer, draft in zip(self.layers, drafts, strict=True):
            layer.draft = draft
            layer.lazy_initialization(like, like)  # the K/V dtype and device, as a prefill sets them
        batch = drafts[0].valid.shape[0]
        self.prompt_valid = self.full_valid = torch.ones((batch, length), dtype=torch.bool)
        self._full_dense, self.full_tier_loading = True, True
        self._layer_ready = [threading.Event() for _ in self.layers]
        self._layer_loaded = [False] * len(self.layers)
        self._load_timeout = timeout

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
        return all(layer.is_initialized and layer.reads_in_place for layer in self.layers)

    def full_tier_loaded(self) -> None:
        """The loader `adopt_prefix` left the full tier to is done: verify passes may read it."""
        lengths = {layer.full.length for layer in self.layers}
        if lengths != {self.full_valid.shape[-1]}:
            raise RuntimeError(
                f"the full tier holds {sorted(lengths)} tokens per layer, the adopted prefix {self.full_valid.shape[-1]}"
            )
        self.full_tier_loading = False

    def captured(self, layer_idx: int) -> CompressionContext | None:
        """The layer input captured in this prefill, if the compressor asked for it."""
        return self._capture.pop(layer_idx) if self._capture is not None else None

    def defers_compression(self, layer: VeriCacheLayer) -> bool:
        """Whether the prefill leaves this layer's draft tier to `build_draft_tier`: a layer that reads its full
        tier in place compresses the same K/V later at no transfer cost. The first token then does not wait for
        compression (H2O's scoring costs about two more attention passes of the prompt), and a call whose rounds
        are all plain never compresses. A query-aware compressor's layer inputs are held until then (the last
        `queries_read` of them), unless a stored prefix seeded the prompt: its queries are the suffix's alone. On
        an accelerator the prompt's K/V are compressed in the prefill, while they are on the device."""
        return layer.reads_in_place and (self.draft_tier_rebuildable or not self.seeded_tokens)

    def hold_layer_input(self, context: CompressionContext) -> None:
        """Keep a deferred layer's captured input for `build_draft_tier`: its last `queries_read` positions, or all
        of them (H2O reads every prompt query: hidden size / (2 x K/V width) times the full tier, 1.5x for
        SmolLM2-135M, held until the build is paid or declined, or the call ends)."""
        window = self.compressor.queries_read
        if window is not None and window < context.hidden_states.shape[1]:
            context = context.at_positions(slice(-window, None))
            # a copy: a view would keep the whole (B, T, hidden) input alive
            context = replace(context, hidden_states=context.hidden_states.clone())
        self._held[context.layer_idx] = context

    @property
    def draft_tier_buildable(self) -> bool:
        """Whether `build_draft_tier` can build the draft tier now: from the full tier alone, or with the layer
        inputs held since the prefill (a query-aware build declined once has released them)."""
        return self.draft_tier_rebuildable or all(layer.layer_idx in self._held for layer in self._unbuilt())

    @property
    def draft_tier_held(self) -> bool:
        """False while any layer's draft tier is deferred (see `defers_compression`; on a model split between an
        accelerator and the CPU, only the CPU layers defer) or freed, until `build_draft_tier`."""
        return not self._unbuilt()

    def _unbuilt(self) -> list[VeriCacheLayer]:
        return [layer for layer in self.layers if layer.draft is None]

    @property
    def draft_tier_rebuildable(self) -> bool:
        """Whether the compressor can build the draft tier from the full tier alone (no prompt queries needed)."""
        return not self.compressor.needs_hidden_states

    def free_draft_tier(self) -> None:
        """Drop every layer's draft tier (its device memory) while rounds are plain: commits then write the full
        tier alone, and `build_draft_tier` compresses it anew before the next draft. Only for compressors that
        work from K/V alone; query-aware ones cannot rebuild after the prefill. Its size is recorded first."""
        check_refreshable(self.compressor)
        if self.phase != "idle":
            raise RuntimeError(f"VeriCache cannot free its draft tier while {self.phase}.")
        self.stats.draft_tier_bytes = max(self.stats.draft_tier_bytes, self.draft_tier_bytes())
        for layer in self.layers:
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
        (`hold_layer_input`), which a build uses up and a refusal releases: its tier is then never built."""
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
        self._draft_dense = bool(self.layers[0].draft.valid.all())
        try:
            with self._phase("drafting", "idle"):
                yield
        except BaseException:
            self.end_round()
            raise
        finally:
            self._draft_valid = None
            for layer in self.layers:
                layer.draft.rollback_draft()

    def keep_drafted(self, valid: torch.Tensor) -> None:
        """Mask drafted slots a row does not keep. `valid` (B, q) covers the last q drafted slots (a multi-token
        draft pass whose tail a row rejected); slots never marked count as kept. Drafting only."""
        if self.phase != "drafting":
            raise RuntimeError("keep_drafted marks draft slots; call it inside drafting().")
        drafted, query = self.layers[0].draft.num_drafted, valid.shape[-1]
        marks = self._draft_marks(drafted - query)
        self._draft_valid = torch.cat([marks, valid.to(marks.device, torch.bool)], dim=-1)
        self._draft_dense = self._draft_dense and bool(valid.all())

    def _draft_marks(self, slots: int) -> torch.Tensor:
        """(B, slots) validity of the first `slots` drafted slots."""
        committed = self.layers[0].draft.valid
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
        try:
            with self._phase("verifying", "idle"):
                yield
            self._record_round()
        except BaseException:
            for layer in self.layers:
                layer.pending = None
            raise
        finally:
            self.end_round()

    def commit(self, count: int, valid: torch.Tensor) -> None:
        """Commit the first `count` tokens of the last verify pass; `valid` (B, count) masks the ones a row rejected."""
        if self.layers[0].pending is None:
            raise RuntimeError("commit follows a verify pass; there is nothing to commit.")
        for layer in self.layers:
            layer.commit(count, valid)
        self.full_valid = torch.cat([self.full_valid, valid.to(self.full_valid.device)], dim=-1)
        self._full_dense = self._full_dense and bool(valid.all())

    def attention_mask(self, query_length: int) -> torch.Tensor | None:
        """(B, slots + query_length) mask over the physical slots of the tier the next pass reads, or None when
        every slot holds a real token: then the pass is causal over physical slots, which transformers builds
        itself, and a one-token pass needs no mask at all (sdpa's fastest path, as in a stock decode step)."""
        if self.phase == "drafting":
            if self._draft_dense:
                return None
            draft = self.layers[0].draft
            committed = torch.cat([draft.valid, self._draft_marks(draft.num_drafted)], dim=-1)
        else:
            if self._full_dense:
                return None
            committed = self.full_valid
        fresh = committed.new_ones((committed.shape[0], query_length))
        return torch.cat([committed.to(fresh.device), fresh], dim=-1).long()

    def draft_tier_bytes(self) -> int:
        return sum(layer.draft.nbytes() for layer in self.layers if layer.draft is not None)

    def full_tier_bytes(self) -> int:
        return sum(layer.full.nbytes() for layer in self.layers)

    # -- streaming the full tier ---------------------------------------------------------------------------------
    def prefetch(self, room: int = DEFAULT_ROOM) -> None:
        """Queue every staged layer's full tier for the next verify pass, with `room` slots for its new tokens.
        Layers that read their full tier in place need no transfer."""
        if not self.layers[0].full.length or self.full_tier_loading:
            return
        if self._round is not None and not self._stale():
            return
        self.end_round()
        self._round = {
            layer.layer_idx: self.transfers.submit(
                layer.full, layer.device, group=self, label=layer.layer_idx, room=room
            )
            for layer in self.layers
            if not layer.reads_in_place
        }
        self.stats.peak_draft_tier_bytes = max(self.stats.peak_draft_tier_bytes, self.draft_tier_bytes())

    def staged(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s (B, H, capacity, D) staging buffers, holding its full tier, once its transfer is
        done. The layer read before it has been attended to, so its buffers go back to the engine."""
        transfer = self._round.get(layer_idx) if self._round is not None else None
        if transfer is None:
            raise RuntimeError(f"layer {layer_idx}'s full tier was not queued for this verify pass.")
        stored = self.layers[layer_idx].full.length
        if transfer.tokens != stored:
            raise RuntimeError(
                f"layer {layer_idx}'s full tier changed while its transfer was in flight ({transfer.tokens} -> "
                f"{stored} tokens); commit only after the verify pass."
            )
        if self._staged:  # first, so that a single staging buffer can serve the next layer
            self.transfers.release(self._staged[-1])
        self._staged.append(transfer)
        return self.transfers.wait(transfer)

    def layer_full_tier(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s whole full tier on its device (for a refresh, which compresses a layer at once:
        device memory for it is one layer, briefly)."""
        layer = self.layers[layer_idx]
        if layer.reads_in_place:
            return layer.full.view()
        transfer = self.transfers.submit(layer.full, layer.device, group=self, label=layer_idx)
        try:
            keys, values = self.transfers.wait(transfer)
            keys, values = keys[:, :, : transfer.tokens].clone(), values[:, :, : transfer.tokens].clone()
        finally:
            self.transfers.release(transfer)
        self.stats.bytes_to_device += transfer.bytes
        return keys, values

    def end_round(self) -> None:
        """Release (or cancel) the transfers of the current round."""
        for transfer in (self._round or {}).values():
            self.transfers.release(transfer)
        self._round, self._staged = None, []

    def close(self) -> None:
        """Drop pending transfers (the cache stays readable); a private engine's worker then exits."""
        self.end_round()
        self.transfers.cancel(self)
        self._held.clear()

    def _stale(self) -> bool:
        return any(transfer.tokens != self.layers[i].full.length for i, transfer in self._round.items())

    def _record_round(self) -> None:
        stats = self.stats
        for transfer in (self._round or {}).values():  # none while a stored prefix loads in place
            self.transfers.settle(transfer)
            stats.chunk_transfers += 1
            stats.bytes_to_device += transfer.bytes
            stats.transfer_seconds += transfer.seconds
            stats.transfer_wait_seconds += transfer.waited
        stats.peak_staging_bytes = max(stats.peak_staging_bytes, self.transfers.buffers.peak_bytes)

    def staging_bytes(self) -> int:
        """Device bytes of the full tier now: its staging buffers."""
        return self.transfers.buffers.device_bytes()
