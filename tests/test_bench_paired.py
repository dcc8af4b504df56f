"""Paired bench runs: a method side by side with a full-cache call, taking turns in slices of time.

Tiny random models in float64; exactness is against the full-cache call, which is stock `generate`.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from vericache_hf.pass_model import attention_layers, pass_model
from vericache_tools.bench import Method, run_bench
from vericache_tools.bench import turns as turns_module
from vericache_tools.bench.methods import Generation
from vericache_tools.bench.report import summarize, time_table
from vericache_tools.bench.turns import TakeTurns, run_side_by_side

from .test_bench import synthetic_workload


def test_parties_run_one_at_a_time_and_each_is_timed_only_while_it_runs():
    turns, log, naps = TakeTurns(2), [], [0.002, 0.006]

    def party(i: int, slices: int) -> None:
        turns.begin(i)
        try:
            for _ in range(slices):
                log.append((i, "in"))
                time.sleep(naps[i])
                log.append((i, "out"))
                turns.pass_turn(i)
        finally:
            turns.end(i)

    threads = [threading.Thread(target=party, args=(i, n)) for i, n in enumerate([5, 8])]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    wall = time.perf_counter() - started
    assert not any(thread.is_alive() for thread in threads)
    # never two at once: every slice ends before the next begins, and they alternate while both run
    assert all(a[1] == "in" and b == (a[0], "out") for a, b in zip(log[::2], log[1::2], strict=True))
    assert [i for i, _ in log[::2]] == [0, 1] * 5 + [1] * 3  # party 1 goes on alone after party 0 ends
    assert turns.held[0] >= 5 * naps[0] and turns.held[1] >= 8 * naps[1]
    assert sum(turns.held) <= wall  # disjoint turns: their times add up to no more than the wall clock


class _Failing:
    """A method whose call fails after its first token."""

    name = "failing"

    def generate(self, model, batch, max_new_tokens, streamer=None):
        streamer.put(batch.input_ids)
        streamer.put(batch.input_ids[:, -1])
        raise RuntimeError("this call failed")


class _Long:
    """A method that emits many tokens, one step at a time, counting its calls."""

    name = "long"

    def __init__(self, steps: int) -> None:
        self.steps, self.calls = steps, 0

    def generate(self, model, batch, max_new_tokens, streamer=None):
        self.calls += 1
        streamer.put(batch.input_ids)
        for _ in range(self.steps):
            time.sleep(0.001)
            streamer.put(batch.input_ids[:, -1])
        return Generation(torch.zeros(1, self.steps, dtype=torch.long))


class _Counted(Method):
    """A method that counts its calls."""

    calls: dict = {}

    def generate(self, *args, **kwargs) -> Generation:
        _Counted.calls[self.name] = _Counted.calls.get(self.name, 0) + 1
        return super().generate(*args, **kwargs)


class _Clock:
    """A stand-in for the turns' clock that moves only when a step says so, so that how long a turn is held does not
    depend on how fast this machine sleeps or schedules threads."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Steps:
    """A method that emits `steps` tokens, each `nap` seconds of `clock` after the last, logging its name at each."""

    def __init__(self, name: str, steps: int, nap: float, log: list[str], clock: _Clock) -> None:
        self.name, self.steps, self.nap, self.log, self.clock = name, steps, nap, log, clock

    def generate(self, model, batch, max_new_tokens, streamer=None):
        streamer.put(batch.input_ids)
        for _ in range(self.steps):
            self.clock.now += self.nap  # only the party holding the turn runs, so one writer at a time
            self.log.append(self.name)
            streamer.put(batch.input_ids[:, -1])
        return Generation(torch.zeros(1, self.steps, dtype=torch.long))


@pytest.mark.parametrize("quantum,least", [(0.0, 1), (4 / 256, 4)])
def test_turns_are_slices_of_time_not_single_tokens(llama, monkeypatch, quantum, least):
    # a call emitting many tokens a round must not give its partner runs of warm steps: each holds the turn for
    # `quantum` seconds (steps of 1/256 s, exact in binary: 4 steps) before passing it at its next token
    log: list[str] = []
    clock = _Clock()
    monkeypatch.setattr(turns_module, "time", clock)
    methods = [_Steps("a", 40, 1 / 256, log, clock), _Steps("b", 40, 1 / 256, log, clock)]
    run_side_by_side(llama, methods, synthetic_workload(1).batches[0], max_new_tokens=40, quantum=quantum)
    runs = [len(list(group)) for _, group in itertools.groupby(log)]
    assert len(runs) > 4
    assert min(runs[:-2]) >= least  # the last slices end when a call (or its stand-in) does
    assert max(runs[:-2]) <= least + 1


@pytest.mark.parametrize("short", [_Counted("full"), _Counted("vericache", "streaming_llm", 0.5)])
def test_a_call_that_ends_first_stands_in_until_the_other_ends(llama, short):
    # stand-ins keep the timed call from running its last steps alone; each is stopped through its own generate
    workload, long = synthetic_workload(1), _Long(steps=200)
    _Counted.calls.clear()
    results = run_side_by_side(llama, [short, long], workload.batches[0], max_new_tokens=3, quantum=0.0)
    assert [r.generation.new_tokens.shape[-1] for r in results] == [3, 200]
    assert _Counted.calls[short.name] > 1 and long.calls == 1


def test_a_failing_call_raises_in_the_caller_after_the_other_finishes(llama):
    workload = synthetic_workload(1)
    finished = []

    class _Full(Method):
        def generate(self, *args, **kwargs) -> Generation:
            out = super().generate(*args, **kwargs)
            finished.append(out)
            return out

    with pytest.raises(RuntimeError, match="this call failed"):
        run_side_by_side(llama, [_Full("full"), _Failing()], workload.batches[0], max_new_tokens=6)
    assert len(finished) == 1  # the full-cache call ran to its end
    layers = attention_layers(llama) + attention_layers(pass_model(llama))
    assert all(not module._forward_hooks for module in layers)  # the turn hooks are gone


def test_a_paired_run_matches_stock_generate_and_takes_ratios_to_the_call_beside_it(llama):
    # a fixed draft length: whether the cost-aware schedule drafts at all depends on this machine's clock
    methods = [Method("full"), Method("vericache", "snapkv", 0.75, draft_schedule="fixed")]
    methods.append(Method("vericache", "streaming_llm", 0.5, draft_schedule="fixed"))
    workloads = [synthetic_workload(1), synthetic_workload(2, pad=5)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        samples = run_bench(llama, workloads, methods, 12, repeats=2, progress=False, paired=True)
    finally:
        torch.set_num_threads(threads)
    rows = summarize(samples, workloads)
    for sample in samples:
        assert len(sample.seconds) == len(sample.prefill_seconds) == 2
        assert all(0 < p < t for p, t in zip(sample.prefill_seconds, sample.seconds, strict=True))
        if sample.method.family == "vericache":
            assert len(sample.reference_seconds) == len(sample.reference_prefill_seconds) == 2
            assert sample.stats.rounds > 0  # it drafted
    for row in (r for r in rows if r["family"] == "vericache"):
        assert row["identical_share"] == 1.0  # against stock generate, which ran beside it in another thread
        # the same tokens: the ratio is that of the full-cache calls beside it to its own time
        assert row["speed_ratio"] == pytest.approx(row["reference_seconds"] / row["seconds"])
        assert row["decode_ratio"] == pytest.approx(row["reference_decode_seconds"] / row["decode_seconds"])
        assert row["decode_ratio_per_batch"] == [pytest.approx(row["decode_ratio"])]  # one batch a workload
        # the prefill shown is the time to the first token, the library's own timer having run through turns
        assert f"| {row['method']} | {row['first_pass_seconds']:.2f} |" in time_table(rows)
    with pytest.raises(ValueError, match="leave them out"):
        run_bench(llama, workloads, [Method("full"), Method("lossy", "snapkv", 0.75)], 4, paired=True)
