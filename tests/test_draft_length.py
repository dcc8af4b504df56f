"""The draft-length schedules, driven round by round as the decoding loop drives them, with simulated acceptance and
step costs (no clock): the cost-aware one drafts long when drafting pays, steps plainly when it does not, and
probes its way back."""

from __future__ import annotations

from itertools import pairwise

import pytest

from vericache_hf import VeriCacheConfig
from vericache_hf.schedule import priors_for
from vericache_hf.schedule.draft_length import (
    AcceptanceDraftLength,
    CostAwareDraftLength,
    DraftLengthSchedule,
    draft_length_schedule,
)
from vericache_hf.schedule.exploration import Exploration
from vericache_hf.schedule.measures import AcceptanceCurve, Calibration, RunningLinearFit
from vericache_hf.schedule.proposal_length import ProposalLength, bounding_rows, call_run
from vericache_hf.schedule.round_costs import RoundCosts

from .conftest import random_prompt


def drive(
    schedule,
    rounds: int,
    accept_run: int,
    draft_step: float,
    verify_base: float,
    verify_per_token=0.0,
    plain_step: float | None = None,
):
    """Run `rounds` rounds in which every row of 2 accepts `accept_run` drafts (capped by the draft length). A
    verify pass of w tokens costs `verify_base + verify_per_token * w`, a plain round `plain_step` when given.
    Returns the draft length of each round."""

    def verify(width: int) -> float:
        return verify_base + verify_per_token * width

    plain = verify(1) if plain_step is None else plain_step
    return run_plain_prices(schedule, rounds, draft_step, [plain], verify, accept_run)


def run_plain_prices(schedule, rounds, draft_step, plain_prices, verify, accept_run=3) -> list[int]:
    """Rounds whose plain rounds take `plain_prices[i]` seconds, the i-th plain round of the call (the last price
    from then on), and whose verify pass of w tokens takes `verify(w)`. Returns the draft length of each round."""
    lengths = []
    for _ in range(rounds):
        k = schedule.current
        plain = sum(not n for n in lengths)
        lengths.append(k)
        seconds = plain_prices[min(plain, len(plain_prices) - 1)] if not k else verify(k + 1)
        schedule.observe(k, [min(k, accept_run)] * 2, k * draft_step, seconds)
    return lengths


def test_config_names_the_schedule():
    assert type(draft_length_schedule(VeriCacheConfig(draft_schedule="fixed"))) is DraftLengthSchedule
    assert type(draft_length_schedule(VeriCacheConfig(draft_schedule="adaptive"))) is AcceptanceDraftLength
    assert type(draft_length_schedule(VeriCacheConfig(draft_schedule="cost_aware"))) is CostAwareDraftLength
    auto = VeriCacheConfig(draft_schedule="auto")
    assert type(draft_length_schedule(auto)) is CostAwareDraftLength
    # under sampling the length stays off the clock, so a seed repeats a run
    assert type(draft_length_schedule(auto, sampling=True)) is AcceptanceDraftLength


def test_cost_aware_drafts_long_when_drafts_are_cheap_and_accepted():
    # a GPU at long context: a draft step is a tenth of a verify pass, which streams the full tier
    lengths = drive(CostAwareDraftLength(VeriCacheConfig()), 30, 10_000, draft_step=0.01, verify_base=0.1)
    drafted = [k for k in lengths[10:] if k]
    # every round drafts at least 32 but one plain round, which measures the plain price anew
    assert min(drafted) >= 32 and len(drafted) >= len(lengths[10:]) - 1
    assert lengths[-1] == 64  # max_draft_length


def test_cost_aware_steps_plainly_when_drafts_miss_and_cost_as_much_as_a_step():
    # a CPU at short context: a draft step costs 80% of a full step, and drafts are rejected after one token
    schedule = CostAwareDraftLength(VeriCacheConfig())
    lengths = drive(schedule, 300, 1, draft_step=0.06, verify_base=0.072, verify_per_token=0.003)
    probes = [i for i, k in enumerate(lengths) if i > 5 and k]
    assert lengths[3:10] == [0] * 7
    assert sum(k == 0 for k in lengths) > 0.95 * len(lengths)
    gaps = [b - a for a, b in pairwise(probes)]
    assert probes and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # probes come, ever more rarely
    assert all(lengths[i] == CostAwareDraftLength.PROBE_LENGTH for i in probes)


def test_a_call_s_first_round_is_not_timed():
    """The first round after a prefill pays one-off costs (at batch 4, up to 1.3x a later round). Priced from it, a
    plain round looked dearer than drafting that costs what a plain round does, and the call drafted. Untimed, it
    is followed by a second plain round that prices plain rounds: drafting is tried once and plain rounds win."""
    schedule = CostAwareDraftLength(VeriCacheConfig())
    lengths = run_plain_prices(schedule, 100, 0.025, [0.05, 0.025], lambda w: 0.02 + 0.002 * w)
    assert lengths[:4] == [0, 0, CostAwareDraftLength.PROBE_LENGTH, 0]
    assert sum(k > 0 for k in lengths) < 0.05 * len(lengths)  # the first draft, then only probes


def test_a_plain_price_above_a_wider_pass_is_measured_again_at_once():
    """A one-token pass costs no more than a wider one: when a verify pass of 3 drafts took less than the plain
    price, that price is stale (a slow round), and the next round is plain, to measure it anew."""
    schedule = CostAwareDraftLength(VeriCacheConfig())
    lengths = run_plain_prices(schedule, 100, 0.025, [0.05, 0.05, 0.025], lambda w: 0.02 + 0.002 * w)
    first_drafted = next(i for i, k in enumerate(lengths) if k)
    back_to_plain = next(i for i, k in enumerate(lengths) if i > first_drafted and not k)
    assert back_to_plain <= first_drafted + 3
    assert sum(k > 0 for k in lengths[back_to_plain:]) < 0.1 * len(lengths[back_to_plain:])


def test_a_stale_plain_price_is_measured_again_while_drafting_leads():
    """A plain price twice the true one, where no verify pass shows it stale (each costs more than it): drafting
    looked ahead, and a plain round after 16 drafted rounds finds the true price; plain rounds take over. Where
    drafting pays by far, such plain rounds come ever more rarely."""
    # 3 drafts, all accepted: 4 tokens in 0.089 s (45 a second), against 20 a second at the stale plain price and
    # 50 at the true one
    schedule = CostAwareDraftLength(VeriCacheConfig())
    lengths = run_plain_prices(schedule, 100, 0.01, [0.05, 0.05, 0.02], lambda w: 0.055 + 0.001 * w)
    first_drafted = next(i for i, k in enumerate(lengths) if k)
    back_to_plain = next(i for i, k in enumerate(lengths) if i > first_drafted and not k)
    assert 10 < back_to_plain - first_drafted <= 20  # about 16 drafted rounds, then the plain probe
    assert sum(k == 0 for k in lengths[back_to_plain:]) > 0.9 * len(lengths[back_to_plain:])
    # drafts run through and cost a twenty-fifth of a plain round: plain probes at 16, 32, 64, ... drafted rounds
    schedule = CostAwareDraftLength(VeriCacheConfig())
    lengths = run_plain_prices(schedule, 300, 0.001, [0.025], lambda w: 0.02 + 0.002 * w, accept_run=10_000)
    plain = [i for i, k in enumerate(lengths) if i > 1 and not k]
    assert 2 <= len(plain) <= 4 and all(b - a > 20 for a, b in pairwise(plain))
    assert schedule.exploration.plain_probe_after > Exploration.FIRST_PLAIN_PROBE_AFTER


def probes(
    schedule, rounds: int, draft_step: float, plain_step: float, tokens: int, tier_held=True
) -> list[int]:
    """Rounds (indices) that drafted, in a call of `tokens` tokens whose drafts are rejected after one token, with
    the loop's `remaining` and `tier_held` passed as the loop passes them."""
    drafted, emitted = [], 0
    for i in range(rounds):
        k = schedule.current
        accepted = [min(k, 1)] * 2
        emitted += accepted[0] + 1
        verify = plain_step if not k else 0.012 + 0.003 * (k + 1)
        schedule.observe(
            k, accepted, k * draft_step, verify, remaining=max(0, tokens - emitted), tier_held=tier_held
        )
        if k:
            drafted.append(i)
    return drafted


def test_a_probe_comes_only_where_it_can_pay():
    """A probe must be able to earn back its cost over the tokens left: not where a draft step costs what a plain
    round does (not even drafts that always run through would beat it), not near the end of an answer, and not
    where rebuilding a freed draft tier costs more than drafting could ever save."""
    # a draft step at a quarter, two thirds, or all of a plain round's 0.012 s
    cheap, middling, dear = 0.003, 0.008, 0.012
    # perfect drafts would pay: probes come through a long answer
    for step in (cheap, middling):
        assert len(probes(CostAwareDraftLength(VeriCacheConfig()), 300, step, 0.012, tokens=10_000)) > 3
    # a draft step that costs a plain round: after the first drafted round, no probe at all
    assert probes(CostAwareDraftLength(VeriCacheConfig()), 300, dear, 0.012, tokens=10_000) == [2]
    # near the end of an answer: of 30 tokens, the 11 left after 16 plain rounds cannot repay a probe
    schedule = CostAwareDraftLength(VeriCacheConfig())
    assert probes(schedule, 30, middling, 0.012, tokens=30) == [2]
    assert schedule.payoff.probe_pays(4, 10_000, True, schedule.costs.curve())
    # a freed tier whose rebuild takes 30 s: no probe, where the same schedule with the tier held would
    schedule = CostAwareDraftLength(VeriCacheConfig())
    schedule.observe_build(30.0)
    assert probes(schedule, 300, cheap, 0.012, tokens=2_000, tier_held=False) == [2]
    assert len(probes(CostAwareDraftLength(VeriCacheConfig()), 300, cheap, 0.012, tokens=2_000)) > 3


def test_cost_aware_returns_to_drafting_when_a_probe_runs_through():
    # a draft step at 30% of a verify pass: drafting pays only while drafts are accepted
    schedule = CostAwareDraftLength(VeriCacheConfig())
    costs = dict(draft_step=0.03, verify_base=0.1, verify_per_token=0.002)
    assert drive(schedule, 40, 0, **costs)[-10:] == [0] * 10
    lengths = drive(schedule, 60, 10_000, **costs)  # the text turned predictable
    assert lengths[-1] >= 16


def test_cost_aware_prices_plain_then_drafting_before_choosing():
    # the call's first round is not timed: a second plain round prices plain rounds; drafting is priced by a
    # probe's length, not `draft_length` (a call where drafting does not pay loses less finding out), and where
    # every draft is accepted the next drafted round goes past it at once
    schedule = CostAwareDraftLength(VeriCacheConfig(draft_length=8))
    lengths = drive(schedule, 4, 10_000, draft_step=0.01, verify_base=0.1)
    assert lengths[:3] == [0, 0, CostAwareDraftLength.PROBE_LENGTH]
    assert lengths[3] > CostAwareDraftLength.PROBE_LENGTH


def test_a_plain_round_is_priced_by_plain_rounds_not_by_wider_passes():
    # A 2-core CPU at 2k tokens: a one-token pass takes the decode path (50 ms) while passes of 3-9 tokens cost
    # 75 ms and more, so a fit over them prices a plain round far too high. Drafts run 2 tokens, a draft step
    # costs 40 ms: drafting loses (3 tokens in 158 ms against 3 in 150 ms).
    schedule = CostAwareDraftLength(VeriCacheConfig())
    lengths = drive(
        schedule, 200, 2, draft_step=0.04, verify_base=0.075, verify_per_token=0.001, plain_step=0.05
    )
    assert sum(k == 0 for k in lengths) > 0.9 * len(lengths)
    assert schedule.costs.tokens_per_second(0) == pytest.approx(1 / 0.05)


def test_a_plain_round_with_a_proposer_is_priced_as_the_plain_gate_will_run_it():
    # Batch 1 on a 2-core CPU at 2k tokens with prompt lookup (a traced composed call): a one-token pass
    # takes 75 ms, a pass verifying 10 proposals 140 ms; a draft step costs as much as a one-token pass, and a
    # drafted round's verify pass, committing into both tiers, 180 ms and more. One plain round in 3 finds 10
    # proposals and keeps 1. Drafts are always accepted, yet a plain round that asks for proposals yields 1.33
    # tokens in 97 ms on average, more than any draft length. Priced by a fit over wide passes at the plain
    # rounds' mean width, plain rounds made 6.5 tokens a second and the schedule drafted in 297 rounds of 300.
    gate = ProposalLength(limit=10)
    schedule = CostAwareDraftLength(VeriCacheConfig(), plain_gate=gate)
    lengths, tokens, seconds = [], 0, 0.0
    for i in range(300):
        k = schedule.current
        lengths.append(k)
        if k:
            verify = 0.18 + 0.01 * (k + 1)
            schedule.observe(k, [k], 0.075 * k, verify, verified=k + 1)
            tokens, seconds = tokens + k + 1, seconds + 0.075 * k + verify
            continue
        asked = gate.current > 0
        m = gate.current if asked and i % 3 == 0 else 0
        kept, took = min(m, 1), 0.14 if m else 0.075
        gate.observe(1 + m, took, [m], [kept])
        schedule.observe(0, [kept], 0.0, took, verified=1 + m, asked=asked)
        tokens, seconds = tokens + kept + 1, seconds + took
    assert sum(k > 0 for k in lengths) < 0.05 * len(lengths)
    assert tokens / seconds > 1 / 0.075  # proposals verified on the full tier beat plain rounds alone
    assert schedule.costs.tokens_per_second(0) == pytest.approx(tokens / seconds, rel=0.1)
    gate.current = 0  # the next plain round will not ask: one token at the one-token price
    assert schedule.costs.tokens_per_second(0) == pytest.approx(1 / schedule.costs.plain_step.value)


def test_the_next_call_starts_from_what_the_last_one_measured():
    config = VeriCacheConfig()
    # where drafting pays (a GPU at long context), the next call drafts long from its first round
    fast = CostAwareDraftLength(config)
    drive(fast, 30, 10_000, draft_step=0.01, verify_base=0.1)
    assert CostAwareDraftLength(config, fast.estimates()).current >= 32
    # where it does not, the next call steps plainly from its first round, and probes no sooner than the last did
    slow = CostAwareDraftLength(config)
    drive(slow, 300, 1, draft_step=0.06, verify_base=0.072, verify_per_token=0.003)
    assert slow.exploration.probe_after >= 64 > Exploration.FIRST_PROBE_AFTER
    prior = slow.estimates()
    remembered = prior["plain_step"].total
    after = CostAwareDraftLength(config, prior)
    lengths = drive(after, 60, 1, draft_step=0.06, verify_base=0.072, verify_per_token=0.003)
    assert lengths == [0] * 60  # a fresh schedule would have probed after 16 plain rounds
    assert prior["plain_step"].total == remembered  # the next call measures on a copy


def test_priors_are_kept_per_model_and_settings(llama):
    from vericache_hf.decoding import _schedule_key

    ids = random_prompt(40)
    config = VeriCacheConfig(compressor="streaming_llm", compression_ratio=0.5)
    llama.generate(
        ids, max_new_tokens=12, do_sample=False, generation_mode="vericache", vericache_config=config
    )
    assert priors_for(llama).recall(_schedule_key(config, ids, None)) is not None
    assert (
        priors_for(llama).recall(_schedule_key(config, ids.repeat(2, 1), None)) is None
    )  # another batch size
    other = VeriCacheConfig(compressor="snapkv", compression_ratio=0.5)
    assert priors_for(llama).recall(_schedule_key(other, ids, None)) is None
    priors_for(llama).forget()
    assert priors_for(llama).recall(_schedule_key(config, ids, None)) is None


def run_gate(gate, passes: int, seconds, rows) -> list[int]:
    """Drive a proposal gate: a pass offering m takes `seconds(m, singles)` (singles: one-token passes so far, this
    one included), and its rows are offered and keep `rows(m, i)` ((offered, kept) lists). Returns each pass's m."""
    offers, singles = [], 0
    for i in range(passes):
        m = gate.current
        offers.append(m)
        singles += not m
        gate.observe(1 + m, seconds(m, singles), *rows(m, i))
    return offers


def one_in_four_keeps_one(m: int, i: int) -> tuple[list[int], list[int]]:
    """One row, offered m; one pass in four keeps one proposal."""
    return [m], [1 if m and i % 4 == 0 else 0]


def test_proposals_are_offered_only_where_a_wider_pass_pays_for_itself():
    # one-token passes take 50 ms, wider ones 75 ms and more; a quarter of proposals is kept (runs of about 0.3)
    gate = ProposalLength(limit=10)
    offers = run_gate(
        gate, 200, lambda m, _: 0.05 if not m else 0.075 + 0.001 * (1 + m), one_in_four_keeps_one
    )
    assert offers[:3] == [0, 0, 10]  # the first pass is not timed; then both kinds of pass are measured
    assert sum(m == 0 for m in offers) > 0.9 * len(offers)
    assert gate.tokens_per_second(0) == pytest.approx(1 / 0.05)


def test_a_gate_s_first_pass_is_not_timed_and_a_stale_one_token_price_is_measured_again():
    # The plain gate's first pass is a call's first round, which pays one-off costs: here the first two one-token
    # passes take 0.5 s, later ones 50 ms. Proposals are always found and one pass in four keeps one, so a pass
    # offering 10 yields 1.25 tokens in 86 ms, below a one-token pass's 20 a second. Timed from its first passes
    # alone, the one-token price (0.5 s) was never measured again while proposals kept coming, and the gate
    # offered them in every pass.
    gate = ProposalLength(limit=10)

    def seconds(m: int, singles: int) -> float:
        return (0.5 if singles <= 2 else 0.05) if not m else 0.075 + 0.001 * (1 + m)

    offers = run_gate(gate, 200, seconds, one_in_four_keeps_one)
    assert sum(m == 0 for m in offers) > 0.9 * len(offers)
    assert gate.tokens_per_second(0) == pytest.approx(1 / 0.05)


def test_in_a_batch_a_row_without_proposals_gains_only_its_own_token():
    # Batch 4: the proposer finds tokens for one row in four, which keeps 2 of 10. A pass offering them takes
    # 80 ms for every row, a one-token pass 50 ms. Per row, a pass with proposals yields 1 + 2/4 = 1.5 tokens
    # (18.75 a second), less than a one-token pass's 20; counting only the rows offered proposals, 3 tokens (37.5
    # a second), and the gate offered them in every pass.
    gate = ProposalLength(limit=10)
    offers = run_gate(
        gate, 200, lambda m, _: 0.08 if m else 0.05, lambda m, _: ([m, 0, 0, 0], [min(m, 2), 0, 0, 0])
    )
    assert sum(m == 0 for m in offers) > 0.9 * len(offers)
    assert gate.share.value == pytest.approx(0.25)
    assert gate.tokens_per_second(10) < gate.tokens_per_second(0)


def test_in_a_batch_yield_is_measured_on_the_rows_the_call_waits_for():
    # Batch 4, each row to emit 200 tokens. Only row 0 finds proposals (it copies a block), and keeps 6 of 10 each
    # time: 2.5 tokens a row for a 0.3 s pass against 1 in 0.15 s. Rows 1-3 set the call's length either way
    # (200 rounds), so every wider pass only slows it. Counting every row's gain, the gate offered proposals until
    # row 0 was done (29 rounds, 1.15x the plain call's time).
    gate, emitted, seconds = ProposalLength(limit=10), [0] * 4, 0.0
    while min(emitted) < 200:
        active = [b for b in range(4) if emitted[b] < 200]
        offered = {b: gate.current if b == 0 else 0 for b in active}
        kept = {b: min(6, n) for b, n in offered.items()}
        took = 0.3 if any(offered.values()) else 0.15
        bound = bounding_rows({b: 200 - emitted[b] for b in active})
        gate.observe(1 + max(offered.values()), took, [offered[b] for b in bound], [kept[b] for b in bound])
        for b in active:
            emitted[b] = min(200, emitted[b] + 1 + kept[b])
        seconds += took
    assert seconds < 1.05 * 200 * 0.15
    assert bounding_rows({0: 3, 1: 5, 2: 5}) == [1, 2]


def test_a_batch_pass_counts_as_far_as_it_moves_the_call():
    # rows 0 and 1 have the most left: the call waits for both
    left = {0: 50, 1: 50, 2: 40}
    assert call_run(left, {0: 10, 1: 10, 2: 10}, {0: 10, 1: 0, 2: 10}) == (10, 0)  # row 1 kept nothing
    assert call_run(left, {0: 10, 1: 3, 2: 0}, {0: 5, 1: 3, 2: 0}) == (3, 3)
    assert call_run(left, {0: 0, 1: 10, 2: 10}, {0: 0, 1: 10, 2: 0}) == (0, 0)  # row 0 was offered nothing
    # a row just behind the bound ones keeps the call from moving past it
    assert call_run({0: 50, 1: 49}, {0: 10, 1: 0}, {0: 10, 1: 0}) == (10, 1)


def test_a_probe_offers_a_few_proposals_in_a_pass_that_costs_little_more_than_one_token():
    # Batch 4, QA at 2k tokens on a 2-core CPU (a traced call): a one-token pass takes 115 ms, a pass of 4
    # tokens 160 ms, of 11 tokens 255 ms. Proposals are found in every pass and never kept. Probing with all 10
    # (an 11-token pass each time) cost 2.6% over one-token passes in 300 passes.
    def seconds(m: int, _: int) -> float:
        return 0.115 + (0.045 * m / 3 if m <= 3 else 0.045 + 0.095 * (m - 3) / 7)

    gate = ProposalLength(limit=10)
    offers = run_gate(gate, 300, seconds, lambda m, _: ([m], [0]))
    assert offers[:3] == [0, 0, 10]  # both kinds of pass measured
    assert set(offers[3:]) == {0, ProposalLength.PROBE_LENGTH}
    assert sum(seconds(m, 0) for m in offers) < 1.015 * 300 * 0.115


def test_acceptance_is_measured_per_position_not_assumed_geometric():
    # rows rejected at their first draft or right through 8 (all or nothing): a run of k <= 8 yields 1 + k / 2
    curve = AcceptanceCurve(decay=0.8, size=64)
    for _ in range(30):
        curve.add([(8, 0), (8, 8)])
    assert curve.expected(1) == pytest.approx(1.5, abs=0.05)
    assert curve.expected(8) == pytest.approx(5.0, abs=0.1)  # one rate for every position (8/9) says 5.9
    # geometric runs (each draft kept with probability 3/4) are priced as geometric
    geometric = AcceptanceCurve(decay=0.99, size=64)
    for run in [0, 1, 2, 3, 8, 8, 8, 8] * 40:  # P(run >= j) = (3/4)^j up to 4; a censored tail
        geometric.add([(8, run if run < 4 else 8)] if run < 8 else [(8, 8)])
    assert geometric.hazards(3) == pytest.approx([1 / 8, 1 / 7, 1 / 6], abs=0.02)


def test_the_commit_into_both_tiers_is_part_of_a_round_s_price():
    # a drafted round's verify pass is cheap, but committing what it accepted (quantizing into the draft tier)
    # costs as much as a plain round: with the commit priced, the fourth round is plain; without, it drafts (the
    # call's first round is not timed)
    def fourth_round(commit_seconds: float) -> int:
        schedule = CostAwareDraftLength(VeriCacheConfig(draft_length=8))
        for _ in range(2):
            schedule.observe(0, [0, 0], 0.0, 0.05, verified=1, commit_seconds=0.001)
        schedule.observe(8, [4, 4], 8 * 0.02, 0.06, commit_seconds=commit_seconds)
        return schedule.current

    assert fourth_round(0.001) > 0
    assert fourth_round(0.2) == 0


def test_calibration_is_measured_over_predicted_time_and_starts_at_one():
    calibration = Calibration(decay=0.95)
    assert calibration.factor == 1.0
    for _ in range(50):
        calibration.add(predicted_seconds=0.1, seconds=0.12)
    assert calibration.factor == pytest.approx(1.2, abs=0.03)
    once = Calibration(decay=0.95)
    once.add(predicted_seconds=0.1, seconds=0.4)  # one slow round moves it a third of the way
    assert once.factor == pytest.approx(2.0)


@pytest.mark.parametrize("schedule", ["adaptive", "fixed"])
def test_other_schedules_ignore_costs(schedule):
    config = VeriCacheConfig(draft_schedule=schedule, draft_length=8)
    lengths = drive(draft_length_schedule(config), 6, 10_000, draft_step=1.0, verify_base=0.001)
    assert lengths == ([8, 16, 32, 64, 64, 64] if schedule == "adaptive" else [8] * 6)


def test_linear_fit_recovers_a_line_and_never_predicts_a_free_pass():
    fit = RunningLinearFit(decay=0.95)
    for x in (1, 9, 17, 5, 33):
        fit.add(x, 0.07 + 0.004 * x)
    assert fit.predict(1) == pytest.approx(0.074)
    assert fit.predict(65) == pytest.approx(0.07 + 0.004 * 65)
    flat = RunningLinearFit(decay=0.95)
    flat.add(9, 0.2)
    assert flat.predict(1) == pytest.approx(0.2)  # one point: no slope


def test_a_steep_slope_from_close_widths_does_not_keep_drafts_short():
    """Measured at 8k tokens, batch 1: a probe's 5-token pass took 158 ms, then a 7-token one 216 ms (noise: passes of
    11 and 42 tokens later took 206 and 353). Fitted as they were, 29 ms a token priced long drafts out, and every
    later round drafted 4, which measured nothing wider. Shrunk toward flat, the slope lets the schedule draft
    longer, and what it measures there settles the line."""
    schedule = CostAwareDraftLength(VeriCacheConfig())
    passes = []

    def verify(width: int) -> float:  # the second drafted round's pass runs 29 ms a token above the first's
        passes.append(width)
        return 0.15 + 0.002 * width + (0.029 * (width - passes[0]) if len(passes) == 2 else 0.0)

    lengths = run_plain_prices(schedule, 12, 0.04, [0.092], verify, accept_run=10_000)
    assert lengths[2] == CostAwareDraftLength.PROBE_LENGTH and passes[1] > passes[0]
    assert max(lengths[4:]) >= 32  # past the slow pass, drafts run long
    far = RunningLinearFit(decay=0.95, slope_prior=RoundCosts.SLOPE_PRIOR)
    for x in (5, 9, 17, 33, 5, 17):  # widths far apart: the data's own slope, nearly
        far.add(x, 0.07 + 0.004 * x)
    assert far.predict(65) == pytest.approx(0.07 + 0.004 * 65, rel=0.03)


def test_a_pass_narrower_than_any_measured_is_not_priced_below_the_narrowest():
    # a CPU at batch 1, measured: 4 drafts a round (5-token passes) and 8 (9-token); 3-token passes took 134 ms
    fit = RunningLinearFit(decay=0.95)
    fit.add(9, 0.176)
    fit.add(5, 0.100)
    assert fit.predict(3) == pytest.approx(fit.predict(5)) and fit.predict(9) > fit.predict(5)
    config = VeriCacheConfig(draft_schedule="cost_aware", draft_length=8, min_draft_length=2)
    schedule = draft_length_schedule(config)
    schedule.observe(0, [1], 0.0, 0.2)  # a call's first round: not timed
    schedule.observe(0, [1], 0.0, 0.076)  # a plain round: 13 tokens a second
    schedule.observe(8, [0], 8 * 0.067, 0.176)  # drafting priced: 67 ms a draft step, rejected at once
    schedule.observe(0, [1], 0.0, 0.076)
    schedule.observe(4, [4], 4 * 0.064, 0.100)  # a probe of 4 runs through
    schedule.observe(4, [4], 4 * 0.064, 0.100)  # and another
    # two drafts and a 3-token pass: 2 * 64 ms + at least 100 ms for 3 tokens, slower than three plain rounds
    assert schedule.current == 0


def two_plain_rounds(schedule, seconds: float) -> None:
    """A call's first two rounds, plain: the first is not timed, the second prices a plain round."""
    for _ in range(2):
        schedule.observe(0, [0], 0.0, seconds)


def test_a_build_drafting_could_never_repay_is_declined_and_remembered():
    # SmolLM2-135M fp32 at 2k tokens, batch 1, on a CPU: 78 ms plain rounds; the weights are 85% of the bytes a plain
    # step reads, so a draft step can save at most 15% of one. HQQ's build (4.5 s) then costs more than drafting could
    # ever save over 126 tokens (about 1.4 s), and KIVI's (0.14 s) does not.
    schedule = CostAwareDraftLength(VeriCacheConfig(draft_length=8))
    two_plain_rounds(schedule, 0.078)
    # drafting is priced next...
    assert schedule.current == CostAwareDraftLength.PROBE_LENGTH and schedule.build_price is None
    assert schedule.affords_build(0.14, remaining=126, draft_share=0.85)
    assert not schedule.affords_build(4.5, remaining=126, draft_share=0.85)  # ...unless its build is dearer
    assert schedule.current == 0 and schedule.build_price == 4.5
    for _ in range(20):  # the tier stays unbuilt, and no round asks for it again
        schedule.observe(0, [0], 0.0, 0.078, remaining=100, tier_held=False)
        assert schedule.current == 0
    # the next call on the same settings declines from the remembered price, without building a layer to measure it
    after = CostAwareDraftLength(VeriCacheConfig(draft_length=8), schedule.estimates())
    assert after.build_price == 4.5 and not after.affords_build(4.5, remaining=126, draft_share=0.85)
    # at 8k tokens and batch 4 the full tier is three quarters of the bytes: drafting could save far more
    long = CostAwareDraftLength(VeriCacheConfig(draft_length=8))
    two_plain_rounds(long, 0.078)
    assert long.affords_build(4.5, remaining=126, draft_share=0.26)
    # off the host (None: bytes over a link are no measure of time) and with no horizon, the build is paid
    assert long.affords_build(4.5, remaining=126, draft_share=None)
    assert long.affords_build(4.5, remaining=None, draft_share=0.85)


def test_once_drafting_was_measured_a_build_is_weighed_as_a_probe_is():
    schedule = CostAwareDraftLength(VeriCacheConfig(draft_length=8))
    # drafts always rejected, a draft step dearer than a plain round: no build can pay
    drive(schedule, 40, 0, draft_step=0.08, verify_base=0.078)
    assert not schedule.affords_build(0.5, remaining=100, draft_share=0.85)
    # drafts always accepted and cheap: a small build pays, one dearer than the whole answer does not
    cheap = CostAwareDraftLength(VeriCacheConfig(draft_length=8))
    drive(cheap, 40, 10_000, draft_step=0.005, verify_base=0.078)
    assert cheap.affords_build(0.05, remaining=100, draft_share=0.85)
    assert not cheap.affords_build(100.0, remaining=100, draft_share=0.85)


def test_a_plain_gate_s_probe_does_not_make_drafting_look_cheaper_than_a_plain_round():
    # QA at 2k tokens, batch 1, with prompt lookup, on a 2-core CPU (a traced call): a one-token plain round
    # takes 178 ms, a plain round verifying 10 proposals 470 ms and keeps about one in three; a draft step costs
    # 200 ms, a drafted round's verify pass 450 ms. Even drafts that are always accepted (65 tokens in 13.25 s) lose
    # to one-token plain rounds. The plain gate asks for proposals now and then to re-measure them; priced at such
    # a probe's yield, plain rounds would look worse than drafting, and the schedule would draft a round at a loss
    # each time.
    gate = ProposalLength(limit=10)
    schedule = CostAwareDraftLength(VeriCacheConfig(), plain_gate=gate)
    lengths = []
    for i in range(300):
        k = schedule.current
        lengths.append(k)
        if k:
            schedule.observe(k, [k], 0.2 * k, 0.45, verified=k + 1)
            continue
        asked = gate.current > 0
        m = gate.current if asked else 0
        kept, took = (int(i % 3 == 0), 0.47) if m else (0, 0.178)
        gate.observe(1 + m, took, [m], [kept])
        schedule.observe(0, [kept], 0.0, took, verified=1 + m, asked=asked)
    # the round that prices drafting and the schedule's own probes (after 16, 32, 64 and 128 plain rounds), but none
    # in a gate's probe's place (plain rounds priced at the gate's probes draft 39 rounds here)
    assert sum(k > 0 for k in lengths) <= 5


def test_with_a_proposer_a_drafted_token_is_priced_by_the_passes_the_gate_will_run():
    """A round whose rows all kept their proposals drafted 24 tokens in 3 passes; proposals then stopped paying
    (the gate offers none). The next round's drafted token costs a one-token pass, as drafting alone prices it, not
    the burst's eighth of a pass, so a burst does not make the schedule draft far past what will be kept."""
    gate = ProposalLength(10)
    gate.observe(1, 0.9, [0], [0])  # a call's first pass: not timed
    gate.observe(1, 0.05, [0], [0])
    for _ in range(6):  # wide passes whose proposals the bound rows did not keep
        gate.observe(11, 0.15, [10], [0])
    assert gate.current == 0
    schedule = CostAwareDraftLength(VeriCacheConfig(), draft_gate=gate)
    for drafted, passes in ((0, None), (0, None), (24, 3)):
        schedule.observe(drafted, [drafted] * 4, 0.45 if drafted else 0.0, 0.3, passes=passes)
    assert schedule.costs.draft_step.value == pytest.approx(0.15)  # a draft step is a pass
    next_passes = gate.single.value  # one token each
    assert schedule.costs.draft_token_seconds == pytest.approx(next_passes)
    alone = CostAwareDraftLength(VeriCacheConfig())
    alone.observe(0, [0], 0.0, 0.3)
    alone.observe(0, [0], 0.0, 0.3)
    alone.observe(8, [8] * 4, 8 * 0.05, 0.3)
    assert alone.costs.draft_token_seconds == pytest.approx(0.05)  # drafting alone: its draft step


def test_each_model_owns_its_priors_and_threads_share_them_safely():
    import threading

    import torch

    first, second = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    schedule = CostAwareDraftLength(VeriCacheConfig())
    drive(schedule, 40, 4, draft_step=0.01, verify_base=0.05, verify_per_token=0.001)
    assert priors_for(first) is priors_for(first) and priors_for(first) is not priors_for(second)

    def remember(worker: int) -> None:
        for i in range(200):
            priors_for(first).remember((worker, i), schedule)
            assert priors_for(first).recall((worker, i)) is not None

    threads = [threading.Thread(target=remember, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(priors_for(first)) == 800 and len(priors_for(second)) == 0
    priors_for(second).remember(
        "plain", DraftLengthSchedule(VeriCacheConfig())
    )  # a fixed schedule carries nothing
    assert priors_for(second).recall("plain") is None
    priors_for(first).forget()
    assert len(priors_for(first)) == 0


def disturbed_first_draft(schedule, rounds: int, accept_run: int, draft_step: float) -> list[int]:
    """Plain rounds of 20 ms; the first drafted round runs 2.5x slow in every part (another process on the cores),
    later ones cost `draft_step` a draft and 22 ms + 1 ms a token a verify pass, every row accepting `accept_run`."""
    lengths = []
    for _ in range(rounds):
        k = schedule.current
        disturbed = not any(lengths)
        lengths.append(k)
        step, verify = (0.0, 0.02) if not k else (draft_step, 0.022 + 0.001 * (k + 1))
        scale = 2.5 if k and disturbed else 1.0
        schedule.observe(k, [min(k, accept_run)] * 2, scale * k * step, scale * verify, remaining=10_000)
    return lengths


def test_one_slow_drafted_round_does_not_keep_a_call_plain():
    """`Payoff` vetoes probes on draft prices that only drafted rounds measure: after one slow first draft every
    probe was vetoed, and a call ran plain to its end. Where drafts ran through, a probe comes anyway after some
    plain rounds, measures the draft prices anew, and drafting takes over."""
    lengths = disturbed_first_draft(CostAwareDraftLength(VeriCacheConfig()), 300, 10_000, draft_step=0.004)
    drafted = [i for i, k in enumerate(lengths) if k]
    assert drafted[0] == 2 and drafted[1] - drafted[0] <= Exploration.FIRST_REMEASURE_AFTER + 2
    assert sum(k > 0 for k in lengths[100:]) > 0.9 * len(lengths[100:])


def test_a_draft_price_measured_anew_still_keeps_plain_rounds_where_drafting_does_not_pay():
    """The same slow first draft, where drafts are rejected at once or a draft step truly costs a plain round: the
    call stays plain, with re-measuring probes only where drafts ran through, ever more rarely."""
    rejected = disturbed_first_draft(CostAwareDraftLength(VeriCacheConfig()), 600, 0, draft_step=0.004)
    assert [i for i, k in enumerate(rejected) if k] == [2]
    dear = disturbed_first_draft(CostAwareDraftLength(VeriCacheConfig()), 600, 10_000, draft_step=0.02)
    probes = [i for i, k in enumerate(dear) if k]
    gaps = [b - a for a, b in pairwise(probes)]
    assert 2 <= len(probes) <= 6 and gaps == sorted(gaps)
