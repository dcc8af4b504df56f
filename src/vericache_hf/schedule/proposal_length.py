"""How many proposer tokens a pass checks (hierarchical drafting), and how a batch's pass counts as one run of the
call for that choice."""

from __future__ import annotations

from .measures import AcceptanceCurve, Calibration, RunningLinearFit, RunningMean


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
