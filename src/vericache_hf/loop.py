"""The VeriCache decoding loop: prefill -> (draft -> verify -> accept -> commit) until every row stops.

Invariant between rounds: both tiers hold every committed token except each row's last one (`pending`), which is
the first input of the next round. A round drafts k tokens on the draft tier, verifies [pending + k drafts] in one
forward pass on the full tier, emits the accepted drafts plus the verifier's bonus token, and commits the exact K/V
of [pending + accepted drafts] to both tiers. Greedy rounds keep drafts equal to the verifier's argmax; sampling
rounds use speculative sampling, so either way the output is distributed as stock `generate`'s.

The loop never sets the cache's state: each pass runs inside the cache phase it belongs to (`cache.prefilling`,
`cache.drafting`, `cache.verifying`), which routes the pass's K/V to the right tier and undoes its setup on exit.

Read it bottom up: `decode` runs `begin` (the prompt), then `run_round`s of `draft_round` -> `verify_round` ->
`emit` -> `record_round` -> `commit_round` -> the schedule's `observe`, each round's state in one `Round` and the
call's state between rounds in one `Decoding` (which a cohort of requests shares, see `serving/cohort.py`); the
passes they run (`draft`, `verify`) and the accept rules (`accept`, in `accept.py`) sit above them. What every pass shares
(the rows' buffers, the call's io, `forward`) is in `passes.py`; drafting with a proposer in `drafting/proposed.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from .accept import accept_uniformly, choose, greedy_accept, speculative_accept
from .cache.capture import QueryCapture
from .cache.prefix_load import PrefixNotLoaded
from .cache.refresh import rescore_draft_tier, rescores
from .cache.vericache import VeriCache
from .compat import cache_kwargs
from .drafting.proposed import draft_with_proposals, propose_to_full_tier
from .passes import DecodeIO, Sequences, emit, forward, process
from .prefix.reuse import PrefixReuse
from .schedule.draft_length import DraftLengthSchedule
from .schedule.proposal_length import bounding_rows, call_run
from .stats import VeriCacheStats


def prefill(model, cache: VeriCache, input_ids, attention_mask, position_ids, io: DecodeIO, seqs: Sequences):
    """Run the prompt once on the full tier (the compressor builds the draft tier as each layer's K/V arrive);
    emit the first token. Returns the (B,) pending tokens and their positions."""
    prompt_valid = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    shared = io.shared
    if shared is not None and not shares_prefix(cache, input_ids, prompt_valid, position_ids):
        shared = None
    seeded = shared.seed(cache, input_ids, cache.compressor.queries_read) if shared is not None else 0
    if seeded:  # the prompt's first `seeded` tokens' K/V are in the full tier: the pass computes the rest
        cache.stats.prefix_tokens_reused += seeded
        attention_mask = None
        position_ids = torch.arange(seeded, input_ids.shape[-1], device=input_ids.device)[None]
    with cache.prefilling(model, prompt_valid):
        outputs = model(
            input_ids=input_ids[:, seeded:],
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwargs(model, cache),
            use_cache=True,
            logits_to_keep=1,
            **io.prompt_inputs,
        )
    raw = outputs.logits[:, -1].float()
    scores = process(io, seqs, input_ids[:, :0], raw)
    first = choose(scores, io.do_sample)
    for row in range(input_ids.shape[0]):
        emit(io, seqs, row, first[row], scores[row], raw[row])
    seqs.starts = prompt_valid.long().argmax(dim=-1).tolist()
    if shared is not None:
        shared.keep(cache, input_ids)
    # a model that counts positions from its cache's length counts each row's padding too, as stock generate does
    if io.positions_from_cache:
        return first, torch.full_like(first, input_ids.shape[-1])
    return first, prompt_valid.long().sum(dim=-1)


def shares_prefix(cache: VeriCache, input_ids, prompt_valid, position_ids) -> bool:
    """Whether a prefill may start from a shared prefix, and keep its prompt's: one unpadded prompt at positions
    0, 1, ..., and a compressor that reads at most a suffix's queries (see `Compressor.queries_read`)."""
    return (
        input_ids.shape[0] == 1
        and bool(prompt_valid.all())
        and (
            position_ids is None
            or bool((position_ids == torch.arange(input_ids.shape[-1]).to(position_ids)).all())
        )
        and cache.compressor.queries_read is not None
    )


def prefill_prefix(model, cache: VeriCache, prefix: torch.Tensor) -> None:
    """Prefill a (1, P) prefix alone (both tiers), to save it: its logits are not needed."""
    with cache.prefilling(model, torch.ones_like(prefix)):
        model(
            input_ids=prefix,
            position_ids=torch.arange(prefix.shape[-1], device=prefix.device)[None],
            **cache_kwargs(model, cache),
            use_cache=True,
            logits_to_keep=1,
        )


def start_from_prefix(model, cache: VeriCache, input_ids, reuse: PrefixReuse, boundary: int, seqs: Sequences):
    """The prompt's first `boundary` tokens from the store (compressed tier now, full tier loading behind) or, on a
    miss, prefilled alone and queued for saving. The rest of the prompt (the suffix) becomes the first round's
    pending block: drafted from on the draft tier, and prefilled exactly by the first verify pass. Returns that
    (1, s) block and its (1,) start position."""
    prefix = input_ids[:, :boundary]
    if not reuse.restore(cache, prefix):
        prefill_prefix(model, cache, prefix)
        reuse.save(cache, prefix)
    seqs.starts = [0] * input_ids.shape[0]
    return input_ids[:, boundary:], torch.full((input_ids.shape[0],), boundary, device=input_ids.device)


def draft(
    model,
    cache: VeriCache,
    pending,
    positions,
    k: int,
    io: DecodeIO,
    seqs: Sequences,
    more: Callable[[float, int, int], bool] | None = None,
    most: int = 0,
):
    """k steps on the draft tier (then more, up to `most`, while `more(first_pass_seconds, width, drafted)` says
    so: the full tier is still loading), choosing from the processed draft distribution as stock `generate` would;
    returns (B, k) drafted tokens and, when sampling, their (B, k, V) draft probabilities. `pending` is (B,) tokens,
    or a (B, s) block whose last position gives the first draft (a prompt's suffix after a stored prefix)."""
    if io.proposer is not None and pending.dim() == 1:
        return draft_with_proposals(model, cache, pending, positions, k, io, seqs)
    block = pending if pending.dim() == 2 else pending[:, None]
    drafts = block.new_empty((block.shape[0], 0))
    probs = [] if io.do_sample else None
    position, width, first_pass = positions, block.shape[-1], 0.0
    while drafts.shape[-1] < k or (
        more is not None and drafts.shape[-1] < most and more(first_pass, width, drafts.shape[-1])
    ):
        started = time.perf_counter()
        logits = forward(model, cache, block, position, keep=1)[:, -1].float()
        first_pass = first_pass or time.perf_counter() - started
        position = position + block.shape[-1]
        scores = process(io, seqs, drafts, logits)
        if io.do_sample:
            probs.append(torch.softmax(scores, dim=-1))
            block = torch.multinomial(probs[-1], num_samples=1)
        else:
            block = scores.argmax(dim=-1, keepdim=True)
        drafts = torch.cat([drafts, block], dim=-1)
        if not cache.stats.first_draft_seconds:
            cache.stats.first_draft_seconds = time.perf_counter() - io.started
    cache.stats.draft_forwards += drafts.shape[-1]
    return drafts, torch.stack(probs, dim=1) if probs else None


def verify(model, cache: VeriCache, pending, positions, drafts, io: DecodeIO, seqs: Sequences):
    """One pass over [pending + drafts] on the full tier; returns raw logits and processed scores (B, k+1, V),
    position s processed with each row's prefix plus its first s drafts. A (B, s) `pending` block (a suffix the
    full tier has not seen) is prefilled exactly by the same pass."""
    block = torch.cat([pending if pending.dim() == 2 else pending[:, None], drafts], dim=-1)
    raw = forward(model, cache, block, positions, keep=drafts.shape[-1] + 1).float()  # (B, k+1, V)
    if not io.logits_processor:
        return raw, raw
    scores = torch.stack([process(io, seqs, drafts[:, :s], raw[:, s]) for s in range(raw.shape[1])], dim=1)
    return raw, scores


def verify_after_prefix(
    model, cache: VeriCache, reuse: PrefixReuse, prefix, pending, positions, drafts, io, seqs
):
    """The first verify pass after a stored prefix, which also prefills the suffix exactly. On the CPU it starts
    while the last layers of the prefix are still loading, each layer waiting only for its own; elsewhere (staged
    transfers need the whole tier) after the load. If the store failed part way, what is missing is recomputed and
    the pass runs again."""
    result = None
    if cache.reads_in_place():
        try:
            with cache.verifying():
                result = verify(model, cache, pending, positions, drafts, io, seqs)
        except PrefixNotLoaded:
            pass
    reuse.wait_full_tier(cache, prefix)  # after a pass that ran behind the load, the loader has already ended
    if result is None:
        with cache.verifying():
            result = verify(model, cache, pending, positions, drafts, io, seqs)
    return result


def verify_suffix(model, cache: VeriCache, reuse, prefix, pending, positions, drafts, io, seqs, turn: Round):
    """`verify_after_prefix`, keeping each layer's queries when the draft tier should be scored again with the
    prompt's own last queries, which the suffix holds (`refresh.rescores`): the draft tier came from the prefix
    alone, scored by the prefix's last queries, not by the prompt's."""
    if not rescores(cache.compressor, pending.shape[-1]):
        return verify_after_prefix(model, cache, reuse, prefix, pending, positions, drafts, io, seqs)
    capture = QueryCapture(cache.full_valid, model, inputs=cache.compressor.reads_layer_inputs)
    with cache.capturing(capture):
        result = verify_after_prefix(model, cache, reuse, prefix, pending, positions, drafts, io, seqs)
    turn.captured = dict(capture.contexts)
    return result


def accept(
    io: DecodeIO, drafts, draft_probs, scores, active: list[int], stats: VeriCacheStats
) -> tuple[list[int], torch.Tensor]:
    """Per-row accepted draft counts and the (B, k+1) tokens to emit, by the greedy or the sampling rule; for a model
    that counts positions from its cache's length, every row keeps the fewest drafts any `active` row kept
    (`accept_uniformly`), so that all rows grow alike."""
    if io.do_sample:
        accepted, tokens = speculative_accept(drafts, draft_probs, torch.softmax(scores, dim=-1))
    else:
        accepted, tokens = greedy_accept(drafts, scores)
    if io.positions_from_cache:
        kept = accepted
        accepted, tokens = accept_uniformly(accepted, tokens, active)
        stats.drafts_given_up += int((kept - accepted)[active].sum())
    return accepted.tolist(), tokens


@dataclass
class Round:
    """One round as its phases fill it in: what it drafts (k, on the draft tier), which rows take part, and what
    the verify pass emitted. A round after a stored prefix (`suffix`) verifies the prompt's suffix as well."""

    active: list[int]  # rows still generating
    left: dict[int, int]  # active row -> tokens it may still emit
    k: int  # drafts asked of the schedule (0: a plain round)
    suffix: bool = False  # the first round after a stored prefix: its pending block is the prompt's suffix
    loading: bool = False  # the full prefix is still loading: draft on while it does
    asked: bool = False  # a plain round asked the proposer for tokens to verify
    offered: tuple[torch.Tensor, torch.Tensor] | None = None  # what it found, and the counts
    captured: dict | None = None  # a suffix's layer inputs, to score the draft tier with (`verify_suffix`)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    commit_seconds: float = 0.0

    @property
    def room(self) -> int:
        """Tokens the longest-running active row may still emit."""
        return max(self.left.values())

    @property
    def bound(self) -> list[int]:
        """The active rows with `room` left: what they gain is what the call gains."""
        return bounding_rows(self.left)


def start(
    model, cache: VeriCache, input_ids, attention_mask, position_ids, io: DecodeIO, seqs, boundary: int
):
    """The prompt: prefilled (the first token emitted), or its first `boundary` tokens from the prefix store (the
    suffix then becomes the first round's pending block). Returns the pending tokens and their positions."""
    stats, started = cache.stats, io.started
    if boundary:  # the first round's pending block is the suffix: its verify pass emits the first token
        pending, positions = start_from_prefix(model, cache, input_ids, io.prefix, boundary, seqs)
    else:
        pending, positions = prefill(model, cache, input_ids, attention_mask, position_ids, io, seqs)
        stats.first_token_seconds = time.perf_counter() - started
        stats.emitted_tokens += input_ids.shape[0]
    stats.prefill_seconds += time.perf_counter() - started
    if io.timeline is not None:
        io.timeline.add("prefill", started, time.perf_counter())
    return pending, positions


def draft_round(model, cache: VeriCache, pending, positions, turn: Round, io: DecodeIO, seqs, schedule):
    """The round's drafts ((B, k) tokens and, when sampling, their probabilities): k steps on the draft tier (more
    while a prefix loads), a plain round's proposals to verify on the full tier, or nothing."""
    started = time.perf_counter()
    drafter = io.drafter if io.drafter is not None else model
    # draft on while the full prefix loads
    most = min(schedule.high, turn.room - 1) if turn.loading else turn.k
    if most and not cache.draft_tier.held:  # the first draft after a deferring prefill, or after a free
        remaining = None if turn.loading else turn.room
        # a query-aware tier whose build was declined cannot be built again: its rounds stay plain
        if not cache.draft_tier.buildable or not build_for_drafting(
            model, cache, schedule, remaining, drafter
        ):
            most = turn.k = 0  # drafting could not repay the build: the round turns plain
        started = time.perf_counter()  # a draft step's cost leaves the build out (compress_seconds)
    # a plain round (k = 0) still verifies the proposer's tokens, as classic speculative decoding does
    if not turn.k and io.proposer is not None and not turn.suffix:
        turn.asked = io.plain_proposal_length.current > 0
        turn.offered = propose_to_full_tier(io, seqs, pending, turn.bound)
    if most:
        with cache.drafting(most):  # the full tier streams in meanwhile
            more = io.prefix.keep_drafting if turn.loading else None
            drafts, draft_probs = draft(drafter, cache, pending, positions, turn.k, io, seqs, more, most)
    else:  # a plain round: nothing runs on the draft tier; the full tier starts streaming in for the pass
        block = pending if turn.suffix else pending[:, None]
        drafts = turn.offered[0] if turn.offered is not None else block.new_empty((block.shape[0], 0))
        draft_probs = None
        cache.stream.prefetch(room=block.shape[-1] + drafts.shape[-1])
    if drafts.is_cuda:  # time the draft's kernels, not their launch (the copy stream runs on)
        torch.cuda.current_stream(drafts.device).synchronize()
    turn.draft_seconds = time.perf_counter() - started
    if io.timeline is not None and drafts.shape[-1] and turn.offered is None:
        io.timeline.add("draft", started, started + turn.draft_seconds)
    return drafts, draft_probs


def build_for_drafting(
    model, cache: VeriCache, schedule: DraftLengthSchedule, remaining: int | None, drafter=None
) -> bool:
    """Build the draft tier for a drafted round, unless the schedule finds it dearer than drafting could save over
    the `remaining` tokens (None: build). Its price is what the schedule measured, or before any build, the faster
    of the first two layers' times, per layer (see `DraftTierLifecycle.build`). Returns whether it was built; a
    query-aware compressor's held layer inputs go with a refusal."""
    started = time.perf_counter()
    afford = partial(
        schedule.affords_build, remaining=remaining, draft_share=draft_share(model, cache, drafter)
    )
    built = cache.draft_tier.build(afford, schedule.build_price)
    if built:
        schedule.observe_build(time.perf_counter() - started)
    else:
        cache.stats.draft_tier_builds_declined += 1
    return built


def draft_share(model, cache: VeriCache, drafter=None) -> float | None:
    """The share of a plain step that a draft step cannot avoid, by bytes read: the drafting weights (the model's,
    or `draft_dtype`'s narrower copy) against the model's weights plus the full tier, which a plain step reads and a
    draft step does not. None where the full tier is not read in place: bytes over a host link are no measure of
    its time."""
    if not cache.reads_in_place():
        return None

    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    weights = size(model)
    return size(drafter if drafter is not None else model) / (weights + cache.full_tier_bytes())


def verify_round(
    model, cache: VeriCache, pending, positions, drafts, draft_probs, turn: Round, io, seqs, prefix
):
    """The verify pass over [pending + drafts] on the full tier and the accept rule: returns raw logits, processed
    scores, per-row accepted counts and the (B, k+1) tokens to emit."""
    started = time.perf_counter()
    if turn.suffix:
        raw, scores = verify_suffix(
            model, cache, io.prefix, prefix, pending, positions, drafts, io, seqs, turn
        )
    else:
        with cache.verifying():
            raw, scores = verify(model, cache, pending, positions, drafts, io, seqs)
    if (
        turn.offered is not None and io.do_sample
    ):  # the proposer's point masses; padding gets none (never kept)
        real = torch.arange(drafts.shape[-1])[None, :] < turn.offered[1][:, None]
        draft_probs = torch.nn.functional.one_hot(drafts, scores.shape[-1]).to(scores.dtype)
        draft_probs *= real.to(draft_probs.device)[..., None]
    # reads the result back: the pass ended
    accepted, tokens = accept(io, drafts, draft_probs, scores, turn.active, cache.stats)
    turn.verify_seconds = time.perf_counter() - started
    if io.timeline is not None:
        io.timeline.add("verify", started, started + turn.verify_seconds)
    if turn.suffix:
        cache.stats.first_token_seconds = time.perf_counter() - io.started
    return raw, scores, accepted, tokens


def record_round(cache: VeriCache, turn: Round, drafted: int, accepted: list[int], io: DecodeIO) -> None:
    """The round's stats, and what a plain round's proposals earned (for the proposal gate)."""
    stats = cache.stats
    stats.draft_seconds += turn.draft_seconds
    stats.verify_seconds += turn.verify_seconds
    if not turn.k:
        stats.plain_round_seconds += turn.draft_seconds + turn.verify_seconds
    if drafted:
        stats.record_round(drafted, [accepted[b] for b in turn.active])
    else:
        stats.plain_rounds += 1
    if not turn.k and io.proposer is not None and not turn.suffix:
        counts = turn.offered[1].tolist() if turn.offered is not None else [0] * len(accepted)
        kept = {b: min(accepted[b], counts[b]) for b in turn.active}
        stats.proposed_tokens += sum(counts)
        stats.proposals_verified_kept += sum(kept.values())
        width = turn.offered[0].shape[-1] + 1 if turn.offered is not None else 1
        offered, gained = call_run(turn.left, {b: counts[b] for b in turn.active}, kept)
        io.plain_proposal_length.observe(width, turn.draft_seconds + turn.verify_seconds, [offered], [gained])


def commit_round(cache: VeriCache, turn: Round, pending, accepted: list[int], going_on: bool) -> torch.Tensor:
    """Commit each active row's [pending + accepted drafts] (its exact K/V, from the verify pass) to both tiers, when
    any row goes on; returns the (B,) counts, which advance the rows' positions."""
    block = pending.shape[-1] if turn.suffix else 1  # tokens committed besides the accepted drafts
    counts = torch.tensor([accepted[b] + block if b in turn.active else 0 for b in range(len(accepted))])
    if going_on:
        started = time.perf_counter()
        width = int(counts.max())
        cache.commit(width, torch.arange(width)[None, :] < counts[:, None])
        turn.commit_seconds = time.perf_counter() - started
        cache.stats.commit_seconds += turn.commit_seconds
    return counts


@dataclass
class Decoding:
    """A call's state between rounds: the rows' tokens, each row's pending token (or, after a stored prefix, the
    prompt's suffix as a (B, s) block) with its absolute position, and the stored prefix's tokens ((B, 0) without
    one)."""

    seqs: Sequences
    pending: torch.Tensor
    positions: torch.Tensor
    prefix: torch.Tensor


def begin(model, cache: VeriCache, input_ids, attention_mask, position_ids, io: DecodeIO) -> Decoding:
    """The prompt (prefilled, or its prefix from the store): the state the first round starts from."""
    seqs = Sequences.start(input_ids, io.max_length, io.pad_token_id)
    io.started = time.perf_counter()
    reuse = io.prefix
    boundary = reuse.boundary(input_ids, attention_mask) if reuse is not None else 0
    pending, positions = start(model, cache, input_ids, attention_mask, position_ids, io, seqs, boundary)
    return Decoding(seqs, pending, positions, input_ids[:, :boundary])


def run_round(model, cache: VeriCache, state: Decoding, io: DecodeIO, schedule: DraftLengthSchedule) -> None:
    """One round: draft, verify, emit, record, commit, and the schedule's and the draft tier's upkeep."""
    stats, seqs, pending, positions = cache.stats, state.seqs, state.pending, state.positions
    active = [b for b, alive in enumerate(seqs.unfinished) if alive]
    left = {b: io.of(b).max_length - seqs.lengths[b] for b in active}
    room = max(left.values())
    # the first round after a prefix drafts only while the full prefix loads: the first token comes first
    suffix = pending.dim() == 2
    k = 0 if suffix else max(0, min(schedule.current, room - 1))
    loading = suffix and not io.prefix.full_tier_ready()
    turn = Round(active, left, k, suffix, loading=loading)

    passes_before = stats.draft_forwards
    drafts, draft_probs = draft_round(model, cache, pending, positions, turn, io, seqs, schedule)
    passes = stats.draft_forwards - passes_before
    raw, scores, accepted, tokens = verify_round(
        model, cache, pending, positions, drafts, draft_probs, turn, io, seqs, state.prefix
    )
    for b in active:
        for step in range(accepted[b] + 1):
            stats.emitted_tokens += 1
            if emit(io, seqs, b, tokens[b, step], scores[b, step], raw[b, step]):
                break
    drafted = drafts.shape[-1] if turn.offered is None else 0  # a first round may draft on while loading
    record_round(cache, turn, drafted, accepted, io)
    counts = commit_round(cache, turn, pending, accepted, any(seqs.unfinished))
    if not suffix:  # a first round after a prefix prefilled the suffix too: not a draft round's cost
        schedule.observe(
            drafted,
            [accepted[b] for b in turn.bound],
            turn.draft_seconds,
            turn.verify_seconds,
            verified=drafts.shape[-1] + 1,
            commit_seconds=turn.commit_seconds,
            remaining=max((io.of(b).max_length - seqs.lengths[b] for b in active), default=0),
            tier_held=cache.draft_tier.held,
            asked=turn.asked,
            passes=passes or None,
        )
    if not any(seqs.unfinished):
        return
    if turn.captured is not None and cache.draft_tier.held:  # what a prefill of the whole prompt builds
        rescore_draft_tier(cache, turn.captured, int(positions[0]) + pending.shape[-1], pending.shape[-1])
    if not schedule.keeps_draft_tier and cache.draft_tier.held and cache.draft_tier.rebuildable:
        cache.draft_tier.free()  # plain rounds for a while: nothing reads it until it is rebuilt
    if cache.draft_tier.refresh_clock is not None and cache.draft_tier.held:
        mean_accepted = sum(accepted[b] for b in active) / len(active) if drafted else None
        cache.draft_tier.refresh_clock.after_commit(cache, int(counts.max()), mean_accepted)
    index = torch.tensor([accepted[b] if b in active else 0 for b in range(len(accepted))])
    state.pending = tokens.gather(1, index[:, None].to(tokens.device))[:, 0]
    state.positions = positions + counts.to(positions.device)


def decode(
    model, cache: VeriCache, state: Decoding, io: DecodeIO, schedule: DraftLengthSchedule
) -> Sequences:
    """Rounds from `state` (see `begin`) until every row stops; returns the per-row `Sequences`."""
    while any(state.seqs.unfinished):
        run_round(model, cache, state, io, schedule)
    record_sizes(cache)
    return state.seqs


def record_sizes(cache: VeriCache) -> None:
    """The tiers' sizes at the end of a call, into its stats."""
    stats = cache.stats
    stats.draft_tier_bytes = max(stats.draft_tier_bytes, cache.draft_tier_bytes())
    stats.full_tier_bytes = max(stats.full_tier_bytes, cache.full_tier_bytes())
    stats.recurrent_state_bytes = max(stats.recurrent_state_bytes, cache.recurrent_state_bytes())
    stats.window_tier_bytes = max(stats.window_tier_bytes, cache.window_tier_bytes())
