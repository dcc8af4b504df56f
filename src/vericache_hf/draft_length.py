"""How many tokens to draft next round: fixed, adapted to how far recent drafts ran, or chosen for the most tokens
per second from the measured cost of a draft step and of a verify pass.

Every schedule has `current` (the next round's draft length, 0 = no draft: the round is one plain full-cache step
through the verify pass) and `observe(...)`, called after each round. The length never changes the output, only
the speed: every round is verified against the full cache.
"""

from __future__ import annotations

import copy
import math
import threading
import weakref
from collections.abc import Hashable
from typing import Any

from .config import VeriCacheConfig


class DraftLengthSchedule:
    """The interface every schedule has, and the fixed schedule: the same length every round."""

    def __init__(self, config: VeriCacheConfig) -> None:
        self.current = config.draft_length
        self.low, self.high = config.min_draft_length, config.max_draft_length

    @property
    def keeps_draft_tier(self) -> bool:
        """Whether the draft tier is worth keeping up now; when not, a K/V-only compressor's tier is freed and
        rebuilt from the full tier when drafting resumes."""
        return True

    def observe(
        self,
        drafted: int,
        accepted: list[int],
        draft_seconds: float,
        verify_seconds: float,
        verified: int | None = None,
    ) -> None:
        """After a round that drafted `drafted` tokens on the draft tier and verified a block of `verified` tokens
        (drafted + 1, or in a plain round with a proposer, its proposals + 1)."""


class AcceptanceDraftLength(DraftLengthSchedule):
    """Double the draft while rounds are fully accepted; after a rejection, aim a little past the accepted run
    (1.5x + 1). A same-model draft often runs tens of tokens, so the schedule climbs there in a few rounds."""

    def __init__(self, config: VeriCacheConfig) -> None:
        super().__init__(config)

    def observe(self, drafted, accepted, draft_seconds, verify_seconds, verified=None) -> None:
        if drafted < self.current or not accepted:
            return  # a draft cut short by the length budget says nothing about how far drafts run
        mean_accepted = sum(accepted) / len(accepted)
        proposal = 2 * drafted if mean_accepted >= drafted else math.ceil(1.5 * mean_accepted) + 1
        self.current = min(self.high, max(self.low, proposal))


class CostAwareDraftLength(DraftLengthSchedule):
    """Pick the length k in {0, min..max} that maximises expected tokens per second,

        E[tokens | k] / (k * draft_step_seconds + verify_seconds(k + 1)),

    where each drafted token is accepted with probability `alpha` (estimated from recent rounds, so
    E = 1 + alpha + ... + alpha^k, the bonus token included), a draft step's time is a running mean, and a verify
    pass's time is a running linear fit in the tokens it checks. k = 0, a plain round, is priced by what plain
    rounds took, measured apart: a one-token pass takes the decode path (no mask, no multi-token attention), which a
    fit over wider passes overestimates (on a 2-core CPU at 2k tokens, 50 ms against a fitted 78 ms). k = 0 wins when
    drafts are rejected early and a draft step costs nearly as much as a full-cache step (a CPU at short context);
    then a plain step is the fastest lossless choice. While k = 0, a short probe draft now and then re-measures
    acceptance, at growing intervals while probes keep failing. On an accelerator the verify pass also pays for
    streaming the full tier, which the fit sees, so long drafts win there, as they should.

    With nothing measured yet, the first round is plain (it costs what a stock step costs, and prices k = 0) and
    the second drafts `draft_length` (it prices drafting); the third is chosen from both. Given a `prior` (what
    earlier calls on the same model and settings measured, see `SchedulePriors`), the first round is chosen from it.
    """

    ACCEPTANCE_DECAY = 0.8  # per drafted round: acceptance follows the text, which changes
    COST_DECAY = 0.95  # per round: costs change slowly (the context grows)
    FIRST_PROBE_AFTER = 16  # plain rounds before the first probe; doubles after each failed probe
    LAST_PROBE_AFTER = 1024
    PROBE_LENGTH = 4
    FREE_AFTER = 64  # a probe interval this long (two probes failed): plain rounds free the draft tier
    #: what a call measured, carried to the next call on the same model and settings (the probe interval too:
    #: probes that kept failing in earlier calls are not repeated at the start of every call)
    ESTIMATES = (
        "accepted",
        "rejections",
        "draft_step",
        "verify",
        "plain_step",
        "plain_gain",
        "plain_width",
        "probe_after",
    )

    def __init__(self, config: VeriCacheConfig, prior: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.first_length = config.draft_length
        self.accepted, self.rejections = 3.0, 1.0  # a weak prior: alpha = 0.75
        self.draft_step = RunningMean(self.COST_DECAY)
        self.verify = RunningLinearFit(self.COST_DECAY)  # passes that check 2 or more tokens
        self.plain_step = RunningMean(self.COST_DECAY)  # a whole plain round without proposals
        # plain rounds with a proposer verify its tokens too: what they gain, and how wide they are
        self.plain_gain, self.plain_width = RunningMean(self.COST_DECAY), RunningMean(self.COST_DECAY)
        self.plain_rounds, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False
        if prior:
            for name in self.ESTIMATES:
                setattr(self, name, copy.deepcopy(prior[name]))
        self.current = self._next(0)

    @property
    def keeps_draft_tier(self) -> bool:
        return self.current > 0 or self.probe_after < self.FREE_AFTER

    def estimates(self) -> dict[str, Any]:
        """A copy of what this schedule measured, for the next call's `prior`."""
        return {name: copy.deepcopy(getattr(self, name)) for name in self.ESTIMATES}

    @property
    def alpha(self) -> float:
        return min(0.999, self.accepted / (self.accepted + self.rejections))

    def observe(self, drafted, accepted, draft_seconds, verify_seconds, verified=None) -> None:
        width = verified or drafted + 1
        if width > 1:
            self.verify.add(width, verify_seconds)
        elif accepted:  # a plain round of one token: the round's whole time, as a stock step's
            self.plain_step.add(draft_seconds + verify_seconds)
        if not drafted and accepted:  # a plain round, with a proposer's tokens verified or (width 1) without
            self.plain_gain.add(sum(accepted) / len(accepted))
            self.plain_width.add(width)
        if drafted and accepted:
            self.draft_step.add(draft_seconds / drafted)
            # a row that took all k drafts was not rejected: it says alpha is high, not how high
            self.accepted = self.ACCEPTANCE_DECAY * self.accepted + sum(accepted)
            self.rejections = self.ACCEPTANCE_DECAY * self.rejections + sum(n < drafted for n in accepted)
        self.current = self._next(drafted)

    def _next(self, drafted: int) -> int:
        if not self.plain_step.weight and not self.plain_width.weight:
            return 0  # price a plain round first: it costs a stock step
        if not self.draft_step.weight:
            return self.first_length  # then price drafting
        best = max([0, *range(self.low, self.high + 1)], key=self.tokens_per_second)
        if best:
            self.plain_rounds, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False
            return best
        if drafted:  # the drafted round just seen did not pay; if it was a probe, wait longer for the next
            if self.probing:
                self.probe_after = min(2 * self.probe_after, self.LAST_PROBE_AFTER)
            self.plain_rounds = 0
        self.probing = False
        self.plain_rounds += 1
        if self.plain_rounds > self.probe_after:
            self.probing = True
            return min(self.high, max(self.low, self.PROBE_LENGTH))
        return 0

    def tokens_per_second(self, k: int) -> float:
        """Expected tokens per row and second for a round that drafts k."""
        if not k:  # a plain round: one token, plus what a proposer's verified tokens added
            width = self.plain_width.value or 1
            seconds = (
                self.plain_step.value
                if width < 1.5 and self.plain_step.weight
                else self.verify.predict(width)
            )
            expected = 1 + self.plain_gain.value
        else:
            expected = (1 - self.alpha ** (k + 1)) / (1 - self.alpha)
            seconds = k * self.draft_step.value + self.verify.predict(k + 1)
        return expected / seconds if seconds > 0 else 0.0


class SchedulePriors:
    """What cost-aware schedules measured, per model and settings (compressor, batch size, context scale, ...), so
    that the next call on them decides its first rounds from measurements instead of exploring: a short answer
    does not pay for exploration. Thread-safe; a model that is deleted takes its priors with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def recall(self, model, key: Hashable) -> dict[str, Any] | None:
        with self._lock:
            return self._by_model.get(model, {}).get(key)

    def remember(self, model, key: Hashable, schedule: DraftLengthSchedule) -> None:
        if isinstance(schedule, CostAwareDraftLength):
            estimates = schedule.estimates()
            with self._lock:
                self._by_model.setdefault(model, {})[key] = estimates

    def forget(self, model=None) -> None:
        """Drop what was measured on `model` (on every model when None)."""
        with self._lock:
            if model is None:
                self._by_model.clear()
            else:
                self._by_model.pop(model, None)


#: The process's priors, shared by every call.
PRIORS = SchedulePriors()


class ProposalLength:
    """How many proposer tokens the next pass checks (hierarchical drafting; one instance for draft-tier passes and
    one for plain rounds, which verify proposals on the full tier): the m in {0..limit} with the most tokens per
    second,

        (1 + beta + ... + beta^m) / pass_seconds(1 + m),

    where `beta` is the measured share of proposed tokens the draft tier keeps (a run: a row's first rejection ends
    it) and a pass's time is a running linear fit in its width, proposer included. A one-token pass (m = 0) is
    priced by one-token passes, measured apart, for the reason `CostAwareDraftLength` prices plain rounds apart.
    The first pass offers nothing and the second `limit`, so both are measured before choosing. m = 0 (the draft
    tier alone) wins when proposals are rarely kept; then a probe now and then re-measures, as in
    `CostAwareDraftLength`. The draft length schedule sees the result as a cheaper draft step, so it drafts longer
    when proposals pay.
    """

    DECAY = 0.9  # per pass: the text changes, and with it what the proposer finds
    FIRST_PROBE_AFTER = 8
    LAST_PROBE_AFTER = 256

    def __init__(self, limit: int, fixed: bool = False) -> None:
        self.limit, self.fixed = limit, fixed  # fixed: always offer `limit` (the fixed draft schedule)
        self.current = limit if fixed else 0  # a pass without proposals first, then one with them
        self.kept, self.rejections = 3.0, 1.0  # a weak prior: beta = 0.75
        self.pass_seconds = RunningLinearFit(self.DECAY)  # passes of 2 or more tokens
        self.single = RunningMean(self.DECAY)  # one-token passes
        self.plain_passes, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False

    @property
    def beta(self) -> float:
        return min(0.999, self.kept / (self.kept + self.rejections))

    def observe(self, width: int, seconds: float, offered: list[int], kept: list[int]) -> None:
        """One draft-tier pass of `width` tokens that took `seconds`; rows were offered and kept these counts."""
        if self.fixed:
            return
        if width > 1:
            self.pass_seconds.add(width, seconds)
        else:
            self.single.add(seconds)
        asked = [(o, k) for o, k in zip(offered, kept, strict=True) if o]
        if asked:
            self.kept = self.DECAY * self.kept + sum(k for _, k in asked)
            self.rejections = self.DECAY * self.rejections + sum(k < o for o, k in asked)
        if not self.single.weight or not self.pass_seconds.n:  # measure both kinds of pass before choosing
            self.current = 0 if not self.single.weight else self.limit
            return
        best = max(range(self.limit + 1), key=self.tokens_per_second)
        if best:
            self.plain_passes, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False
            self.current = best
            return
        if asked and self.probing:
            self.probe_after = min(2 * self.probe_after, self.LAST_PROBE_AFTER)
        self.probing = False
        self.plain_passes += 1
        if self.plain_passes > self.probe_after:
            self.plain_passes, self.probing = 0, True
            self.current = self.limit
        else:
            self.current = 0

    def tokens_per_second(self, m: int) -> float:
        expected = (1 - self.beta ** (m + 1)) / (1 - self.beta)
        seconds = self.single.value if not m and self.single.weight else self.pass_seconds.predict(1 + m)
        return expected / seconds if seconds > 0 else float(m)


class RunningMean:
    """A mean in which each older value weighs `decay` times less."""

    def __init__(self, decay: float) -> None:
        self.decay, self.weight, self.total = decay, 0.0, 0.0

    def add(self, value: float) -> None:
        self.weight = self.decay * self.weight + 1
        self.total = self.decay * self.total + value

    @property
    def value(self) -> float:
        return self.total / self.weight if self.weight else 0.0


class RunningLinearFit:
    """Least squares of y = base + slope * x (slope >= 0), each older point weighing `decay` times less."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def predict(self, x: float) -> float:
        if not self.n:
            return 0.0
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        spread = self.sxx / self.n - mean_x**2
        slope = max(0.0, (self.sxy / self.n - mean_x * mean_y) / spread) if spread > 1e-9 else 0.0
        return max(0.1 * mean_y, mean_y + slope * (x - mean_x))  # no fit says a pass is nearly free


SCHEDULES = {
    "cost_aware": CostAwareDraftLength,
    "adaptive": AcceptanceDraftLength,
    "fixed": DraftLengthSchedule,
}


def draft_length_schedule(
    config: VeriCacheConfig, sampling: bool = False, prior: dict[str, Any] | None = None
) -> DraftLengthSchedule:
    """The schedule `config.draft_schedule` names. `"auto"` is cost-aware under greedy decoding and adaptive under
    sampling: there the draft length decides which random numbers are drawn, so a length that follows the clock
    would make a seeded run unrepeatable (the output distribution would still be exact). `prior` (from
    `SchedulePriors.recall`) starts a cost-aware schedule from earlier calls' measurements."""
    name = config.draft_schedule
    if name == "auto":
        name = "adaptive" if sampling else "cost_aware"
    if name == "cost_aware":
        return CostAwareDraftLength(config, prior)
    return SCHEDULES[name](config)
