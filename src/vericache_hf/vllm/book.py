"""Which draft state serves which row, and how long each row drafts: a serving engine hands over rows of tokens,
not requests, and reorders them as requests finish and join.

A draft state stands for exactly the tokens it was fed (`DraftState.tokens`), so a row may draft on a state only
when the row's tokens extend the state's: the match is checked token for token, every step. A state that no row
extends any more (its request finished, or the engine moved it) is never reused; a row that finds none builds a
new one. Losing track therefore costs a rebuild, never a draft on another request's K/V.

Pacing (pays or stops): the engine's decode steps run without drafts until a plain step of as many rows is timed
(per number of rows: a row's share of a step depends on the batch). The rows that draft in a step draft together,
in one batched pass per token, and each is charged its share of those passes. Each row's draft length is the one
whose rounds give the most tokens per second: its expected tokens, from the row's own acceptance curve (this
library's `AcceptanceCurve`: how far its drafted runs got), over the row's share of that many draft passes and of
the engine step that verifies them. A row whose best length gives fewer tokens per second than plain steps stops
drafting, at the cost of one lookup a step, and probes again after a backoff that doubles each time it fails. Where
a row's share of a draft pass costs as much as its share of a plain step, no draft length can pay: the row stops
after its first round, and a probe that comes due while that still holds is skipped without drafting.
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
ACCEPTANCE_DECAY = 0.8  # per round of the row: acceptance follows the text, which changes


@dataclass
class Pacing:
    """How a row drafts: the engine's most drafts per row, and the rules that change a row's length.

    Parameters:
        max_length: most tokens drafted per row and step (the engine's `num_speculative_tokens`).
        first_length: a new row's first draft length, and a probe's.
        min_length: the shortest length a row drafts.
        min_context: rows with fewer tokens never draft (a short context gains nothing from a compressed one).
        probe_rounds: rounds a row drafts before pacing may stop it.
        backoff_steps: steps a stopped row waits before it probes again (doubling per failed probe, up to 64x).
        idle_steps: a state no row used for this many steps is dropped.
        measure_plain: before any draft, engine steps run without drafts until one plain step of as many rows is
            timed: what drafting must beat (rows stop drafting that cannot beat it).
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
    """A state and its row's pacing: its draft length, and how far its drafted runs got (`curve`)."""

    state: DraftState
    length: int
    curve: AcceptanceCurve
    last_step: int = 0
    rounds: int = 0
    resume_step: int = 0  # a stopped row drafts again from this step
    backoff: int = 0


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
        # running means, per number of active rows (a row's share of a step depends on the batch): a row's share of
        # one batched draft pass, and of the engine's step (drafting excluded) after a step that drafted (its verify
        # pass) and after one that did not (a plain step, which is what drafting must beat)
        self.draft_steps: dict[int, float] = {}
        self.engine_steps: dict[int, float] = {}
        self.plain_steps: dict[int, float] = {}
        self.active = 0
        self.last_return: float | None = None
        self.last_drafted = False
        self.last_lengths: dict[int, int] = {}  # each active row's token count at the last call
        self.failed_rows = 0
        self.failed: list[list[int]] = []  # token prefixes of rows that failed: they get no drafts
        self.rounds = self.drafted = self.kept = 0

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
        if not self.plain_step_seconds and self.pacing.measure_plain:
            chosen = []  # plain steps until one is timed, costing nothing against the engine alone
        drafts: list[list[int]] = [[] for _ in rows]
        for (row, _, _), row_drafts in zip(chosen, self._draft(chosen), strict=True):
            drafts[row] = row_drafts
        self._drop_idle()
        self.last_drafted, self.last_lengths = any(drafts), lengths
        self.last_return = self.clock()
        return drafts

    def _time_step(self, now: float, lengths: dict[int, int]) -> None:
        """Time the engine step since the last call, per row, where it was one step of the same rows: after a call
        that drafted, each row grew; after one that did not, each grew by exactly one token (a plain step). Any
        other gap (a new batch, rows reordered, the time between two `generate` calls) is not a step."""
        last = self.last_lengths
        if self.last_return is None or not lengths or any(row not in last for row in lengths):
            return
        share = (now - self.last_return) / len(lengths)
        if self.last_drafted and all(n > last[row] for row, n in lengths.items()):
            self.engine_steps[len(lengths)] = _mean(self.engine_steps.get(len(lengths), 0.0), share, 0.2)
        elif not self.last_drafted and all(n == last[row] + 1 for row, n in lengths.items()):
            self.plain_steps[len(lengths)] = _mean(self.plain_steps.get(len(lengths), 0.0), share, 0.2)

    def _ready(self, row: int, tokens: list[int], claimed: set[int]) -> Entry | None:
        """The row's entry, its last round recorded, if the row drafts this step."""
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
            self._record(entry, entry.state.accepted(tokens))
            entry.state.pending = []
        if self.step < entry.resume_step:
            return None
        if (
            entry.backoff and not entry.rounds and self._hopeless()
        ):  # a probe that the costs known now rule out
            self._stop(entry)
            return None
        return entry

    def _draft(self, chosen: list[tuple[int, Entry, list[int]]]) -> list[list[int]]:
        """The chosen rows' drafts, from one batched round. A round that fails is drafted again row by row, so
        that the row that fails is found and gets no drafts from then on, and the others draft as usual."""
        if not chosen:
            return []
        entries = [entry for _, entry, _ in chosen]
        lengths = [entry.length for entry in entries]
        try:
            started = self.clock()
            drafts = self.draft_rows([entry.state for entry in entries], [t for _, _, t in chosen], lengths)
            per_row_pass = (self.clock() - started) / (max(lengths) * len(chosen))
            self.draft_steps[self.active] = _mean(self.draft_step_seconds, per_row_pass, 0.2)
        except Exception:
            if len(chosen) > 1:
                logger.warning(
                    "a batched draft round failed; its rows draft one by one to find the failing one"
                )
                return [self._draft([item])[0] for item in chosen]
            logger.exception("drafting failed for a row; it gets no drafts from here on")
            self._forget(entries[0])
            self.failed_rows += 1
            self.failed = [*self.failed[-(FAILED_KEPT - 1) :], list(entries[0].state.tokens)]
            return [[]]
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
        pacing = self.pacing
        entry = Entry(
            state, pacing.first_length, AcceptanceCurve(ACCEPTANCE_DECAY, pacing.max_length), self.step
        )
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

    def _record(self, entry: Entry, kept: int) -> None:
        """A finished round: the row's next length, or a stop when its drafts do not pay."""
        self.rounds += 1
        self.kept += kept
        entry.rounds += 1
        entry.curve.add([(entry.length, kept)])
        rates = self._rates(entry)
        if rates:
            entry.length = max(rates, key=rates.get)
        if self._hopeless() or (
            entry.rounds >= self.pacing.probe_rounds
            and rates
            and rates[entry.length] < 1 / self.plain_step_seconds
        ):
            self._stop(entry)

    def _stop(self, entry: Entry) -> None:
        """No drafts for the row until a probe after its backoff, which doubles each time (up to 64 times)."""
        pacing = self.pacing
        entry.backoff = min(64 * pacing.backoff_steps, max(pacing.backoff_steps, 2 * entry.backoff))
        entry.resume_step = self.step + entry.backoff
        entry.rounds, entry.length = 0, pacing.first_length

    @property
    def draft_step_seconds(self) -> float:
        """A row's share of a draft pass, at this step's number of active rows (0 while not timed)."""
        return self.draft_steps.get(self.active, 0.0)

    @property
    def engine_step_seconds(self) -> float:
        """A row's share of an engine step that verified drafts, at this step's number of active rows."""
        return self.engine_steps.get(self.active, 0.0)

    @property
    def plain_step_seconds(self) -> float:
        """A row's share of a plain engine step, at this step's number of active rows."""
        return self.plain_steps.get(self.active, 0.0)

    def _hopeless(self) -> bool:
        """Whether no draft can pay, however many are kept: a row's share of a draft pass costs at least its share
        of a plain engine step. A round of L drafts gives at most L + 1 tokens for L passes and a step that costs at
        least a plain one, so it never beats L + 1 plain steps. Known after one round, so it stops a row without
        the probe rounds that a stop for a slow rate waits for."""
        if not self.plain_step_seconds or not self.draft_step_seconds:
            return False
        return self.draft_step_seconds >= self.plain_step_seconds

    def _rates(self, entry: Entry) -> dict[int, float]:
        """Tokens per second of the row's rounds, per draft length (none until a draft pass and a plain step are
        timed): the expected tokens of a round (its kept drafts plus the engine's own token) over the row's share of
        its draft passes and of the engine step that verifies them."""
        pacing, draft = self.pacing, self.draft_step_seconds
        verify = self.engine_step_seconds or self.plain_step_seconds
        if not draft or not self.plain_step_seconds:
            return {}
        expected = entry.curve.expectations(pacing.max_length)
        return {
            k: expected[k] / (k * draft + verify) for k in range(pacing.min_length, pacing.max_length + 1)
        }

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
