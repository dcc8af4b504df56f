"""Whether spending time to measure drafting can earn it back: a probe draft while plain rounds lead, or a build
of the draft tier. Both are judged against the most that drafting could save over the tokens still to come, so
near the end of an answer, or where even perfect drafts would barely beat a plain step, nothing is spent."""

from __future__ import annotations

from .round_costs import RoundCosts


class Payoff:
    """Judges probes and builds by a `RoundCosts`' prices, within the draft length's bounds."""

    def __init__(self, costs: RoundCosts, low: int, high: int) -> None:
        self.costs, self.low, self.high = costs, low, high
        # of a plain step, the share a draft step cannot avoid (given with a build to judge)
        self.draft_share: float | None = None

    def may_repay_build(self, build: float, remaining: int | None) -> bool:
        """Before drafting was ever measured, whether it could save more than a build of `build` seconds over the
        `remaining` tokens. A bound, not a forecast: every draft accepted at the longest length, a verify pass
        costing a one-token plain step, and a draft step only the share of one that does not read the full tier
        (`draft_share`). With SmolLM2-135M in fp32 at 2k tokens and batch 1 that bounds drafting's gain to a seventh
        of the plain time, about 1.4 s over a 128-token answer on a CPU, below HQQ's 4.5 s build; at 8k tokens and
        batch 4 it is nearly three quarters, and the build is paid to price drafting."""
        plain = self.costs.plain_step
        if remaining is None or self.draft_share is None or not plain.weight:
            return True
        plain_rate = self.costs.plain_rate
        if plain_rate <= 0:
            return True
        best_rate = (self.high + 1) / ((self.high * self.draft_share + 1) * plain.value)
        if best_rate <= plain_rate:
            return False
        return most_saved(remaining, plain_rate, best_rate) > build

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
        the best length whose verify width was measured, priced by the same fits). `build` prices the build
        (None: the measured price)."""
        if remaining is None:
            return True
        costs = self.costs
        plain_rate = costs.plain_rate
        if plain_rate <= 0:
            return True
        factor = costs.calibration.factor
        # lengths whose verify width was measured: past the widest, the fit is flat, and a pass of 65 tokens priced
        # as one of 5 makes perfect drafts look far better than they are (a probe of 4 then prices nothing wider)
        shortest = max(1, self.low)
        longest = max(shortest, min(self.high, int(costs.verify.most) - 1))
        prices = [(j + 1, costs.price(j, curve)[1] * factor) for j in range(shortest, longest + 1)]
        best_rate = max(tokens / seconds if seconds > 0 else float("inf") for tokens, seconds in prices)
        if best_rate <= plain_rate:
            return False  # not even a draft that is always accepted beats a plain step
        expected, seconds = costs.price(k, curve)
        cost = seconds * factor + (0.0 if tier_held else costs.build.value if build is None else build)
        loss = cost - expected / plain_rate
        return most_saved(remaining, plain_rate, best_rate) > loss


def most_saved(remaining: int, plain_rate: float, best_rate: float) -> float:
    """Seconds that rounds at `best_rate` tokens per second save over `remaining` tokens against plain rounds at
    `plain_rate` (both positive)."""
    return remaining / plain_rate * (1 - plain_rate / best_rate)
