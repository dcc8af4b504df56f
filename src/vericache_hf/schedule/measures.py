"""Running measurements the schedules decide from: decayed means, a decayed linear fit of pass time in width, a
calibration of predicted against measured seconds, and an acceptance curve of how far drafted runs get. Each older
value weighs less, because costs drift as the context grows and acceptance follows the text."""

from __future__ import annotations


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
    3-token pass below a one-token one (65 against 76 ms; it took 134), so a call drafted 2 where no draft paid.

    With `slope_prior` > 0 the slope is shrunk toward flat (ridge regression), as if passes spreading that much,
    summed (x - mean x) ** 2 over passes, had shown no growth: a slope from few, close widths is then mostly
    flat, and one from widths far apart is the data's own. What a fit is used to choose decides whether it needs
    one (`CostAwareDraftLength.SLOPE_PRIOR`)."""

    def __init__(self, decay: float, slope_prior: float = 0.0) -> None:
        self.decay, self.slope_prior = decay, slope_prior
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
        spread = self.sxx - self.n * mean_x**2 + self.slope_prior  # summed, not averaged, over the passes
        slope = max(0.0, (self.sxy - self.n * mean_x * mean_y) / spread) if spread > 1e-9 else 0.0
        return max(0.1 * mean_y, mean_y + slope * (x - mean_x))  # no fit says a pass is nearly free
