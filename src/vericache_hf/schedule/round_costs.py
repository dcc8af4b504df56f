"""The cost model of a cost-aware draft length: what a round that drafts k tokens is expected to yield and cost,
from what rounds measured.

A round that drafts k yields E[tokens | k] = 1 + S(1) + ... + S(k) per row (the bonus token, then each draft
position j reached with the measured probability S(j), an `AcceptanceCurve` over recent rounds) and costs
k * draft_step_seconds + verify_seconds(k + 1): a draft step's time is a running mean, and a verify pass's time,
with the commit of what it accepted into both tiers, a running linear fit in the tokens it checks. A drafted
round's predicted time is scaled by a `Calibration`, measured over predicted seconds of the drafted rounds so far,
so that a near tie the fits misjudge is settled by what rounds really cost.

k = 0, a plain round, is priced by what plain rounds took, measured apart: a one-token pass takes the decode path
(no mask, no multi-token attention), which a fit over wider passes overestimates (at 2k tokens on a 2-core CPU, 50
ms against a fitted 78 ms). With a proposer, a plain round verifies its tokens when the `plain_gate` (a
`ProposalLength`) asks for them; k = 0 is then priced as what the gate will do next: the tokens and seconds that
plain rounds asking for proposals yielded (found or not), or a one-token plain round's, whichever is better (a gate
that asks now and then to re-measure proposals would otherwise price plain rounds at its probes' cost). Either is
measured whole, never fitted: at batch 1 on a CPU a pass of 2+ tokens costs 1.6-2x a one-token pass, and a mean
width between the two (proposals come in bursts) prices neither.
"""

from __future__ import annotations

from .measures import AcceptanceCurve, Calibration, RunningLinearFit, RunningMean
from .proposal_length import ProposalLength


class RoundCosts:
    """What rounds yield and cost, measured, and the price of a round that drafts k."""

    ACCEPTANCE_DECAY = 0.8  # per drafted round: acceptance follows the text, which changes
    COST_DECAY = 0.95  # per round: costs change slowly (the context grows)
    # the verify fit's slope is shrunk as if two passes 2 tokens either side of the mean width had shown no growth:
    # a schedule believes a steep slope from close widths and never drafts far enough to correct it (at 8k tokens,
    # batch 1, passes of 5 and 7 tokens took 158 and 216 ms, 29 ms a token where passes of 11 and 42 later showed
    # 5, and a call drafted 4 a round for 13 rounds, every draft accepted, at 16 tokens/s where 12-16 gave 19)
    SLOPE_PRIOR = 8.0
    #: what is carried to the next call on the same model and settings
    ESTIMATES = (
        "acceptance",
        "draft_step",
        "verify",
        "plain_step",
        "offer_tokens",
        "offer_seconds",
        "calibration",
        "build",
    )

    def __init__(
        self, high: int, plain_gate: ProposalLength | None = None, draft_gate: ProposalLength | None = None
    ) -> None:
        self.high = high
        self.plain_gate, self.draft_gate = plain_gate, draft_gate
        self.acceptance = AcceptanceCurve(self.ACCEPTANCE_DECAY, high)
        self.draft_step = RunningMean(self.COST_DECAY)
        self.verify = RunningLinearFit(self.COST_DECAY, self.SLOPE_PRIOR)  # passes checking 2 or more tokens
        self.plain_step = RunningMean(self.COST_DECAY)  # a whole plain round of one token
        # plain rounds that asked the proposer: tokens per row, and seconds (whole rounds)
        self.offer_tokens, self.offer_seconds = RunningMean(self.COST_DECAY), RunningMean(self.COST_DECAY)
        self.calibration = Calibration(self.COST_DECAY)  # of drafted rounds
        self.build = RunningMean(self.COST_DECAY)  # building the draft tier (deferred, or after a free)

    def observe(
        self,
        drafted: int,
        accepted: list[int],
        width: int,
        draft: float,
        verify: float,
        asked: bool,
        passes: int | None = None,
        plain_anew: bool = False,
        draft_anew: bool = False,
    ) -> None:
        """Add one round's times (`verify` with the commit). A draft step is a draft pass: with a proposer one
        pass may draft several tokens, which `draft_token_seconds` prices apart. `plain_anew`: the plain price is
        measured afresh (after drafted rounds it may be stale), not averaged into the old one; `draft_anew`: so are
        the draft step, the verify fit and the calibration (after plain rounds they may be)."""
        if draft_anew:
            self.draft_step = RunningMean(self.COST_DECAY)
            self.verify = RunningLinearFit(self.COST_DECAY, self.SLOPE_PRIOR)
            self.calibration = Calibration(self.COST_DECAY)
        if drafted and accepted and self.draft_step.weight:  # a round this model priced: how it really went
            self.calibration.add(self.price(drafted)[1], draft + verify)
        if width > 1:
            self.verify.add(width, verify)
        elif accepted:  # a plain round of one token: the round's whole time, as a stock step's
            if plain_anew:
                self.plain_step = RunningMean(self.COST_DECAY)
            self.plain_step.add(draft + verify)
        if not drafted and asked and accepted:  # what plain rounds that ask for proposals yield, found or not
            if plain_anew:
                self.offer_tokens = RunningMean(self.COST_DECAY)
                self.offer_seconds = RunningMean(self.COST_DECAY)
            self.offer_tokens.add(1 + sum(accepted) / len(accepted))
            self.offer_seconds.add(draft + verify)
        if drafted and accepted:
            self.draft_step.add(draft / (passes or drafted))

    def observe_acceptance(self, drafted: int, accepted: list[int]) -> None:
        """How far each row's draft of `drafted` ran (every round, the first too: acceptance reads no clock)."""
        if drafted and accepted:
            self.acceptance.add([(drafted, n) for n in accepted])

    def shows_plain_stale(self, width: int, verify: float) -> bool:
        """Whether a pass of `width` tokens taking `verify` seconds shows the plain price stale: a one-token pass
        costs no more than a wider one."""
        return width > 1 and bool(self.plain_step.weight) and verify < self.plain_step.value

    def curve(self) -> list[float]:
        """Expected tokens per row of a round drafting 0..high (`price`'s `curve`)."""
        return self.acceptance.expectations(self.high)

    def price(self, k: int, curve: list[float] | None = None) -> tuple[float, float]:
        """The expected tokens per row, and seconds, of a round that drafts k (uncalibrated); `curve` is
        `curve()`, when already computed."""
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
    def plain_rate(self) -> float:
        """Tokens per row and second of the next plain round, as `price(0)` prices it (0: not measured)."""
        tokens, seconds = self.price(0)
        return tokens / seconds if seconds > 0 else 0.0

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
