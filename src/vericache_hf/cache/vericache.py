"""`VeriCache`: a transformers `Cache` whose layers pair a draft tier (compressed, on device) with a full tier (exact,
on the host), driven through explicit phases. Each phase is a context manager that owns its setup and undoes it on
exit, error included; nothing outside this class writes the phase.

- `prefilling(model, valid)`: the prompt's exact K/V go to the full tier and the compressor builds the draft tier
  from them (with each layer's queries, for compressors that score with them), or, on a layer that reads
  its full tier in place, leaves that to `draft_tier.build` when drafting starts (holding the queries a
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

The cache owns one of each of its helpers, and drives them from its phases:
- `stream` (`FullTierStream`, `streaming.py`): the full tier's transfers to the device for each verify pass;
- `prefix_load` (`PrefixLoad`, `prefix_load.py`): a stored prefix reaching the full tier outside a prefill;
- `draft_tier` (`DraftTierLifecycle`, `draft_lifecycle.py`): when the draft tier is built, freed and refreshed.
Its layers (`layers.py`) ask it for the phase, and those helpers for what a phase reads. A sliding-window or chunked
layer of a model that has full-attention layers too is a `WindowLayer` (`window.py`): one exact tier on the device,
which draft and verify passes both read; a hybrid model's recurrent layers keep one state (`recurrent.py`).

Every length this cache reports is *physical* (slots held), which is what transformers' mask code works in. Rows may
hold masked slots (left padding, or tokens another row accepted that this row did not), so the loop always passes
explicit `position_ids`, and the 2-D `attention_mask` built by `attention_mask()` (None while a tier has no masked
slot, as a stock decode step passes none).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache

from ..attention import ACTIVE_CAPTURE, CAPTURE_KWARG
from ..checks import check_int
from ..stats import VeriCacheStats
from ..timeline import Timeline
from ..verify_attention import VERIFY_KWARG, VerifyPass, resolve_kernel
from ..window_mask import WINDOW_DROPPED
from .capture import QueryCapture
from .compressor import Compressor
from .draft_lifecycle import DraftTierLifecycle
from .draft_tier import DraftStore
from .layers import EmptyLayer, PairedLayer, VeriCacheLayer, draft_tier_bytes
from .prefix_load import PrefixLoad
from .recurrent import RecurrentLayer
from .refresh import RefreshPolicy
from .streaming import FullTierStream
from .transfer import TransferEngine
from .window import WindowLayer, first_needed


class VeriCache(Cache):
    """Two-tier cache for draft-then-verify decoding. Build one per request.

    `chunk_tokens` is the granule the host full tier grows by; `staging_buffers` is how many pieces of the full tier
    may be on an accelerator at once, each a layer that fits in `staging_chunk_tokens` or one chunk of that many
    tokens of a longer layer (None: whole layers, however long); `verify_attention` is the verify pass's kernel
    (`verify_attention.KERNELS`); `transfer_timeout` bounds every wait on a transfer; `stage_on_cpu` copies the full
    tier through the staging buffers even when a layer's device is the CPU, where by default it is read in place.
    `windowed` maps the layers that keep one exact tier (`window.py`) to their window, in chunks of it where
    `chunked` (Llama 4's chunked attention). `verify_window` is the window of a model whose every attention layer
    slides by it: its verify passes read only the full tier's tail that a row's window reaches. Pass a shared
    `transfers` engine to serve several caches through one queue (its own buffer count, timeout and link then
    apply); `link_bytes_per_s` emulates a slower link for a private one (benchmarks only), and its copies are
    recorded in `timeline` when one is given.
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
        windowed: dict[int, int] | None = None,
        chunked: bool = False,
        verify_window: int | None = None,
    ) -> None:
        if staging_chunk_tokens is not None:
            check_int("staging_chunk_tokens", staging_chunk_tokens)
        resolve_kernel(verify_attention, torch.device("cpu"))  # checks the name
        self.verify_attention = verify_attention
        self.compressor = compressor
        self.draft_tier = DraftTierLifecycle(self, refresh_policy)
        self.chunk_tokens = chunk_tokens
        self.stage_on_cpu = stage_on_cpu
        self.stats = stats if stats is not None else VeriCacheStats()
        self.phase = "idle"
        self.prompt_valid: torch.Tensor | None = None
        self.full_valid: torch.Tensor | None = None
        self._capture: QueryCapture | None = None
        self.running_pass: VerifyPass | None = None  # what the verify pass in progress hands its attention
        self._draft_valid: torch.Tensor | None = None  # (B, drafted slots marked by `keep_drafted`)
        # no masked slot in the tier (no padding, nothing a row rejected): passes need no explicit mask
        self._full_dense = self._draft_dense = False
        self.prefix_load = PrefixLoad(self)
        recurrent, paired, stateless = recurrent or {}, paired or set(), stateless or set()
        windowed = windowed or {}
        if len(set(windowed.values())) > 1:
            raise ValueError(
                f"window layers share one 2-D mask, so one window size; got {sorted(set(windowed.values()))}"
            )
        self._pass_query = (
            0  # the running pass's query length, which places the window layers' part of its mask
        )
        super().__init__(
            layers=[
                WindowLayer(i, windowed[i], self, chunked)
                if i in windowed
                else PairedLayer(i, self, recurrent[i])
                if i in paired
                else RecurrentLayer(i, recurrent[i])
                if i in recurrent
                else EmptyLayer()
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
        #: the sliding-window or chunked layers of a model that has full-attention layers too: one exact tier, on the
        #: device
        self.windowed: list[WindowLayer] = [layer for layer in self.layers if isinstance(layer, WindowLayer)]
        self.chunked = chunked and bool(self.windowed)
        self.verify_window = verify_window
        #: the first full-tier slot the running verify pass reads (`_verify_start`)
        self.verify_start = 0
        self.stream = FullTierStream(
            self.tiered,
            self.stats,
            transfers
            if transfers is not None
            else TransferEngine(staging_buffers, transfer_timeout, link_bytes_per_s, timeline=timeline),
            owns_transfers=transfers is None,
            staging_chunk_tokens=staging_chunk_tokens,
            prefix_load=self.prefix_load,
        )

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
                on_layer=self.draft_tier.prompt_queries,
            )
            if self.compressor.scores_with_queries
            else None
        )
        with self._phase("prefilling", "idle"), self.capturing(capture):
            yield
        held = sorted({layer.full.length for layer in self.tiered if layer.is_initialized})
        if held and held != [self.prompt_valid.shape[-1]] and not self.prefix_load.loading:
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
        if 0 < len(self.draft_tier.unbuilt()) < len(self.tiered):
            # a model split between an accelerator and the CPU: the CPU layers deferred, the others compressed; a
            # draft pass needs every layer's draft tier over the same tokens, so the rest are built from the prompt
            self.draft_tier.build()

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
        if self.running_pass is not None:
            kwargs[VERIFY_KWARG] = self.running_pass
        return kwargs

    def adopt_prefix(
        self, drafts: list[DraftStore], length: int, like: torch.Tensor, timeout: float = 60.0
    ) -> None:
        """Start from a stored prefix of `length` tokens instead of a prefill: `drafts` are the layers' draft tiers,
        restored on the device; `like` is a tensor of the K/V's dtype and device. The full tier is left to a loader,
        which appends the prefix to each layer's `full` while drafting runs and reports each layer to
        `prefix_load`. A verify pass on the CPU may start before the loader is done: each layer waits (up to
        `timeout`) for its own prefix, so the pass runs behind the load; elsewhere verifying waits for
        `prefix_load.finish()`."""
        if self.full_valid is not None:
            raise RuntimeError("adopt_prefix replaces the prefill; create a new cache for a new prompt.")
        if len(drafts) != len(self.tiered):
            raise ValueError(f"got {len(drafts)} draft tiers for {len(self.tiered)} layers")
        for layer, draft in zip(self.tiered, drafts, strict=True):
            layer.draft = draft
            layer.lazy_initialization(like, like)  # the K/V dtype and device, as a prefill sets them
        batch = drafts[0].valid.shape[0]
        self.prompt_valid = self.full_valid = torch.ones((batch, length), dtype=torch.bool)
        self._full_dense = True
        self.prefix_load.start(timeout)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots held by attention layer `layer_idx`; a recurrent or stateless layer has none, and answers for the
        first attention layer (what transformers asks layer 0 about is the sequence)."""
        if layer_idx >= len(self.layers):
            return 0
        layer = self.layers[layer_idx]
        return (layer if isinstance(layer, VeriCacheLayer) else self.tiered[0]).get_seq_length()

    def get_query_offset(self, layer_idx: int = 0) -> int:
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if isinstance(layer, WindowLayer):
            return layer.query_offset()
        return self.get_seq_length(layer_idx)

    def window_start(self, held: int) -> int:
        """Where a window layer holding `held` committed slots begins in the running pass's 2-D mask: at the tail
        of the full tier's layout in a verify pass; after the draft tier's layout, which the full-attention layers
        read, in a draft pass (`attention_mask`)."""
        if self.phase == "drafting":
            draft = self.tiered[0].draft
            return draft.num_committed + draft.num_drafted + self._pass_query
        if self.phase == "verifying":
            return self.full_valid.shape[-1] - held
        return 0

    def rows_changed(self, valid: torch.Tensor) -> None:
        """Rows joined or left between rounds (`rows.py` rewrote each layer's tiers): `valid` (B, T) marks the full
        tier's real slots now."""
        self.prompt_valid = self.full_valid = valid.bool()
        self._full_dense = bool(self.full_valid.all())

    def reads_in_place(self) -> bool:
        """Every layer reads its full tier on the host, in place (known after the first forward)."""
        return all(layer.is_initialized and layer.reads_in_place for layer in self.tiered)

    @contextmanager
    def drafting(self, draft_length: int) -> Iterator[None]:
        """Up to `draft_length` draft steps. The full tier starts streaming in for the verify pass that follows;
        the drafted tokens are rolled back on exit."""
        if not self.draft_tier.held:
            raise RuntimeError(
                "the draft tier is not built (deferred at prefill, or freed); call draft_tier.build() before drafting."
            )
        self.stream.prefetch(room=draft_length + 1)
        self._draft_dense = bool(self.tiered[0].draft.valid.all())
        for layer in self.recurrent:
            layer.save_state()
        # a draft pass places the chunked windows after the draft tier's layout: their masks count chunks from here
        dropped = WINDOW_DROPPED.set(self.windowed[0].dropped if self.chunked else None)
        try:
            with self._phase("drafting", "idle"):
                yield
        except BaseException:
            self.stream.end_round()
            raise
        finally:
            WINDOW_DROPPED.reset(dropped)
            self._draft_valid = None
            for layer in self.tiered:
                layer.draft.rollback_draft()
            for layer in self.windowed:
                layer.rollback()
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
        if self.prefix_load.loading and not self.reads_in_place():
            raise RuntimeError(
                "the full tier is still loading a stored prefix; wait for it before verifying."
            )
        self.stream.prefetch()  # unless drafting queued a round that still matches the full tier
        self.running_pass = self.verify_pass()
        self.verify_start = self._verify_start()
        for layer in self.recurrent:
            layer.record_states()
        try:
            with self._phase("verifying", "idle"):
                yield
            self._check_served()
            self.stream.record_round()
        except BaseException:
            for layer in self.tiered:
                layer.pending = None
            for layer in self.windowed:
                layer.rollback()
            for layer in self.recurrent:
                layer.restore_state()
            raise
        finally:
            self.running_pass = None
            self.verify_start = 0
            self.stream.end_round()

    def _verify_start(self) -> int:
        """The first full-tier slot a verify pass reads: for a model whose every layer slides by one window, the
        first slot that some row's last `window` real tokens reach (no query of the pass reaches further back), so
        its attention reads a window's slots however long the context; 0 for any other model, while a stored
        prefix loads, and where a layer's full tier arrives in chunks (its attention reads every chunk)."""
        window = self.verify_window
        if (
            window is None
            or self.prefix_load.loading
            or any(self.stream.streams(layer.layer_idx) for layer in self.tiered)
        ):
            return 0
        return first_needed(self.full_valid, window)

    def verify_pass(self) -> VerifyPass:
        """What the coming verify pass hands its attention layers: the kernel for the layers' device, whether every
        row's slots are real (a plain lower-right causal block), and the streamed layers' chunks."""
        device = self.tiered[0].device if self.tiered[0].is_initialized else torch.device("cpu")
        return VerifyPass(
            kernel=resolve_kernel(self.verify_attention, device),
            dense=self._full_dense,
            chunks=self.stream.stream_chunks,
            windowed=frozenset(layer.layer_idx for layer in self.windowed),
        )

    def _check_served(self) -> None:
        """A streamed layer handed attention only the block's tokens: its attention must have read the chunks."""
        missed = sorted(self.running_pass.streamed - self.running_pass.served)
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
        for layer in self.windowed:
            layer.commit(count, valid)
        if self.windowed:  # every window layer holds the same slots: where to cut is found once
            first = self.windowed[0].first_needed()
            for layer in self.windowed:
                layer.trim(first=first)
        for layer in self.recurrent:
            layer.keep_states(count, valid)
        self.full_valid = torch.cat([self.full_valid, valid.to(self.full_valid.device)], dim=-1)
        self._full_dense = self._full_dense and bool(valid.all())

    def attention_mask(self, query_length: int) -> torch.Tensor | None:
        """(B, slots + query_length) mask over the physical slots of the tier the next pass reads, or None when
        every slot holds a real token: then the pass is causal over physical slots, which transformers builds
        itself, and a one-token pass needs no mask at all (sdpa's fastest path, as in a stock decode step). A draft
        pass of a model with window layers reads two layouts, the draft tier's and the windows' (`window.py`): the
        mask holds both, one after the other, and each kind of layer sizes its own part (`get_mask_sizes`)."""
        self._pass_query = query_length
        if self.phase == "drafting":
            draft = self.tiered[0].draft
            marks = self._draft_marks(draft.num_drafted)
            window = self.windowed[0].valid if self.windowed else None
            # a chunked window's mask counts positions from its mask (`window_mask.py`): it always gets one
            if self._draft_dense and (window is None or (not self.chunked and bool(window.all()))):
                return None
            committed = torch.cat([draft.valid, marks], dim=-1)
            if window is not None:
                fresh = committed.new_ones((committed.shape[0], query_length))
                parts = [committed, fresh, window, marks]
                committed = torch.cat([part.to(fresh.device) for part in parts], dim=-1)
        else:
            if self._full_dense:
                return None
            committed = self.full_valid
        fresh = committed.new_ones((committed.shape[0], query_length))
        return torch.cat([committed.to(fresh.device), fresh], dim=-1).long()

    def draft_tier_bytes(self) -> int:
        return draft_tier_bytes(self.tiered)

    def window_tier_bytes(self) -> int:
        return sum(layer.nbytes() for layer in self.windowed)

    def recurrent_state_bytes(self) -> int:
        return sum(layer.state_bytes() for layer in self.recurrent)

    def full_tier_bytes(self) -> int:
        return sum(layer.full.nbytes() for layer in self.tiered)

    def close(self) -> None:
        """Drop pending transfers and stop a private engine's worker (the cache stays readable: a later transfer
        starts another)."""
        self.stream.close()
        self.draft_tier.prompt_inputs.clear()
