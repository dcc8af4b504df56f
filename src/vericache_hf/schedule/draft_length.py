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

from ..config import VeriCacheConfig
from .measures import AcceptanceCurve, Calibration, RunningLinearFit, RunningMean
from .proposal_length import ProposalLength


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
        passes: int | None = None,
    ) -> None:
        """After a round that drafted `drafted` tokens on the draft tier in `passes` passes (None: one a token),
        verified a block of `verified` tokens
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
    # the verify fit's slope is shrunk as if two passes 2 tokens either side of the mean width had shown no growth:
    # a schedule believes a steep slope from close widths and never drafts far enough to correct it (at 8k tokens,
    # batch 1, passes of 5 and 7 tokens took 158 and 216 ms, 29 ms a token where passes of 11 and 42 later showed
    # 5, and a call drafted 4 a round for 13 rounds, every draft accepted, at 16 tokens/s where 12-16 gave 19)
    SLOPE_PRIOR = 8.0
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
        draft_gate: ProposalLength | None = None,
    ) -> None:
        super().__init__(config)
        self.plain_gate, self.draft_gate = plain_gate, draft_gate
        # the round that first prices drafting drafts a probe's length at most: where drafting does not pay
        # (KNorm keeping 1.8 of 8 at 2k tokens, batch 1), eight drafts made that call 1.05x a stock one
        self.first_length = min(config.draft_length, self.probe_length)
        self.acceptance = AcceptanceCurve(self.ACCEPTANCE_DECAY, self.high)
        self.draft_step = RunningMean(self.COST_DECAY)
        self.verify = RunningLinearFit(self.COST_DECAY, self.SLOPE_PRIOR)  # passes checking 2 or more tokens
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
        passes=None,
    ) -> None:
        width = verified or drafted + 1
        # a call's first round pays one-off costs (the first decode step after a prefill ran up to 1.3x a later
        # one at batch 4): it is not timed, or a plain price from it alone would make drafting look cheap
        if self.rounds_seen:
            self._observe_costs(
                drafted, accepted, width, draft_seconds, verify_seconds + commit_seconds, asked, passes
            )
        self.rounds_seen += 1
        if drafted and accepted:
            self.acceptance.add([(drafted, n) for n in accepted])
        self.current = self._next(drafted, remaining, tier_held)

    def _observe_costs(
        self,
        drafted: int,
        accepted: list[int],
        width: int,
        draft: float,
        verify: float,
        asked: bool,
        passes: int | None = None,
    ) -> None:
        """Add one round's times (`verify` with the commit) to the cost model. A draft step is a draft pass: with
        a proposer one pass may draft several tokens, which `draft_token_seconds` prices apart."""
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
            self.draft_step.add(draft / (passes or drafted))

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
        return expected, k * self.draft_token_seconds + self.verify.predict(k + 1)

    @property
    def draft_token_seconds(self) -> float:
        """What one drafted token is expected to cost in the next round. Drafting alone: a draft step, measured
        over drafted rounds. With a proposer whose draft-tier gate (`draft_gate`) has priced its passes: the
        seconds per token of the passes it will run next, by its own model (one-token passes when proposals do
        not pay, else passes of 1 + m tokens yielding what the rows the call waits for keep). A round's drafted
        tokens over its draft time would price it by the proposals the last rounds happened to keep: on code at 2k
        tokens and batch 4, one round whose rows all kept 10 priced a draft step at a third, and the next drafted
        24 and was rejected within 7."""
        gate = self.draft_gate
        if gate is None or gate.fixed or not (gate.single.weight and gate.pass_seconds.n):
            return self.draft_step.value
        rate = gate.tokens_per_second(gate.current)
        return 1.0 / rate if rate > 0 else self.draft_step.value

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
    draft_gate: ProposalLength | None = None,
) -> DraftLengthSchedule:
    """The schedule `config.draft_schedule` names. `"auto"` is cost-aware under greedy decoding and adaptive under
    sampling: there the draft length decides which random numbers are drawn, so a length that follows the clock
    would make a seeded run unrepeatable (the output distribution would still be exact). `prior` (from
    `SchedulePriors.recall`) starts a cost-aware schedule from earlier calls' measurements; `plain_gate` and
    `draft_gate` are the call's `ProposalLength`s for plain rounds and draft-tier passes, when it has a proposer."""
    name = config.draft_schedule
    if name == "auto":
        name = "adaptive" if sampling else "cost_aware"
    if name == "cost_aware":
        return CostAwareDraftLength(config, prior, plain_gate, draft_gate)
    return SCHEDULES[name](config)
