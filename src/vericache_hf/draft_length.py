"""How many tokens to draft next round: fixed, adapted to how far recent drafts ran, or chosen for the most tokens
per second from the measured cost of a draft step and of a verify pass.

Every schedule has `current` (the next round's draft length, 0 = no draft: the round is one plain full-cache step
through the verify pass) and `observe(...)`, called after each round. The length never changes the output, only
the speed: every round is verified against the full cache.
"""

from __future__ import annotations

import math

from .config import VeriCacheConfig


class DraftLengthSchedule:
    """The interface every schedule has, and the fixed schedule: the same length every round."""

    def __init__(self, config: VeriCacheConfig) -> None:
        self.current = config.draft_length
        self.low, self.high = config.min_draft_length, config.max_draft_length

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
    pass's time is a running linear fit in the tokens it checks. k = 0 wins when drafts are rejected early and a
    draft step costs nearly as much as a full-cache step (a CPU at short context); then a plain step is the fastest
    lossless choice. While k = 0, a short probe draft now and then re-measures acceptance, at growing intervals
    while probes keep failing. On an accelerator the verify pass also pays for streaming the full tier, which the fit
    sees, so long drafts win there, as they should.
    """

    ACCEPTANCE_DECAY = 0.8  # per drafted round: acceptance follows the text, which changes
    COST_DECAY = 0.95  # per round: costs change slowly (the context grows)
    FIRST_PROBE_AFTER = 16  # plain rounds before the first probe; doubles after each failed probe
    LAST_PROBE_AFTER = 1024
    PROBE_LENGTH = 4

    def __init__(self, config: VeriCacheConfig) -> None:
        super().__init__(config)
        self.accepted, self.rejections = 3.0, 1.0  # a weak prior: alpha = 0.75
        self.draft_step = RunningMean(self.COST_DECAY)
        self.verify = RunningLinearFit(self.COST_DECAY)
        self.plain_rounds, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False
        # plain rounds with a proposer verify its tokens too: what they gain, and how wide they are
        self.plain_gain, self.plain_width = RunningMean(self.COST_DECAY), RunningMean(self.COST_DECAY)

    @property
    def alpha(self) -> float:
        return min(0.999, self.accepted / (self.accepted + self.rejections))

    def observe(self, drafted, accepted, draft_seconds, verify_seconds, verified=None) -> None:
        width = verified or drafted + 1
        self.verify.add(width, verify_seconds)
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
            expected, seconds = 1 + self.plain_gain.value, self.verify.predict(self.plain_width.value or 1)
        else:
            expected = (1 - self.alpha ** (k + 1)) / (1 - self.alpha)
            seconds = k * self.draft_step.value + self.verify.predict(k + 1)
        return expected / seconds if seconds > 0 else 0.0


class ProposalLength:
    """How many proposer tokens the next pass checks (hierarchical drafting; one instance for draft-tier passes and
    one for plain rounds, which verify proposals on the full tier): the m in {0..limit} with the most tokens per
    second,

        (1 + beta + ... + beta^m) / pass_seconds(1 + m),

    where `beta` is the measured share of proposed tokens the draft tier keeps (a run: a row's first rejection ends
    it) and a pass's time is a running linear fit in its width, proposer included. m = 0 (the draft tier alone)
    wins when proposals are rarely kept; then a probe now and then re-measures, as in `CostAwareDraftLength`.
    The draft length schedule sees the result as a cheaper draft step, so it drafts longer when proposals pay.
    """

    DECAY = 0.9  # per pass: the text changes, and with it what the proposer finds
    FIRST_PROBE_AFTER = 8
    LAST_PROBE_AFTER = 256

    def __init__(self, limit: int, fixed: bool = False) -> None:
        self.limit, self.fixed = limit, fixed  # fixed: always offer `limit` (the fixed draft schedule)
        self.current = limit  # try proposals first: they are measured at once
        self.kept, self.rejections = 3.0, 1.0  # a weak prior: beta = 0.75
        self.pass_seconds = RunningLinearFit(self.DECAY)
        self.plain_passes, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False

    @property
    def beta(self) -> float:
        return min(0.999, self.kept / (self.kept + self.rejections))

    def observe(self, width: int, seconds: float, offered: list[int], kept: list[int]) -> None:
        """One draft-tier pass of `width` tokens that took `seconds`; rows were offered and kept these counts."""
        if self.fixed:
            return
        self.pass_seconds.add(width, seconds)
        asked = [(o, k) for o, k in zip(offered, kept, strict=True) if o]
        if asked:
            self.kept = self.DECAY * self.kept + sum(k for _, k in asked)
            self.rejections = self.DECAY * self.rejections + sum(k < o for o, k in asked)
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
        seconds = self.pass_seconds.predict(1 + m)
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


def draft_length_schedule(config: VeriCacheConfig, sampling: bool = False) -> DraftLengthSchedule:
    """The schedule `config.draft_schedule` names. `"auto"` is cost-aware under greedy decoding and adaptive under
    sampling: there the draft length decides which random numbers are drawn, so a length that follows the clock
    would make a seeded run unrepeatable (the output distribution would still be exact)."""
    name = config.draft_schedule
    if name == "auto":
        name = "adaptive" if sampling else "cost_aware"
    return SCHEDULES[name](config)
