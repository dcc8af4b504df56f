"""How many tokens to draft next round: fixed, adapted to how far recent drafts ran, or chosen for the most tokens
per second from the measured cost of a draft step and of a verify pass.

Every schedule has `current` (the next round's draft length, 0 = no draft: the round is one plain full-cache step
through the verify pass) and `observe(...)`, called after each round. The length never changes the output, only
the speed: every round is verified against the full cache.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from ..config import VeriCacheConfig
from .exploration import Exploration
from .payoff import Payoff
from .proposal_length import ProposalLength
from .round_costs import RoundCosts


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

    def estimates(self) -> dict[str, Any] | None:
        """What this schedule measured, to start the next call on the same model and settings (`priors.py`);
        None: nothing worth carrying."""
        return None

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
    """Pick the length k in {0, min..max} that maximises expected tokens per second, as `RoundCosts` prices
    rounds; take the rounds `Exploration` asks for to measure what the prices cannot see, where `Payoff` says
    they can pay. k = 0 wins when drafts are rejected early and a draft step costs nearly as much as a full-cache
    step (a CPU at short context); then a plain step is the fastest lossless choice. On an accelerator the verify
    pass also pays for streaming the full tier, which the fit sees, so long drafts win there, as they should. A
    call's first round is not timed at all: the first decode step after a prefill pays one-off costs. In a batch,
    the acceptance observed is that of the rows the call waits for (`bounding_rows`).

    With nothing measured yet, the first two rounds are plain (they cost what stock steps cost, and the second
    prices k = 0) and the third drafts `draft_length`, at most a probe's length (it prices drafting); the fourth is
    chosen from both. Given a `prior` (what earlier calls on the same model and settings measured, see
    `priors.py`), the first round is chosen from it.
    """

    PROBE_LENGTH = 4

    def __init__(
        self,
        config: VeriCacheConfig,
        prior: dict[str, Any] | None = None,
        plain_gate: ProposalLength | None = None,
        draft_gate: ProposalLength | None = None,
    ) -> None:
        super().__init__(config)
        self.costs = RoundCosts(self.high, plain_gate, draft_gate)
        self.exploration = Exploration()
        self.payoff = Payoff(self.costs, self.low, self.high)
        # the round that first prices drafting drafts a probe's length at most: where drafting does not pay
        # (KNorm keeping 1.8 of 8 at 2k tokens, batch 1), eight drafts made that call 1.05x a stock one
        self.first_length = min(config.draft_length, self.probe_length)
        self.rounds_seen = 0  # in this call
        if prior:
            for part in (self.costs, self.exploration):
                for name in part.ESTIMATES:
                    setattr(part, name, copy.deepcopy(prior[name]))
        self.current = self._next(0)

    @property
    def probe_length(self) -> int:
        """Drafts in a round that measures drafting anew (`PROBE_LENGTH`, within the bounds)."""
        return min(self.high, max(self.low, self.PROBE_LENGTH))

    @property
    def keeps_draft_tier(self) -> bool:
        return self.current > 0 or not self.exploration.frees_draft_tier

    def estimates(self) -> dict[str, Any]:
        """A copy of what this schedule measured, for the next call's `prior`."""
        return {
            name: copy.deepcopy(getattr(part, name))
            for part in (self.costs, self.exploration)
            for name in part.ESTIMATES
        }

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
        verify = verify_seconds + commit_seconds
        # a call's first round pays one-off costs (the first decode step after a prefill ran up to 1.3x a later
        # one at batch 4): it is not timed, or a plain price from it alone would make drafting look cheap
        if self.rounds_seen:
            below = self.costs.shows_plain_stale(width, verify)
            exploration = self.exploration
            anew = dict(
                plain_anew=exploration.plain_probing, draft_anew=exploration.remeasuring and drafted > 0
            )
            self.costs.observe(drafted, accepted, width, draft_seconds, verify, asked, passes, **anew)
            self.exploration.note_pass(width, accepted, below)
        self.rounds_seen += 1
        self.costs.observe_acceptance(drafted, accepted)
        self.current = self._next(drafted, remaining, tier_held)

    def observe_build(self, seconds: float) -> None:
        self.costs.build.add(seconds)

    @property
    def build_price(self) -> float | None:
        build = self.costs.build
        return build.value if build.weight else None

    def affords_build(self, seconds: float, remaining: int | None, draft_share: float | None) -> bool:
        """A build is paid when drafting may repay it (`Payoff`): by `probe_pays` once drafting was measured,
        before that by `may_repay_build`. A declined build's price is kept (the faster of its first two layers'
        times, per layer, when nothing was measured), and rounds stay plain."""
        costs, payoff = self.costs, self.payoff
        payoff.draft_share = draft_share
        if costs.draft_step.weight:
            pays = payoff.probe_pays(max(self.current, self.low), remaining, False, costs.curve(), seconds)
        else:
            pays = payoff.may_repay_build(seconds, remaining)
        if not pays:
            if not costs.build.weight:
                costs.build.add(seconds)
            self.current = 0
        return pays

    def _next(self, drafted: int, remaining: int | None = None, tier_held: bool = True) -> int:
        costs = self.costs
        if not costs.price(0)[1]:
            return 0  # price a plain round first: it costs a stock step
        if not costs.draft_step.weight:  # then price drafting, unless its tier's build was declined
            build = costs.build
            if not tier_held and build.weight and not self.payoff.may_repay_build(build.value, remaining):
                return 0
            return self.first_length
        curve = costs.curve()
        best = max([0, *range(self.low, self.high + 1)], key=lambda k: costs.tokens_per_second(k, curve))
        if best:
            return 0 if self.exploration.drafting_leads(drafted) else best
        exploration, k = self.exploration, self.probe_length
        if not exploration.plain_leads(drafted):
            return 0
        if self.payoff.probe_pays(k, remaining, tier_held, curve):
            exploration.start_probe()
            return k
        # the veto rests on draft prices no plain round updates: where drafts run through, they are measured anew
        # now and then, so one slow drafted round cannot keep a long call plain
        horizon = remaining is None or remaining > exploration.FIRST_PROBE_AFTER
        if tier_held and horizon and exploration.remeasure_due and curve[k] >= (k + 1) / 2:
            exploration.start_remeasure()
            return k
        return 0


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
    `priors_for(model).recall`) starts a cost-aware schedule from earlier calls' measurements; `plain_gate` and
    `draft_gate` are the call's `ProposalLength`s for plain rounds and draft-tier passes, when it has a proposer."""
    name = config.draft_schedule
    if name == "auto":
        name = "adaptive" if sampling else "cost_aware"
    if name == "cost_aware":
        return CostAwareDraftLength(config, prior, plain_gate, draft_gate)
    return SCHEDULES[name](config)
