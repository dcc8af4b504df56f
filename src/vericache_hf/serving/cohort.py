"""Cohorts: requests that share forward passes, joining after their own prefill and leaving when they stop.

A request served with `vericache_cohorts=<CohortPool>` prefills alone (its first token streams at once), then hands
its one-row state to the pool as a `Member` and waits. A cohort thread admits waiting members between its rounds:
their caches and states are stacked into the cohort's (`cache/rows.py`), and each round drafts and verifies every
row in one pass. Each row keeps its own request's logits processors, stopping criteria, streamer and length limit
(`CohortIO.of`), exactly as that request's own `generate` built them, so every row's output is what stock
`generate` gives its prompt alone; a row whose criteria, processors or streamer raise fails its request alone.
Finished rows leave after the round, and their slots go with them.

Several cohorts run at once, one per thread, on one device: while one drafts (device-bound), another's full tier
streams in through the shared transfer queue and it verifies (link-bound) - the paper's staggering (P1). How many
cohorts and how large come from measured times (`plan`): a cohort's copy time against its compute time per round
says how many others must compute while it copies. `cohorts=` and `cohort_size=` override the plan.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList

from .._threads import waiting
from ..cache import rows
from ..cache.vericache import VeriCache
from ..config import VeriCacheConfig
from ..drafting.draft_model import draft_model
from ..handoff import Member
from ..loop import Decoding, record_sizes, run_round
from ..pass_model import pass_model
from ..passes import DecodeIO, Sequences, counts_positions_from_cache
from ..schedule.draft_length import draft_length_schedule
from ..schedule.priors import priors_for
from ..stats import VeriCacheStats

#: The most cohorts `cohorts="auto"` runs at once.
MOST_COHORTS = 4


class _RowCriteria:
    """A row's own stopping criteria; one that raises fails its request alone (the row stops, the cohort goes on)."""

    def __init__(self, io: DecodeIO, criteria) -> None:
        self.io, self.criteria = io, criteria

    def __len__(self) -> int:
        return len(self.criteria)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        try:
            return self.criteria(input_ids, scores, **kwargs)
        except Exception as error:  # noqa: BLE001 - the row's request fails with it
            self.io.failed = error
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _RowStreamer:
    """A row's own streamer; one that raises fails its request alone."""

    def __init__(self, io: DecodeIO, streamer) -> None:
        self.io, self.streamer = io, streamer

    def put(self, value: torch.Tensor) -> None:
        try:
            self.streamer.put(value)
        except Exception as error:  # noqa: BLE001 - the row's request fails with it
            self.io.failed = error

    def end(self) -> None:
        self.streamer.end()


class RowProcessors:
    """Each row's own logits processors, applied to that row alone (a processor may depend on its own prompt's
    length, as `min_new_tokens` does); one that raises fails its row's request alone."""

    def __init__(self, members: list[DecodeIO]) -> None:
        self.members = members

    def __len__(self) -> int:
        return sum(len(io.logits_processor) for io in self.members)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        for row, io in enumerate(self.members):
            if io.logits_processor and io.failed is None:
                try:
                    scores[row : row + 1] = io.logits_processor(
                        input_ids[row : row + 1], scores[row : row + 1]
                    )
                except Exception as error:  # noqa: BLE001 - the row's request fails with it
                    io.failed = error
        return scores


@dataclass
class CohortIO(DecodeIO):
    """The cohort's io: shared choices (sampling or not, the timeline), each row reported and stopped by its own
    request's io."""

    members: list[DecodeIO] = field(default_factory=list)

    def of(self, row: int) -> DecodeIO:
        return self.members[row]


class Cohort:
    """Rows of several requests decoded in shared passes: one cache, one `Decoding`, one draft-length schedule."""

    def __init__(self, model, key: Hashable, config: VeriCacheConfig, do_sample: bool) -> None:
        self.model, self.key, self.config = model, key, config
        self.runner = pass_model(model)  # what the passes run on (the model's own weights)
        self.members: list[Member] = []
        self.cache: VeriCache | None = None
        self.state: Decoding | None = None
        self.stats = VeriCacheStats()
        self.schedule = draft_length_schedule(config, do_sample, priors_for(model).recall(key))
        self.io = CohortIO(
            logits_processor=LogitsProcessorList(),
            stopping_criteria=None,
            max_length=0,
            pad_token_id=0,
            do_sample=do_sample,
            timeline=config.timeline,
            started=time.perf_counter(),
            drafter=draft_model(model, config.draft_dtype, config.draft_matmul),
            positions_from_cache=counts_positions_from_cache(model),  # then a cohort holds one request
        )

    def admit(self, joining: list[Member]) -> None:
        """Stack `joining` members' rows after the cohort's own (between rounds)."""
        for member in joining:
            io = member.io
            if not isinstance(io.stopping_criteria, _RowCriteria):  # a row sent back to decode alone has them
                io.stopping_criteria = _RowCriteria(io, io.stopping_criteria)
                if io.streamer is not None:
                    io.streamer = _RowStreamer(io, io.streamer)
        states = ([self.state] if self.state is not None else []) + [m.state for m in joining]
        caches = [m.cache for m in joining]
        cache = self.cache if self.cache is not None else caches.pop(0)  # or the first member's becomes it
        if caches:
            rows.join(cache, caches)
        cache.stats, self.cache = self.stats, cache
        for member in joining:
            member.cache = None  # its rows are the cohort's now: its own buffers can go
        self.state = _stacked(states)
        self._set_members(self.members + joining)

    def run_round(self) -> None:
        run_round(self.runner, self.cache, self.state, self.io, self.schedule)

    def release(self) -> list[Member]:
        """Finished rows leave: each member gets its own row's tokens back. Returns the members that left."""
        unfinished = self.state.seqs.unfinished
        keep = [b for b, alive in enumerate(unfinished) if alive]
        leaving = [b for b, alive in enumerate(unfinished) if not alive]
        if not leaving:
            return []
        left = []
        for b in leaving:
            member = self.members[b]
            member.state = _rows_of(self.state, [b])
            left.append(member)
        if keep:
            record_sizes(self.cache)
            rows.keep(self.cache, keep)
            self.state = _rows_of(self.state, keep)
        else:
            self.close()
        self._set_members([self.members[b] for b in keep])
        return left

    def split(self) -> list[Member]:
        """Every row back to its member, each with a one-row cache of its own, to decode alone (keys no other
        member shares); the cohort is left empty."""
        members = self.members
        for b, member in enumerate(members):
            member.cache = rows.copy_row(self.cache, b)
            member.state = _rows_of(self.state, [b])
            member.key = (member.key, "alone", id(member))
        self.clear()
        return members

    def clear(self) -> None:
        """Let every row go (the members are finished or sent back by the caller)."""
        self._set_members([])
        self.close()

    def close(self) -> None:
        """The cohort is empty: what it measured goes to the next cohort of the same settings and the config's
        stats."""
        if self.cache is not None:
            record_sizes(self.cache)
            self.cache.close()
        priors_for(self.model).remember(self.key, self.schedule)
        if self.config.stats is not None:
            self.config.stats.merge(self.stats)
        self.stats = VeriCacheStats()
        self.cache = self.state = None

    def _set_members(self, members: list[Member]) -> None:
        self.members = members
        self.io.members = [member.io for member in members]
        self.io.logits_processor = RowProcessors(self.io.members)


def _stacked(states: list[Decoding]) -> Decoding:
    seqs = [state.seqs for state in states]
    capacity = max(s.tokens.shape[-1] for s in seqs)
    tokens = torch.cat(
        [torch.nn.functional.pad(s.tokens, (0, capacity - s.tokens.shape[-1]), value=0) for s in seqs]
    )
    stacked = Sequences(
        tokens,
        [n for s in seqs for n in s.lengths],
        [u for s in seqs for u in s.unfinished],
        [row for s in seqs for row in s.scores],
        [row for s in seqs for row in s.raw_logits],
        [start for s in seqs for start in s.starts],
    )
    return Decoding(
        stacked,
        torch.cat([state.pending for state in states]),
        torch.cat([state.positions for state in states]),
        torch.cat([state.prefix[:, :0] for state in states]),
    )


def _rows_of(state: Decoding, keep: list[int]) -> Decoding:
    """The state of rows `keep` alone."""
    seqs = state.seqs
    kept = Sequences(
        seqs.tokens[keep],
        [seqs.lengths[b] for b in keep],
        [seqs.unfinished[b] for b in keep],
        [seqs.scores[b] for b in keep],
        [seqs.raw_logits[b] for b in keep],
        [seqs.starts[b] for b in keep],
    )
    return Decoding(kept, state.pending[keep], state.positions[keep], state.prefix[keep])


def plan(
    requests: int, copy_seconds: float, compute_seconds: float, most: int = MOST_COHORTS
) -> tuple[int, int]:
    """How many cohorts, and how many requests in each, for `requests` at once, from one cohort round's measured
    copy time (the full tier streaming to the device) and compute time (drafting and verifying).

    With n cohorts taking turns on the device, a cohort's copy runs while the other n - 1 compute, so it is hidden
    when copy <= (n - 1) * compute. More cohorts than that only split the batch (each weight read then serves fewer
    rows). With nothing to copy (a full tier read in place, on a CPU) one cohort serves everyone."""
    if requests < 1:
        return 1, 1
    count = 1 + math.ceil(copy_seconds / compute_seconds) if copy_seconds > 0.05 * compute_seconds else 1
    count = max(1, min(count, most, requests))
    return count, math.ceil(requests / count)


class CohortPool:
    """Cohorts on their own threads; requests join one between its rounds (`decode`).

    `cohorts` is how many run at once and `cohort_size` the most requests in one: numbers, or "auto" (`plan`, from
    the copy and compute times that rounds measure; before any, one cohort where full tiers are read in place,
    two where they stream to a device)."""

    def __init__(self, model, cohorts: int | str = "auto", cohort_size: int | str = "auto") -> None:
        for name, value in (("cohorts", cohorts), ("cohort_size", cohort_size)):
            if value != "auto" and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= 1
            ):
                raise ValueError(f"{name} must be a positive int or 'auto', got {value!r}.")
        if cohort_size != 1 and counts_positions_from_cache(model):
            raise ValueError(
                f"{type(model).__name__} counts positions from its cache's length (its forward takes no "
                "position_ids), so its requests cannot share passes: a row that joins a cohort is padded to the "
                "cohort's length, and would sit at other positions than stock generate gives its prompt. Serve "
                "each request alone with cohort_size=1."
            )
        self.model = model
        self.cohorts, self.cohort_size = cohorts, cohort_size
        self._slots = cohorts if cohorts != "auto" else MOST_COHORTS
        self._joining: list[Member] = []
        self._running: list[Cohort | None] = [None] * self._slots
        self._active = 0  # requests in a cohort or about to join one
        self._copy = self._compute = 0.0  # per cohort round, measured (decaying means)
        self.rounds = self.row_rounds = self.most_rows = 0
        self._changed = threading.Condition()
        self._prefills = threading.Semaphore(1)
        self._threads: list[threading.Thread] = []
        self._closed = False

    # -- the requests' side -------------------------------------------------------------------------------------
    @contextmanager
    def prefilling(self) -> Iterator[None]:
        """One prefill at a time: a new prompt's pass runs beside the cohorts' rounds, not beside other prompts'."""
        with self._prefills:
            yield

    def decode(self, member: Member) -> Sequences:
        """Decode `member` in a cohort to the end; returns its row's tokens, or raises what failed its request."""
        _settle(member)  # its prefill ran on this thread's stream; the cohort's runs on another
        with self._changed:
            if self._closed:
                raise RuntimeError("this cohort pool is closed; its engine was stopped.")
            self._joining.append(member)
            self._active += 1
            self._start_threads()
            self._changed.notify_all()
        waiting(
            self.model.device
        )  # this thread's OpenMP team sits idle while a cohort thread decodes its row
        member.done.wait()
        if member.error is not None:
            raise member.error
        return member.state.seqs

    def close(self, timeout: float | None = None) -> None:
        """Let the cohorts finish the rows they hold, then end their threads."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    def planned(self) -> tuple[int, int]:
        """(cohorts, most requests in one) for the requests now active."""
        count, size = plan(self._active, self._copy, self._compute, self._slots)
        if self._copy == self._compute == 0.0 and self._running_staged():
            count, size = plan(self._active, 1.0, 1.0, self._slots)  # nothing measured yet: stagger in two
        count = self.cohorts if self.cohorts != "auto" else count
        size = self.cohort_size if self.cohort_size != "auto" else math.ceil(max(self._active, 1) / count)
        return count, size

    # -- the cohorts' side --------------------------------------------------------------------------------------
    def _start_threads(self) -> None:
        if self._threads:
            return
        self._threads = [
            threading.Thread(
                target=self._run, args=(slot,), name=f"vericache-engine-cohort-{slot}", daemon=True
            )
            for slot in range(self._slots)
        ]
        for thread in self._threads:
            thread.start()

    def _running_staged(self) -> bool:
        joining = self._joining[0].cache if self._joining else None
        return joining is not None and not joining.reads_in_place()

    def _take(self, slot: int) -> list[Member]:
        """The waiting members this slot's cohort admits now: those of its settings (an empty cohort takes the first
        one's), while it is one of the planned cohorts, has room, and no other planned cohort holds fewer."""
        cohort = self._running[slot]
        count, size = self.planned()
        held = len(cohort.members) if cohort is not None else 0
        key = cohort.key if held else None
        if slot >= count and not held:  # beyond the plan: only for settings no cohort serves or can take up
            planned = self._running[:count]
            if any(c is None or not c.members for c in planned):
                return []
            served = {c.key for c in self._running if c is not None and c.members}
            key = next((m.key for m in self._joining if m.key not in served), None)
            if key is None:
                return []
            count = slot + 1
        others = [
            len(c.members) if c is not None else 0 for i, c in enumerate(self._running[:count]) if i != slot
        ]
        taken = []
        for member in list(self._joining):
            if held + len(taken) >= size or (others and held + len(taken) > min(others)):
                break
            if key is None or member.key == key:
                key = member.key
                taken.append(member)
                self._joining.remove(member)
        return taken

    @torch.no_grad()  # as stock `generate` runs, where the members' caches were made
    def _run(self, slot: int) -> None:
        # each cohort on its own stream: one cohort's verify pass waiting for its copies holds back none of
        # another's draft steps
        with own_stream(self.model.device):
            while (cohort := self._next(slot)) is not None:
                timeline = cohort.config.timeline
                with timeline.track(f"cohort_{slot}") if timeline is not None else nullcontext():
                    self._round(cohort)

    def _next(self, slot: int) -> Cohort | None:
        """This slot's cohort after admitting who may join (between rounds), once it has rows; None once the pool
        is closed and nothing is left to serve."""
        while True:
            with self._changed:
                while True:
                    cohort = self._running[slot]
                    joining = self._take(slot)
                    if joining or (cohort is not None and cohort.members):
                        break
                    if self._closed and not self._joining:
                        return None
                    waiting(self.model.device)
                    self._changed.wait(0.5)
            if joining:
                if cohort is None or not cohort.members:
                    first = joining[0]
                    cohort = self._running[slot] = Cohort(
                        self.model, first.key, first.config, first.io.do_sample
                    )
                try:
                    cohort.admit(joining)
                except Exception as error:  # noqa: BLE001 - a join that broke part way fails the rows it touched
                    members = cohort.members
                    cohort.clear()
                    self._finish(members + joining, error)
            if cohort.members:
                return cohort

    def _round(self, cohort: Cohort) -> None:
        stats, lengths = cohort.stats, list(cohort.state.seqs.lengths)
        before = (stats.transfer_seconds, stats.draft_seconds + stats.verify_seconds)
        try:
            cohort.run_round()
        except Exception as error:  # noqa: BLE001 - handled per row below
            self._failed_round(cohort, error, lengths)
            return
        copy = stats.transfer_seconds - before[0]
        compute = stats.draft_seconds + stats.verify_seconds - before[1]
        with self._changed:
            self._copy = 0.7 * self._copy + 0.3 * copy
            self._compute = 0.7 * self._compute + 0.3 * compute
            self.rounds += 1
            self.row_rounds += len(cohort.members)
            self.most_rows = max(self.most_rows, len(cohort.members))
        self._finish(cohort.release())

    def _failed_round(self, cohort: Cohort, error: BaseException, lengths: list[int]) -> None:
        """A shared pass raised. Before any row emitted (a draft or verify pass failed: the cache is as the round
        found it) each row goes back to wait, to decode alone, so a fault that one request brings fails that
        request alone and costs the others time, never tokens. Otherwise every row of the round fails."""
        members = cohort.members
        if len(members) > 1 and cohort.state.seqs.lengths == lengths:
            try:
                alone = cohort.split()
            except Exception:  # noqa: BLE001 - the cache cannot be split: the rows fail with the pass's error
                alone = []
            if alone:
                with self._changed:
                    self._joining[:0] = alone
                    self._changed.notify_all()
                return
        cohort.clear()
        self._finish(members, error)

    def stats(self) -> dict[str, float]:
        """Rounds run, and the rows they decoded together (mean and most): how much passes were shared."""
        with self._changed:
            mean = self.row_rounds / self.rounds if self.rounds else 0.0
            return {"rounds": self.rounds, "mean_rows_per_round": mean, "most_rows_per_round": self.most_rows}

    def _finish(self, members: list[Member], error: BaseException | None = None) -> None:
        if not members:
            return
        with self._changed:
            self._active -= len(members)
            self._changed.notify_all()
        for member in members:
            _settle(member)  # the request's thread reads its tokens next, on its own stream
            member.finish(error)


def own_stream(device: torch.device):
    """A new CUDA stream for this thread's work inside the block (on a CUDA device; nothing elsewhere), so that a
    thread waiting on its own events holds back no other thread's kernels."""
    return torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else nullcontext()


def _settle(member: Member) -> None:
    """Wait for this thread's CUDA work on the member's tensors, before another thread (on another stream) takes
    them over."""
    if member.state.seqs.tokens.is_cuda:
        torch.cuda.current_stream(member.state.seqs.tokens.device).synchronize()
