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
        commit_seconds: float = 0.0,
        remaining: int | None = None,
        tier_held: bool = True,
        asked: bool = False,
    ) -> None:
        """After a round that drafted `drafted` tokens on the draft tier, verified a block of `verified` tokens
        (drafted + 1, or in a plain round with a proposer, its proposals + 1) and committed what it accepted.
        `remaining` is how many tokens a row may still emit (None: unknown); `tier_held`, whether the draft tier is
        there to draft on now (when not, drafting first pays `observe_build`'s cost); `asked`, whether a plain
        round asked the proposer for tokens to verify (it may have found none)."""

    def observe_build(self, seconds: float) -> None:
        """The draft tier was built (a deferred prefill's, or one freed by plain rounds) in `seconds`."""

    @property
    def build_price(self) -> float | None:
        """What building the draft tier is expected to cost, in seconds (None: not measured yet)."""
        return None

    def affords_build(self, seconds: float, remaining: int | None, draft_share: float | None) -> bool:
        """Before building the draft tier for a drafted round: whether a build of `seconds` is worth paying with
        `remaining` tokens to go; `draft_share` is the share of a plain step a draft step cannot avoid (None:
        unknown). A schedule that always drafts always builds."""
        return True


class AcceptanceDraftLength(DraftLengthSchedule):
    """Double the draft while rounds are fully accepted; after a rejection, aim a little past the accepted run
    (1.5x + 1). A same-model draft often runs tens of tokens, so the schedule climbs there in a few rounds."""

    def observe(self, drafted, accepted, *costs, **horizon) -> None:  # costs and the horizon play no part
        if drafted < self.current or not accepted:
            return  # a draft cut short by the length budget says nothing about how far drafts run
        mean_accepted = sum(accepted) / len(accepted)
        proposal = 2 * drafted if mean_accepted >= drafted else math.ceil(1.5 * mean_accepted) + 1
        self.current = min(self.high, max(self.low, proposal))


class CostAwareDraftLength(DraftLengthSchedule):
    """Pick the length k in {0, min..max} that maximises expected tokens per second,

        E[tokens | k] / (k * draft_step_seconds + verify_seconds(k + 1)),

    where E[tokens | k] = 1 + S(1) + ... + S(k) (the bonus token, then each draft position j reached with the
    measured probability S(j), an `AcceptanceCurve` over recent rounds), a draft step's time is a running mean, and
    a verify pass's time, with the commit of what it accepted into both tiers, is a running linear fit in the tokens
    it checks. A drafted round's predicted time is then scaled by a `Calibration`, measured over predicted seconds
    of the drafted rounds so far, so that a near tie the fits misjudge is settled by what rounds really cost. k = 0,
    a plain round, is priced by what plain rounds took, measured apart: a one-token pass takes the decode path (no
    mask, no multi-token attention), which a fit over wider passes overestimates (on a 2-core CPU at 2k tokens, 50
    ms against a fitted 78 ms). With a proposer, a plain round verifies its tokens when the `plain_gate` (a
    `ProposalLength`) asks for them; k = 0 is then priced as what the gate will do next: the tokens and seconds that
    plain rounds asking for proposals yielded (found or not), or a one-token plain round's, whichever is better (a
    gate that asks now and then to re-measure proposals would otherwise price plain rounds at its probes' cost, and
    the schedule would draft in their place at a loss). Either is measured
    whole, never fitted: at batch 1 on a CPU a pass of 2+ tokens costs 1.6-2x a one-token pass, and a mean width
    between the two (proposals come in bursts) prices neither. k = 0 wins when drafts are rejected early and a draft
    step costs nearly as much as a full-cache step (a CPU at short context); then a plain step is the fastest
    lossless choice. While k = 0, a short probe draft now and then re-measures acceptance, at growing intervals
    while probes keep failing, and only where it can pay (`probe_pays`). On an accelerator the verify pass also pays
    for streaming the full tier, which the fit sees, so long drafts win there, as they should. While drafting leads,
    a plain round now and then (after 16 drafted rounds, then ever more rarely while drafting keeps leading)
    measures the plain price anew: only plain rounds measure it, and a price from another call's prior would
    otherwise never be corrected. A wider pass measured below the plain price shows it stale at once (a one-token
    pass costs no more), and the next round is plain. A call's first round is not timed at all: the first decode
    step after a prefill pays one-off costs. In a batch, the acceptance observed is that of the rows the call
    waits for (`bounding_rows`).

    With nothing measured yet, the first two rounds are plain (they cost what stock steps cost, and the second
    prices k = 0) and the third drafts `draft_length`, at most a probe's length (it prices drafting); the fourth is
    chosen from both. Given a `prior` (what earlier calls on the same model and settings measured, see
    `SchedulePriors`), the first round is chosen from it.
    """

    ACCEPTANCE_DECAY = 0.8  # per drafted round: acceptance follows the text, which changes
    COST_DECAY = 0.95  # per round: costs change slowly (the context grows)
    FIRST_PROBE_AFTER = 16  # plain rounds before the first probe; doubles after each failed probe
    LAST_PROBE_AFTER = 1024
    PROBE_LENGTH = 4
    FREE_AFTER = 64  # a probe interval this long (two probes failed): plain rounds free the draft tier
    # drafted rounds before a plain round re-measures the plain price; doubles each time drafting still leads
    FIRST_PLAIN_PROBE_AFTER = 16
    LAST_PLAIN_PROBE_AFTER = 1024
    #: what a call measured, carried to the next call on the same model and settings (the probe interval too:
    #: probes that kept failing in earlier calls are not repeated at the start of every call)
    ESTIMATES = (
        "acceptance",
        "draft_step",
        "verify",
        "plain_step",
        "offer_tokens",
        "offer_seconds",
        "probe_after",
        "calibration",
        "build",
        "plain_probe_after",
        "drafted_rounds",
    )

    def __init__(
        self,
        config: VeriCacheConfig,
        prior: dict[str, Any] | None = None,
        plain_gate: ProposalLength | None = None,
    ) -> None:
        super().__init__(config)
        self.plain_gate = plain_gate
        # the round that first prices drafting is a probe, no longer: where drafting does not pay (KNorm keeping
        # 1.8 of 8 at 2k tokens, batch 1), eight drafts made that call 1.05x a stock one
        self.first_length = min(config.draft_length, self.probe_length)
        self.acceptance = AcceptanceCurve(self.ACCEPTANCE_DECAY, self.high)
        self.draft_step = RunningMean(self.COST_DECAY)
        self.verify = RunningLinearFit(self.COST_DECAY)  # passes that check 2 or more tokens
        self.plain_step = RunningMean(self.COST_DECAY)  # a whole plain round of one token
        # plain rounds that asked the proposer: tokens per row, and seconds (whole rounds)
        self.offer_tokens, self.offer_seconds = RunningMean(self.COST_DECAY), RunningMean(self.COST_DECAY)
        self.calibration = Calibration(self.COST_DECAY)  # of drafted rounds
        self.build = RunningMean(self.COST_DECAY)  # building the draft tier (deferred, or after a free)
        # of a plain step, the share a draft step cannot avoid (given to `affords_build`)
        self.draft_share: float | None = None
        self.plain_rounds, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False
        # drafted rounds since the plain price was last measured, and when to measure it again (or at once, when a
        # wider pass was measured below it)
        self.drafted_rounds, self.plain_probing, self.plain_stale = 0, False, False
        self.rounds_seen = 0  # in this call
        self.plain_probe_after = self.FIRST_PLAIN_PROBE_AFTER
        if prior:
            for name in self.ESTIMATES:
                setattr(self, name, copy.deepcopy(prior[name]))
        self.current = self._next(0)

    @property
    def probe_length(self) -> int:
        """Drafts in a round that measures drafting anew (`PROBE_LENGTH`, within the bounds)."""
        return min(self.high, max(self.low, self.PROBE_LENGTH))

    @property
    def keeps_draft_tier(self) -> bool:
        return self.current > 0 or self.probe_after < self.FREE_AFTER

    def estimates(self) -> dict[str, Any]:
        """A copy of what this schedule measured, for the next call's `prior`."""
        return {name: copy.deepcopy(getattr(self, name)) for name in self.ESTIMATES}

    def observe(
        self,
        drafted,
        accepted,
        draft_seconds,
        verify_seconds,
        verified=None,
        commit_seconds=0.0,
        remaining=None,
        tier_held=True,
        asked=False,
    ) -> None:
        width = verified or drafted + 1
        # a call's first round pays one-off costs (the first decode step after a prefill ran up to 1.3x a later
        # one at batch 4): it is not timed, or a plain price from it alone would make drafting look cheap
        if self.rounds_seen:
            self._observe_costs(
                drafted, accepted, width, draft_seconds, verify_seconds + commit_seconds, asked
            )
        self.rounds_seen += 1
        if drafted and accepted:
            self.acceptance.add([(drafted, n) for n in accepted])
        self.current = self._next(drafted, remaining, tier_held)

    def _observe_costs(
        self, drafted: int, accepted: list[int], width: int, draft: float, verify: float, asked: bool
    ) -> None:
        """Add one round's times (`verify` with the commit) to the cost model."""
        if drafted and accepted and self.draft_step.weight:  # a round this model priced: how it really went
            self.calibration.add(self.price(drafted)[1], draft + verify)
        if width > 1:
            self.verify.add(width, verify)
            # a one-token pass costs no more than a wider one: a plain price above this pass's time is stale
            self.plain_stale |= bool(self.plain_step.weight) and verify < self.plain_step.value
        elif accepted:  # a plain round of one token: the round's whole time, as a stock step's
            if self.plain_probing:  # measured anew after drafted rounds: the old price may be stale
                self.plain_step = RunningMean(self.COST_DECAY)
            self.plain_step.add(draft + verify)
            self.plain_stale = False
        if not drafted and asked and accepted:  # what plain rounds that ask for proposals yield, found or not
            if self.plain_probing:
                self.offer_tokens = RunningMean(self.COST_DECAY)
                self.offer_seconds = RunningMean(self.COST_DECAY)
            self.offer_tokens.add(1 + sum(accepted) / len(accepted))
            self.offer_seconds.add(draft + verify)
        if drafted and accepted:
            self.draft_step.add(draft / drafted)

    def observe_build(self, seconds: float) -> None:
        self.build.add(seconds)

    @property
    def build_price(self) -> float | None:
        return self.build.value if self.build.weight else None

    def affords_build(self, seconds: float, remaining: int | None, draft_share: float | None) -> bool:
        """A build is paid when drafting may repay it: by `probe_pays` once drafting was measured, before that by
        `may_repay_build`. A declined build's price is kept (the faster of its first two layers' times, per layer, when
        nothing was measured), and rounds stay plain."""
        self.draft_share = draft_share
        if self.draft_step.weight:
            curve = self.acceptance.expectations(self.high)
            pays = self.probe_pays(max(self.current, self.low), remaining, False, curve, seconds)
        else:
            pays = self.may_repay_build(seconds, remaining)
        if not pays:
            if not self.build.weight:
                self.build.add(seconds)
            self.current = 0
        return pays

    def may_repay_build(self, build: float, remaining: int | None) -> bool:
        """Before drafting was ever measured, whether it could save more than a build of `build` seconds over the
        `remaining` tokens. A bound, not a forecast: every draft accepted at the longest length, a verify pass
        costing a one-token plain step, and a draft step only the share of one that does not read the full tier
        (`draft_share`). With SmolLM2-135M in fp32 at 2k tokens and batch 1 that bounds drafting's gain to a seventh
        of the plain time, about 1.4 s over a 128-token answer on a CPU, below HQQ's 4.5 s build; at 8k tokens and
        batch 4 it is nearly three quarters, and the build is paid to price drafting."""
        if remaining is None or self.draft_share is None or not self.plain_step.weight:
            return True
        plain_rate = self.plain_rate
        if plain_rate <= 0:
            return True
        best_rate = (self.high + 1) / ((self.high * self.draft_share + 1) * self.plain_step.value)
        if best_rate <= plain_rate:
            return False
        return most_saved(remaining, plain_rate, best_rate) > build

    def _next(self, drafted: int, remaining: int | None = None, tier_held: bool = True) -> int:
        if not self.price(0)[1]:
            return 0  # price a plain round first: it costs a stock step
        if not self.draft_step.weight:  # then price drafting, unless its tier's build was declined
            if not tier_held and self.build.weight and not self.may_repay_build(self.build.value, remaining):
                return 0
            return self.first_length
        curve = self.acceptance.expectations(self.high)
        best = max([0, *range(self.low, self.high + 1)], key=lambda k: self.tokens_per_second(k, curve))
        if self.plain_probing:  # a plain probe just ran: drafting still leads, or plain rounds take over
            self.plain_probing = False
            self.plain_probe_after = (
                min(2 * self.plain_probe_after, self.LAST_PLAIN_PROBE_AFTER)
                if best
                else self.FIRST_PLAIN_PROBE_AFTER
            )
        if best:
            self.plain_rounds, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False
            self.drafted_rounds += bool(drafted)
            due = self.drafted_rounds >= self.plain_probe_after
            if due or self.plain_stale:
                self.drafted_rounds, self.plain_probing, self.plain_stale = 0, True, False
                return 0  # the plain price is only measured by plain rounds: take one now and then
            return best
        if drafted:  # the drafted round just seen did not pay; if it was a probe, wait longer for the next
            if self.probing:
                self.probe_after = min(2 * self.probe_after, self.LAST_PROBE_AFTER)
            self.plain_rounds = 0
        self.probing = False
        self.plain_rounds += 1
        if self.plain_rounds > self.probe_after and self.probe_pays(
            self.probe_length, remaining, tier_held, curve
        ):
            self.probing = True
            return self.probe_length
        return 0

    def probe_pays(
        self,
        k: int,
        remaining: int | None,
        tier_held: bool,
        curve: list[float],
        build: float | None = None,
    ) -> bool:
        """Whether a probe of k drafts can earn back what it costs: what it loses against plain rounds (its round,
        calibrated, plus building the draft tier when it is not held, less the tokens it is expected to bring) must
        be less than the most that drafting could save over the `remaining` tokens, were every draft accepted (at
        the best length whose verify width was measured, priced by the same fits). Near the end of an answer, or
        where even perfect drafts would barely beat a plain step, a probe cannot pay. `build` prices the build
        (None: the measured price)."""
        if remaining is None:
            return True
        plain_rate = self.plain_rate
        if plain_rate <= 0:
            return True
        factor = self.calibration.factor
        # lengths whose verify width was measured: past the widest, the fit is flat, and a pass of 65 tokens priced
        # as one of 5 makes perfect drafts look far better than they are (a probe of 4 then prices nothing wider)
        shortest = max(1, self.low)
        longest = max(shortest, min(self.high, int(self.verify.most) - 1))
        prices = [(j + 1, self.price(j, curve)[1] * factor) for j in range(shortest, longest + 1)]
        best_rate = max(tokens / seconds if seconds > 0 else float("inf") for tokens, seconds in prices)
        if best_rate <= plain_rate:
            return False  # not even a draft that is always accepted beats a plain step
        expected, seconds = self.price(k, curve)
        cost = seconds * factor + (0.0 if tier_held else self.build.value if build is None else build)
        loss = cost - expected / plain_rate
        return most_saved(remaining, plain_rate, best_rate) > loss

    @property
    def plain_rate(self) -> float:
        """Tokens per row and second of the next plain round, as `price(0)` prices it (0: not measured)."""
        tokens, seconds = self.price(0)
        return tokens / seconds if seconds > 0 else 0.0

    def price(self, k: int, curve: list[float] | None = None) -> tuple[float, float]:
        """The model's expected tokens per row, and seconds, of a round that drafts k (uncalibrated); `curve` is
        `acceptance.expectations(...)`, when already computed."""
        # a plain round: what the next one will do when it asks for proposals, if that beats one token (a gate that
        # asks only to probe must not make drafting look better than a one-token plain round)
        if not k:
            single = 1.0, self.plain_step.value
            if self.offers and self.offer_seconds.weight:
                offer = self.offer_tokens.value, self.offer_seconds.value
                if not self.plain_step.weight or offer[0] * single[1] >= offer[1]:  # offer's rate >= single's
                    return offer
            return single
        expected = curve[k] if curve is not None else self.acceptance.expected(k)
        return expected, k * self.draft_step.value + self.verify.predict(k + 1)

    @property
    def offers(self) -> bool:
        """Whether the next plain round asks the proposer for tokens to verify."""
        return self.plain_gate is not None and self.plain_gate.current > 0

    def tokens_per_second(self, k: int, curve: list[float] | None = None) -> float:
        """Expected tokens per row and second for a round that drafts k, drafted rounds calibrated."""
        expected, seconds = self.price(k, curve)
        seconds *= self.calibration.factor if k else 1.0
        return expected / seconds if seconds > 0 else 0.0


def most_saved(remaining: int, plain_rate: float, best_rate: float) -> float:
    """Seconds that rounds at `best_rate` tokens per second save over `remaining` tokens against plain rounds at
    `plain_rate` (both positive)."""
    return remaining / plain_rate * (1 - plain_rate / best_rate)


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

        E[tokens | m] / pass_seconds(1 + m),

    where E[tokens | m] = 1 + S(1) + ... + S(m), S(j) the measured probability that the draft tier keeps a row's
    j-th proposal (an `AcceptanceCurve`: a row's first rejection ends its run) and a pass's time is a running linear
    fit in its width, proposer included. A one-token pass (m = 0) is priced by one-token passes, measured apart, for
    the reason `CostAwareDraftLength` prices plain rounds apart; a wider pass measured below that price shows it
    stale, and the next pass takes one token to measure it again.

    In a batch, the loop observes each pass as one run of the call (`call_run`): what the rows the call waits for
    were offered and how far the call got, and a pass is as wide as those rows' longest proposals (`widen_for`).
    The curve's gain is scaled by the measured share of wider passes in which every such row was offered
    proposals (at batch 4 on code, often one row in four).

    The first pass a gate sees is not timed (a call's first round, or the first pass on a new draft tier, pays
    one-off costs: 1.5-10x a later pass); the second offers nothing and the third `limit`, so both kinds of pass are
    measured before choosing. m = 0 (the draft tier alone) wins when proposals are rarely kept (passes with
    proposals are priced with a `Calibration`, as `CostAwareDraftLength` prices drafted rounds); then a probe now
    and then re-measures, as in `CostAwareDraftLength`, with `PROBE_LENGTH` proposals. The draft length schedule
    sees the result as a cheaper draft step, so it drafts longer when proposals pay.
    """

    DECAY = 0.9  # per pass: the text changes, and with it what the proposer finds
    FIRST_PROBE_AFTER = 8
    LAST_PROBE_AFTER = 256
    # a probe's proposals: enough to see whether the proposer is right again, in a pass that costs little more
    # than one token (in the loop at batch 4 and 2k tokens on a 2-core CPU, 4 tokens 1.3-1.4x, 11 tokens 2-3x)
    PROBE_LENGTH = 3

    def __init__(self, limit: int, fixed: bool = False) -> None:
        self.limit, self.fixed = limit, fixed  # fixed: always offer `limit` (the fixed draft schedule)
        self.current = limit if fixed else 0  # a pass without proposals first, then one with them
        self.acceptance = AcceptanceCurve(self.DECAY, limit)
        self.pass_seconds = RunningLinearFit(self.DECAY)  # passes of 2 or more tokens
        self.single = RunningMean(self.DECAY)  # one-token passes
        self.calibration = Calibration(self.DECAY)  # of passes that offered proposals
        self.share = RunningMean(self.DECAY)  # of the rows observed, those offered proposals, in wider passes
        self.plain_passes, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False
        self.passes_seen, self.single_stale = 0, False

    def observe(self, width: int, seconds: float, offered: list[int], kept: list[int]) -> None:
        """One pass of `width` tokens that took `seconds`; the live rows were offered and kept these counts."""
        if self.fixed:
            return
        asked = [(o, k) for o, k in zip(offered, kept, strict=True) if o]
        if self.passes_seen:  # the first pass pays one-off costs: its acceptance counts, its time does not
            self._observe_cost(width, seconds, bool(asked))
        self.passes_seen += 1
        if asked:
            self.acceptance.add(asked)
        if width > 1 and offered:  # a pass widened for proposals: how many of these rows had any
            self.share.add(len(asked) / len(offered))
        if not self.single.weight or not self.pass_seconds.n:  # measure both kinds of pass before choosing
            self.current = 0 if not self.single.weight else self.limit
            return
        if self.single_stale:  # the one-token price is above a wider pass: measure it again first
            self.current = 0
            return
        curve = self.acceptance.expectations(self.limit)
        best = max(range(self.limit + 1), key=lambda m: self.tokens_per_second(m, curve))
        if best:
            self.plain_passes, self.probe_after, self.probing = 0, self.FIRST_PROBE_AFTER, False
            self.current = best
            return
        if width > 1 and self.probing:  # a probe that widened a pass and did not pay
            self.probe_after = min(2 * self.probe_after, self.LAST_PROBE_AFTER)
        self.probing = False
        self.plain_passes += 1
        if self.plain_passes > self.probe_after:
            self.plain_passes, self.probing = 0, True
            self.current = min(self.PROBE_LENGTH, self.limit)
        else:
            self.current = 0

    def _observe_cost(self, width: int, seconds: float, asked: bool) -> None:
        if (
            asked and self.pass_seconds.n and self.single.weight
        ):  # a pass this model priced: how it really went
            self.calibration.add(self.price(width - 1)[1], seconds)
        if width > 1:
            self.pass_seconds.add(width, seconds)
            # a one-token pass costs no more than a wider one: a one-token price above this pass's time is stale
            self.single_stale |= bool(self.single.weight) and seconds < self.single.value
            return
        if self.single_stale:  # measured again because it was shown wrong: the old price goes
            self.single, self.single_stale = RunningMean(self.DECAY), False
        self.single.add(seconds)

    def price(self, m: int, curve: list[float] | None = None) -> tuple[float, float]:
        """The model's expected tokens per row, and seconds, of a pass offering m proposals (uncalibrated)."""
        expected = curve[m] if curve is not None else self.acceptance.expected(m)
        if m and self.share.weight:  # rows without proposals gain only their own token
            expected = 1 + self.share.value * (expected - 1)
        seconds = self.single.value if not m and self.single.weight else self.pass_seconds.predict(1 + m)
        return expected, seconds

    def tokens_per_second(self, m: int, curve: list[float] | None = None) -> float:
        expected, seconds = self.price(m, curve)
        seconds *= self.calibration.factor if m else 1.0
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


class AcceptanceCurve:
    """How far drafted runs get: per draft position j, how many rows reached it and how many were rejected there
    (a Kaplan-Meier estimate, each older round weighing `decay` times less). S(j), the chance that a run reaches
    past position j, is the product of (1 - hazard) up to j. One acceptance rate for every position (geometric
    runs) is the special case of a flat hazard; real drafts are often not geometric (a row rejected at its first
    token is often right on the rest of a long run), and a single rate then misprices long drafts. A position with
    few rows behind it leans on the pooled hazard of all positions (which starts from a weak prior of 0.25): past
    the drafts measured, runs are priced as geometric, not as sure."""

    def __init__(self, decay: float, size: int) -> None:
        self.decay = decay
        self.reached, self.rejected = [0.0] * size, [0.0] * size
        self.all_reached, self.all_rejected = 4.0, 1.0  # the prior: a quarter of positions reject

    def add(self, runs: list[tuple[int, int]]) -> None:
        """One round's rows: (drafted, accepted) each, accepted <= drafted."""
        d = self.decay
        self.reached, self.rejected = [d * n for n in self.reached], [d * n for n in self.rejected]
        self.all_reached, self.all_rejected = d * self.all_reached, d * self.all_rejected
        for drafted, accepted in runs:
            reached = min(accepted + 1, drafted, len(self.reached))
            for j in range(reached):
                self.reached[j] += 1
            self.all_reached += min(accepted + 1, drafted)
            if accepted < drafted:
                self.all_rejected += 1
                if accepted < len(self.rejected):
                    self.rejected[accepted] += 1

    def hazards(self, k: int) -> list[float]:
        """The chance a run that reached position j (0-based) is rejected there, for j < k."""
        pooled = self.all_rejected / self.all_reached if self.all_reached > 0 else 0.25
        out = []
        for j in range(k):
            hazard = pooled
            if j < len(self.reached):
                hazard = (self.rejected[j] + pooled) / (self.reached[j] + 1)
            out.append(min(1.0, max(0.001, hazard)))
        return out

    def expectations(self, most: int) -> list[float]:
        """Expected tokens a row gets from a round of k drafts, for k = 0..most: the bonus token plus each position
        reached (one pass over the curve, since the schedule weighs every k each round)."""
        out = [1.0]
        survive = 1.0
        for hazard in self.hazards(most):
            survive *= 1 - hazard
            out.append(out[-1] + survive)
        return out

    def expected(self, k: int) -> float:
        return self.expectations(k)[k]


class Calibration:
    """Measured over predicted seconds of the rounds (or passes) a cost model priced: the ratio of decayed sums,
    pulled toward 1.0 as if `PRIOR_ROUNDS` rounds had cost what was predicted. Prices are scaled by it, which
    corrects what the model's fits leave out (a cost that does not grow linearly with width, a draft step whose
    cost depends on k). Tokens are not calibrated: one round's yield is too noisy (all or nothing) to correct by."""

    PRIOR_ROUNDS = 2.0

    def __init__(self, decay: float) -> None:
        self.predicted, self.measured = RunningMean(decay), RunningMean(decay)

    def add(self, predicted_seconds: float, seconds: float) -> None:
        self.predicted.add(predicted_seconds)
        self.measured.add(seconds)

    @property
    def factor(self) -> float:
        """Measured seconds per predicted second."""
        if self.predicted.value <= 0:
            return 1.0
        weight = self.measured.weight
        ratio = self.measured.value / self.predicted.value
        return (weight * ratio + self.PRIOR_ROUNDS) / (weight + self.PRIOR_ROUNDS)


class RunningLinearFit:
    """Least squares of y = base + slope * x (slope >= 0), each older point weighing `decay` times less.

    Below the least x measured the fit is flat, not extrapolated down: pass time is not linear in width there (on
    a CPU at batch 1, passes of 2-5 tokens cost about what 5 do), and a line through widths 5 and 9 priced a
    3-token pass below a one-token one (65 against 76 ms; it took 134), so a call drafted 2 where no draft paid."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.least, self.most = float("inf"), 0.0  # the least and greatest x measured

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y
        self.least, self.most = min(self.least, x), max(self.most, x)

    def predict(self, x: float) -> float:
        if not self.n:
            return 0.0
        x = max(x, self.least)
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        spread = self.sxx / self.n - mean_x**2
        slope = max(0.0, (self.sxy / self.n - mean_x * mean_y) / spread) if spread > 1e-9 else 0.0
        return max(0.1 * mean_y, mean_y + slope * (x - mean_x))  # no fit says a pass is nearly free


def bounding_rows(left: dict[int, int]) -> list[int]:
    """The rows with the most tokens left (`left`: row -> tokens to emit, or to draft). A batch's rounds, and a
    draft's passes, go on until these rows are done, so what they gain is what the call gains: tokens a row ahead
    gains shorten nothing until it falls behind. Schedules measure yield on these rows (at batch 4 with prompt
    lookup, one row's burst of 10 kept proposals counted as 2.5 tokens a row, while the call still waited on the
    other three)."""
    most = max(left.values(), default=0)
    return [b for b, n in left.items() if n == most]


def call_run(left: dict[int, int], offered: dict[int, int], kept: dict[int, int]) -> tuple[int, int]:
    """A batch's pass as one run for a proposal gate: the proposals each `bounding_rows` row was offered (the
    fewest), and how many the call kept, that is, how far the most tokens any row has `left` fell, past the one
    token every pass yields. A call goes on until its last row is done: a row that keeps 10 while another bound
    row keeps none advances it by nothing yet (at batch 4 on QA, averaged over the bound rows such passes counted
    as 5 a row, and the gate widened passes that slowed the call). The kept tokens show up later, in the passes
    whose bound rows all keep theirs."""
    most = max(left.values())
    after = max(n - 1 - kept[b] for b, n in left.items())
    return min(offered[b] for b in bounding_rows(left)), max(0, most - 1 - after)


SCHEDULES = {
    "cost_aware": CostAwareDraftLength,
    "adaptive": AcceptanceDraftLength,
    "fixed": DraftLengthSchedule,
}


def draft_length_schedule(
    config: VeriCacheConfig,
    sampling: bool = False,
    prior: dict[str, Any] | None = None,
    plain_gate: ProposalLength | None = None,
) -> DraftLengthSchedule:
    """The schedule `config.draft_schedule` names. `"auto"` is cost-aware under greedy decoding and adaptive under
    sampling: there the draft length decides which random numbers are drawn, so a length that follows the clock
    would make a seeded run unrepeatable (the output distribution would still be exact). `prior` (from
    `SchedulePriors.recall`) starts a cost-aware schedule from earlier calls' measurements; `plain_gate` is the
    call's `ProposalLength` for plain rounds, when it has a proposer."""
    name = config.draft_schedule
    if name == "auto":
        name = "adaptive" if sampling else "cost_aware"
    if name == "cost_aware":
        return CostAwareDraftLength(config, prior, plain_gate)
    return SCHEDULES[name](config)
