"""The planned GPU run (`scripts/gpu_check.sh`) and its pieces, dry on the CPU: every step runs on tiny shapes, and
the replay, the kernel table and the real-model run each produce what the device run will read."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
TRACE = ROOT / "docs" / "benchmarks" / "acceptance-traces" / "code-8k-b4-k16.json"


def benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recorded_trace_is_a_lossless_real_call():
    trace = json.loads(TRACE.read_text())
    assert trace["identical"] and trace["draft_length"] == 16
    (call,) = trace["calls"]
    drafted = [turn for turn in call["rounds"] if turn["drafted"]]
    assert drafted and all(len(turn["accepted"]) == call["rows"] for turn in drafted)
    assert all(0 <= a <= turn["drafted"] for turn in drafted for a in turn["accepted"])
    assert len({tuple(turn["accepted"]) for turn in drafted}) > 1  # rows and rounds differ: a real trace


def test_the_replay_drafts_and_accepts_what_the_trace_did(tmp_path):
    """A replayed round commits each row's recorded count plus its bonus token, so tokens per round follow the
    trace, and the full tier takes ragged commits (masked slots) as in real decoding."""
    rows = benchmark("gpu_offload").main(
        [
            "--dry-run",
            "--batches",
            "4",
            "--replay",
            str(TRACE),
            "--rounds",
            "4",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    (row,) = rows
    replay = row["vericache"]
    assert replay["acceptance"] == "replay" and replay["rounds"] == 4
    (call,) = json.loads(TRACE.read_text())["calls"]
    timed = call["rounds"][1:5]
    expected = sum(a + 1 for turn in timed for b, a in enumerate(turn["accepted"]) if b in turn["active"])
    assert replay["tokens_per_round"] == round(expected / 4 / 4, 2)


def test_the_verify_kernel_benchmark_measures_every_kernel(tmp_path):
    rows = benchmark("gpu_verify_kernels").main(["--dry-run", "--out", str(tmp_path / "k.json")])
    kernels = {row["kernel"] for row in rows if row["table"] == "attention"}
    assert kernels == {"step", "sdpa", "lower_right", "flex", "flash", "streamed"}
    assert all(row["ms"] > 0 for row in rows)
    assert {row["kernel"] for row in rows if row["table"] == "pass"} == kernels - {"streamed"}


@pytest.mark.slow
def test_the_gpu_check_script_runs_dry(tmp_path):
    """`bash scripts/gpu_check.sh dry-run`: every step of the device run, on the CPU, each writing its results."""
    # One thread, as for every tiny model here: the steps' tiny shapes gain nothing from a second OpenMP worker, and
    # beside the transfer thread on two cores each op's barrier would wait for a core (several times slower).
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "dry-run"],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("tests.log", "kernels.log", "verify_kernels.json", "offload.json", "real.json"):
        assert (tmp_path / name).exists(), name
    assert json.loads((tmp_path / "real.json").read_text())["identical"]
    assert json.loads((tmp_path / "serving" / "results.json").read_text())[0]["vericache_tokens_per_s"] > 0
