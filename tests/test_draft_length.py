"""The draft-length schedules, driven round by round as the decoding loop drives them, with simulated acceptance and
step costs (no clock): the cost-aware one drafts long when drafting pays, steps plainly when it does not, and
probes its way back."""

from __future__ import annotations

from itertools import pairwise

import pytest

from vericache_hf import VeriCacheConfig
from vericache_hf.draft_length import (
    AcceptanceDraftLength,
    CostAwareDraftLength,
    DraftLengthSchedule,
    RunningLinearFit,
    draft_length_schedule,
)


def drive(
    schedule, rounds: int, accept_run: int, draft_step: float, verify_base: float, verify_per_token=0.0
):
    """Run `rounds` rounds in which every row of 2 accepts `accept_run` drafts (capped by the draft length).
    Returns the draft length of each round."""
    lengths = []
    for _ in range(rounds):
        k = schedule.current
        lengths.append(k)
        accepted = [min(k, accept_run)] * 2
        schedule.observe(k, accepted, k * draft_step, verify_base + verify_per_token * (k + 1))
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
    assert min(lengths[10:]) >= 32
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


def test_cost_aware_returns_to_drafting_when_a_probe_runs_through():
    # a draft step at 30% of a verify pass: drafting pays only while drafts are accepted
    schedule = CostAwareDraftLength(VeriCacheConfig())
    costs = dict(draft_step=0.03, verify_base=0.1, verify_per_token=0.002)
    assert drive(schedule, 40, 0, **costs)[-10:] == [0] * 10
    lengths = drive(schedule, 60, 10_000, **costs)  # the text turned predictable
    assert lengths[-1] >= 16


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
