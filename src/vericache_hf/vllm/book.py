"""Which draft state serves which row, and how long each row drafts: a serving engine hands over rows of tokens,
not requests, and reorders them as requests finish and join.

A draft state stands for exactly the tokens it was fed (`DraftState.tokens`), so a row may draft on a state only
when the row's tokens extend the state's: the match is checked token for token, every step. A state that no row
extends any more (its request finished, or the engine moved it) is never reused; a row that finds none builds a
new one. Losing track therefore costs a rebuild, never a draft on another request's K/V.

Pacing (pays or stops) is decided for the batch, since the engine's step waits for every draft pass: a row that
drafts holds up the rows that do not. The engine's decode steps run without drafts until a plain step of as many
rows is timed. Then, each step, the rows with a draft state draft together, in one batched pass per drafted token,
all to one length: the one whose rounds give the batch the most tokens per second, that is, every drafting row's
expected tokens (its kept drafts, from its own acceptance curve, this library's `AcceptanceCurve`, plus the engine's
token) and one token for each other row, over that many batched passes and the engine step that verifies them. Where
that rate is below plain steps', or the rounds drafted since the start or the last probe gave less (the tokens the
rows grew by over each round's whole time: the model can misprice a round, a verify step of long drafts costing more
than of short ones), no row drafts, at the cost of one lookup a row and step, and the batch probes again after a
backoff that doubles each time. A probe whose rows' curves still say drafting does not pay drafts the shortest
length, one round, to see whether the text's acceptance has changed. Where even every draft kept could not pay at
any length (a round of L drafts gives at most L + 1 tokens a row), drafting stops after one round, and a probe that
comes due while that still holds is skipped without drafting. Steps, passes and plain steps are timed per number of
rows, on which they depend; a plain step only after another, since the first after a prefill or a verify step runs
slower than the steady ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..schedule.measures import AcceptanceCurve
from .draft import DraftState, draft_rows

logger = logging.getLogger(__name__)

KEY_TOKENS = 16  # states are indexed by their first tokens; the full match is checked on top
FAILED_KEPT = 64  # prefixes of failed rows remembered
ACCEPTANCE_DECAY = 0.8  # per round of a row: acceptance follows the text, which changes


@dataclass
class Pacing:
    """How the batch drafts: the engine's most drafts per row, and when drafting starts, stops and probes again.

    Parameters:
        max_length: most tokens drafted per row and step (the engine's `num_speculative_tokens`).
        first_length: the length drafted while the costs are not timed yet.
        min_length: the shortest length drafted.
        min_context: rows with fewer tokens never draft (a short context gains nothing from a compressed one).
        probe_rounds: rounds drafted after the first start before a rate below plain steps' stops drafting (after
            a probe, one round: the rows' curves remember the rounds before the stop).
        backoff_steps: steps the batch waits after a stop before it probes again (doubling per stop, up to 64x).
        idle_steps: a state no row used for this many steps is dropped.
        measure_plain: before any draft, engine steps run without drafts until one plain step of as many rows is
            timed: what drafting must beat.
    """

    max_length: int = 8
    first_length: int = 4
    min_length: int = 2
    min_context: int = 32
    probe_rounds: int = 3
    backoff_steps: int = 32
    idle_steps: int = 8
    measure_plain: bool = True

    def __post_init__(self) -> None:
        for name in (
            "max_length",
            "first_length",
            "min_length",
            "probe_rounds",
            "backoff_steps",
            "idle_steps",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Pacing.{name} must be a positive int, got {value!r}.")
        self.first_length = min(self.first_length, self.max_length)
        self.min_length = min(self.min_length, self.first_length)


@dataclass
class Entry:
    """A state, and how far its row's drafted runs got (`curve`)."""

    state: DraftState
    curve: AcceptanceCurve
    last_step: int = 0


class DraftBook:
    """Draft states for the rows of a serving engine's batch.

    `build(tokens, row)` makes a state for row `row`'s tokens (all but its newest, which the first round feeds). `propose`
    is called once per engine step with every row's tokens and returns each row's drafts (maybe none). States built
    by one `build` share its drafting model, so a step's drafting rows run as one batch.
    """

    def __init__(self, build: Callable[[list[int], int], DraftState], pacing: Pacing | None = None) -> None:
        self.build = build
        self.draft_rows = draft_rows
        self.clock = time.perf_counter
        self.pacing = pacing or Pacing()
        self.entries: dict[tuple[int, ...], list[Entry]] = {}
        self.step = 0
        # running means of whole times: a batched draft pass, by the rows in it; the engine's step (drafting
        # excluded), by the rows in the batch, after a step that drafted (its verify pass) and after one that did
        # not (a plain step, which is what drafting must beat)
        self.draft_passes: dict[int, float] = {}
        self.engine_steps: dict[int, float] = {}
        self.plain_steps: dict[int, float] = {}
        # what drafted rounds gave, by the rows in the batch: the tokens the rows grew by over the round's whole
        # time (the proposer's call and the engine step that verified), since the cost model can misprice a round
        self.round_rates: dict[int, float] = {}
        self.last_call = 0.0  # seconds the last call of `propose` took
        self.active = 0
        self.last_return: float | None = None
        self.last_drafted = False
        self.last_plain = False  # whether the step that ended at the last call was a plain step of its rows
        self.last_lengths: dict[int, int] = {}  # each active row's token count at the last call
        self.probed = 0  # rounds drafted since drafting started or last probed
        self.resume_step = 0  # after a stop, the batch drafts again from this step
        self.backoff = 0
        self.failed_rows = 0
        self.failed: list[list[int]] = []  # token prefixes of rows that failed: they get no drafts
        self.rounds = self.drafted = self.kept = 0  # per row

    def propose(self, rows: Sequence[Sequence[int] | None]) -> list[list[int]]:
        """Each row's drafts; a row given as None (still in prefill, or at its length limit) gets none. The rows
        that draft this step draft together, one batched pass per drafted token (`draft_rows`)."""
        started = self.clock()
        lengths = {row: len(tokens) for row, tokens in enumerate(rows) if tokens is not None}
        self._time_step(started, lengths)
        self.active = len(lengths)
        self.step += 1
        claimed: set[int] = set()
        chosen = []
        for row, tokens in enumerate(rows):
            entry = None if tokens is None else self._ready(row, list(tokens), claimed)
            if entry is not None:
                chosen.append((row, entry, list(tokens)))
        length = self._length([entry for _, entry, _ in chosen]) if chosen else 0
        drafts: list[list[int]] = [[] for _ in rows]
        if length:
            for (row, _, _), row_drafts in zip(chosen, self._draft(chosen, length), strict=True):
                drafts[row] = row_drafts
        self._drop_idle()
        self.last_drafted, self.last_lengths = any(drafts), lengths
        self.last_return = self.clock()
        self.last_call = self.last_return - started
        return drafts

    def _time_step(self, now: float, lengths: dict[int, int]) -> None:
        """Time the engine step since the last call, where it was one step of the same rows: after a call that
        drafted, each row grew; after one that did not, each grew by exactly one token (a plain step). A plain step
        is timed only where the step before it was one too: the first step after a prefill, a verify step or a
        change of batch runs slower than the steady ones that drafting must beat. Any other gap (a new batch, rows
        reordered, the time between two `generate` calls) is not a step."""
        last = self.last_lengths
        if self.last_return is None or not lengths or any(row not in last for row in lengths):
            self.last_plain = False
            return
        seconds, rows = now - self.last_return, len(lengths)
        plain = not self.last_drafted and all(n == last[row] + 1 for row, n in lengths.items())
        if self.last_drafted and all(n > last[row] for row, n in lengths.items()):
            self.engine_steps[rows] = _mean(self.engine_steps.get(rows, 0.0), seconds, 0.2)
            grown = sum(n - last[row] for row, n in lengths.items())
            self.round_rates[rows] = _mean(
                self.round_rates.get(rows, 0.0), grown / (self.last_call + seconds), 0.2
            )
        elif plain and self.last_plain:
            self.plain_steps[rows] = _mean(self.plain_steps.get(rows, 0.0), seconds, 0.2)
        self.last_plain = plain

    def _ready(self, row: int, tokens: list[int], claimed: set[int]) -> Entry | None:
        """The row's entry, its last round recorded, if the row has a state to draft on."""
        if len(tokens) < max(self.pacing.min_context, KEY_TOKENS + 1):
            return None
        entry = self._find(tokens, claimed)
        if entry is None:
            entry = self._new_entry(row, tokens)
            if entry is None:
                return None
        claimed.add(id(entry))
        entry.last_step = self.step
        if entry.state.pending:
            kept = entry.state.accepted(tokens)
            entry.curve.add([(len(entry.state.pending), kept)])
            self.rounds += 1
            self.kept += kept
            entry.state.pending = []
        return entry

    def _length(self, entries: list[Entry]) -> int:
        """How many tokens the rows with these entries draft this step: the length whose rounds give the batch the
        most tokens per second (`_rates`, with each row's expected tokens), the first length while the costs are
        not timed, or 0 (no drafts)."""
        pacing = self.pacing
        plain = self.plain_steps.get(self.active, 0.0)
        if (pacing.measure_plain and not plain) or self.step < self.resume_step:
            return 0
        expected = [entry.curve.expectations(pacing.max_length) for entry in entries]
        rates = self._rates(len(entries), lambda k: sum(e[k] for e in expected))
        if not rates:
            return pacing.first_length
        best = max(rates, key=rates.get)
        pays = rates[best] >= self.active / plain
        # what the rounds drafted since the last start or probe gave, however the model priced them
        paid = self.round_rates.get(self.active, self.active / plain) >= self.active / plain
        # after a stop, the rows' curves remember their earlier rounds: one round tells whether that still holds
        rounds = 1 if self.backoff else pacing.probe_rounds
        if self._hopeless(len(entries)) or (not (pays and paid) and self.probed >= rounds):
            self.backoff = min(64 * pacing.backoff_steps, max(pacing.backoff_steps, 2 * self.backoff))
            self.resume_step, self.probed = self.step + self.backoff, 0
            self.round_rates.clear()
            return 0
        # a probe that the curves say does not pay drafts the shortest length: a look at the text's acceptance now
        return best if pays or not self.backoff else pacing.min_length

    def _rates(self, drafting: int, tokens: Callable[[int], float]) -> dict[int, float]:
        """The batch's tokens per second for a round of each draft length k (none until a pass of `drafting` rows
        and a plain step of the batch are timed): `tokens(k)` from the drafting rows and one from each other row,
        over k batched passes and the engine step that verifies them, priced at its timed cost (on a CPU it can
        cost several plain steps), or at a plain step's until one is timed."""
        pacing = self.pacing
        plain, draft = self.plain_steps.get(self.active, 0.0), self.draft_passes.get(drafting, 0.0)
        if not plain or not draft:
            return {}
        verify = self.engine_steps.get(self.active, plain)
        others = self.active - drafting
        return {
            k: (tokens(k) + others) / (k * draft + verify)
            for k in range(pacing.min_length, pacing.max_length + 1)
        }

    def _hopeless(self, drafting: int) -> bool:
        """Whether no draft can pay, however many are kept: even with every draft kept (L + 1 tokens for each
        drafting row), a round of any length L the pacing allows gives the batch fewer tokens per second than
        plain steps. Known after one round, so it stops drafting without the probe rounds that a stop for a slow
        rate waits for, and skips the probes its backoff brings while it holds."""
        rates = self._rates(drafting, lambda k: drafting * (k + 1))
        return bool(rates) and max(rates.values()) <= self.active / self.plain_steps[self.active]

    def _draft(self, chosen: list[tuple[int, Entry, list[int]]], length: int) -> list[list[int]]:
        """The chosen rows' drafts, from one batched round. A round that fails is drafted again row by row, so
        that the row that fails is found and gets no drafts from then on, and the others draft as usual."""
        entries = [entry for _, entry, _ in chosen]
        try:
            started = self.clock()
            drafts = self.draft_rows(
                [entry.state for entry in entries], [t for _, _, t in chosen], [length] * len(entries)
            )
            rows = len(entries)
            self.draft_passes[rows] = _mean(
                self.draft_passes.get(rows, 0.0), (self.clock() - started) / length, 0.2
            )
        except Exception:
            if len(chosen) > 1:
                logger.warning(
                    "a batched draft round failed; its rows draft one by one to find the failing one"
                )
                return [self._draft([item], length)[0] for item in chosen]
            logger.exception("drafting failed for a row; it gets no drafts from here on")
            self._forget(entries[0])
            self.failed_rows += 1
            self.failed = [*self.failed[-(FAILED_KEPT - 1) :], list(entries[0].state.tokens)]
            return [[]]
        self.probed += 1
        self.drafted += sum(map(len, drafts))
        return drafts

    def _new_entry(self, row: int, tokens: list[int]) -> Entry | None:
        if any(tokens[: len(prefix)] == prefix for prefix in self.failed):
            return None
        try:
            state = self.build(tokens[:-1], row)
        except Exception:
            logger.exception("building a draft state failed for a row; it gets no drafts")
            self.failed_rows += 1
            # remembered, so that a build that fails is not tried again every step for the same request
            self.failed = [*self.failed[-(FAILED_KEPT - 1) :], tokens[:-1]]
            return None
        entry = Entry(state, AcceptanceCurve(ACCEPTANCE_DECAY, self.pacing.max_length), self.step)
        self.entries.setdefault(tuple(tokens[:KEY_TOKENS]), []).append(entry)
        return entry

    def _find(self, tokens: list[int], claimed: set[int]) -> Entry | None:
        """The unclaimed entry with the longest state that the row's tokens extend."""
        best = None
        for entry in self.entries.get(tuple(tokens[:KEY_TOKENS]), ()):
            if id(entry) in claimed or not entry.state.extends(tokens):
                continue
            if best is None or len(entry.state.tokens) > len(best.state.tokens):
                best = entry
        return best

    def _forget(self, entry: Entry) -> None:
        for key, entries in list(self.entries.items()):
            if entry in entries:
                entries.remove(entry)
                if not entries:
                    del self.entries[key]

    def _drop_idle(self) -> None:
        horizon = self.step - self.pacing.idle_steps
        for key in list(self.entries):
            kept = [entry for entry in self.entries[key] if entry.last_step > horizon]
            if kept:
                self.entries[key] = kept
            else:
                del self.entries[key]

    @property
    def states(self) -> int:
        return sum(len(entries) for entries in self.entries.values())


def _mean(old: float, new: float, weight: float) -> float:
    return new if old == 0.0 else (1 - weight) * old + weight * new
