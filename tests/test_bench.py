"""The bench: every method runs side by side, the report judges outputs against full-cache output, plots render.

Tiny random models (float64) stand in for a real one; one slow test runs the command on the embedded model.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from vericache_hf import VeriCacheConfig
from vericache_tools.bench import Method, PromptBatch, Workload, build_methods, build_workloads, run_bench
from vericache_tools.bench.command import QUICK, apply_quick, run_settings
from vericache_tools.bench.plots import _panels, plot_all
from vericache_tools.bench.quality import extract_code, parses, passes_humaneval, trim
from vericache_tools.bench.report import (
    markdown_table,
    overview_table,
    summarize,
    workload_order,
    write_report,
)
from vericache_tools.cli import build_parser
from vericache_tools.prompts import humaneval_problems

from .conftest import random_prompt


def synthetic_workload(batch_size: int, length: int = 70, pad: int = 0) -> Workload:
    ids = random_prompt(length, batch=batch_size, seed=batch_size)
    mask = torch.ones_like(ids)
    if pad:
        ids[0, :pad], mask[0, :pad] = 0, 0  # left padding on the first row
    return Workload("qa", length, batch_size, [PromptBatch(ids, mask, [None] * batch_size)])


@pytest.fixture(scope="module")
def bench_rows(llama, tmp_path_factory):
    # a fixed draft length: whether the cost-aware schedule drafts at all depends on this machine's clock
    vericache = Method("vericache", "snapkv", 0.75, draft_schedule="fixed")
    methods = [Method("full"), Method("lossy", "snapkv", 0.75), vericache]
    methods += [Method("prompt_lookup", lookup_tokens=4), Method("early_exit", early_exit_layers=1)]
    workloads = [synthetic_workload(1), synthetic_workload(2, pad=5)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster, and much faster on a shared CPU
    try:
        samples = run_bench(llama, workloads, methods, max_new_tokens=16, repeats=2, progress=False)
    finally:
        torch.set_num_threads(threads)
    return samples, workloads, summarize(samples, workloads)


def test_lossless_methods_match_full_cache_and_peers_are_batch_one(bench_rows):
    samples, _, rows = bench_rows
    by = {(r["workload"], r["family"]): r for r in rows}
    for workload in ("qa-70-b1", "qa-70-b2"):
        assert by[(workload, "full")]["identical_share"] == 1.0
        assert by[(workload, "vericache")]["identical_share"] == 1.0
        assert by[(workload, "vericache")]["mean_accepted_per_round"] > 0
        assert (
            0
            < by[(workload, "vericache")]["draft_tier_bytes"]
            < by[(workload, "vericache")]["full_tier_bytes"]
        )
        stats = next(x.stats for x in samples if x.workload == workload and x.method.family == "vericache")
        assert by[(workload, "vericache")]["device_kv_bytes"] == (
            stats.peak_draft_tier_bytes + stats.peak_staging_bytes
        )
        assert by[(workload, "full")]["device_kv_bytes"] == by[(workload, "full")]["full_tier_bytes"] > 0
    assert by[("qa-70-b1", "prompt_lookup")]["identical_share"] == 1.0
    assert by[("qa-70-b1", "early_exit")]["identical_share"] == 1.0
    assert "batch-1 only" in by[("qa-70-b2", "early_exit")]["na"]
    assert all(len(s.seconds) == 2 for s in samples if not s.skipped)  # interleaved repeats all ran
    # Each run's peak resident memory, the process's whole footprint (this test machine runs Linux).
    assert all(len(s.peak_rss_bytes) == 2 and min(s.peak_rss_bytes) > 2**20 for s in samples if not s.skipped)
    for row in (r for r in rows if "na" not in r):
        runs = [s for s in samples if (s.workload, s.method.name) == (row["workload"], row["method"])]
        assert row["peak_rss_bytes"] == max(b for s in runs for b in s.peak_rss_bytes)


def test_identical_share_counts_a_differing_row(bench_rows):
    samples, workloads, _ = bench_rows
    vericache = next(s for s in samples if s.method.family == "vericache" and s.batch_size == 2)
    vericache.rows[1] = vericache.rows[1][:-1] + [vericache.rows[1][-1] + 1]
    try:
        rows = summarize(samples, workloads)
        row = next(r for r in rows if r["family"] == "vericache" and r["batch_size"] == 2)
        assert row["identical_share"] == 0.5
        assert "DIFFERS [50%]" in overview_table(rows)  # the overview cannot hide a lossless method's drift
    finally:
        vericache.rows[1] = vericache.rows[1][:-1] + [vericache.rows[1][-1] - 1]


def test_report_and_plots_are_written(bench_rows, tmp_path):
    _, _, rows = bench_rows
    json_path, md_path = write_report(rows, tmp_path, {"repeats": 2})
    data = json.loads(json_path.read_text())  # strict JSON: a method that does not apply is null, not NaN
    assert data["settings"]["repeats"] == 2 and len(data["rows"]) == len(rows)
    table = md_path.read_text()
    assert "VeriCache snapkv@0.75" in table and "n/a" in table
    overview = overview_table(rows).splitlines()  # a line per method, a column per workload
    assert len(overview) == 2 + len({r["method"] for r in rows})
    assert overview[0].count("|") == 4 + len({r["workload"] for r in rows})  # and the two floor columns
    for line in overview[2:]:  # each method's floor is its worst cell
        method = line.split(" | ")[0].removeprefix("| ")
        decode = [r["decode_ratio"] for r in rows if r["method"] == method and "na" not in r]
        whole = [r["speed_ratio"] for r in rows if r["method"] == method and "na" not in r]
        assert line.split(" | ")[-2:] == [f"{min(decode):.2f}", f"{min(whole):.2f} |"]
    assert not any("DIFFERS" in line for line in overview) and overview[0] in table
    for figure in plot_all(data["rows"], tmp_path):
        assert figure.stat().st_size > 5_000
    full = next(r for r in rows if r["family"] == "full")
    assert math.isclose(full["speed_ratio"], 1.0)


def test_a_grid_run_plots_a_panel_per_workload_in_table_order(bench_rows, tmp_path):
    _, _, rows = bench_rows
    first = [r for r in rows if r["workload"] == "qa-70-b1"]
    longer = [
        dict(r, workload=f"code-{n}k-b1", kind="code", context_tokens=1024 * n)
        for n in (8, 4, 2)
        for r in first
    ]
    grid = longer + rows  # run order is not table order
    order = workload_order(grid)
    assert order == ["qa-70-b1", "qa-70-b2", "code-2k-b1", "code-4k-b1", "code-8k-b1"]
    assert overview_table(grid).splitlines()[0] == (
        "| method | " + " | ".join(order) + " | floor (decode) | floor (whole call) |"
    )
    fig, panels = _panels(order)
    assert list(panels) == order and len(fig.axes) == 8  # four a row: two rows, three spare panels hidden
    assert sum(ax.get_visible() for ax in fig.axes) == 5
    widths = []
    for name, subset in (("one", first), ("grid", grid)):
        for figure in plot_all(subset, tmp_path / name):
            widths.append(int.from_bytes(figure.read_bytes()[16:20], "big"))  # the PNG header's width
    assert widths[0] < widths[3] and widths[2] < widths[5]  # throughput and acceptance: a panel each


def test_bad_settings_are_refused(llama):
    with pytest.raises(ValueError, match="full-cache method"):
        run_bench(llama, [synthetic_workload(1)], [Method("vericache", "snapkv", 0.75)], 4, progress=False)
    with pytest.raises(ValueError, match="needs a compressor"):
        Method("lossy")
    with pytest.raises(ValueError, match="Unknown method family"):
        Method("beam")
    with pytest.raises(ValueError, match="Unknown workload kind"):
        build_workloads(None, ["poetry"], [2048], [1], 1)


def test_build_methods_puts_the_reference_first():
    methods = build_methods(["snapkv", "kivi"], [0.75, 0.875], peers=True)
    assert methods[0].family == "full"
    assert len(methods) == 1 + 2 * 2 * 2 + 2
    assert len({m.name for m in methods}) == len(methods)
    assert [m.family for m in build_methods(["snapkv"], [0.75], peers=["prompt_lookup"])][
        -1
    ] == "prompt_lookup"
    assert len(build_methods(["snapkv"], [0.75], peers=[])) == 3
    alone = build_methods(["snapkv", "kivi"], [0.875], peers=[], lossy=False)  # --no-lossy
    assert [(m.family, m.compressor) for m in alone] == [
        ("full", None),
        ("vericache", "snapkv"),
        ("vericache", "kivi"),
    ]
    with pytest.raises(ValueError, match="Unknown peer"):
        build_methods(["snapkv"], [0.75], peers=["medusa"])


def test_build_methods_refuses_a_ratio_a_compressor_cannot_meet_before_any_run():
    with pytest.raises(ValueError, match=r"(?s)bnb@0.875: .*2-bit.*fp8@0.75.*--ratios they support") as error:
        build_methods(["snapkv", "bnb", "fp8"], [0.75, 0.875], peers=False)
    assert "snapkv" not in str(error.value) and "bnb@0.75" not in str(error.value)


def test_composed_method_runs_beside_vericache_alone_and_stays_lossless(llama):
    methods = build_methods(
        ["streaming_llm"], [0.5], peers=False, draft_schedules=["fixed"], proposers=["none", "prompt_lookup"]
    )
    composed = [m for m in methods if m.proposer]  # a fixed schedule: proposals are checked in every round
    assert [m.name for m in methods if m.family == "vericache"] == [
        "VeriCache streaming_llm@0.5 [fixed]",
        "VeriCache streaming_llm@0.5 + prompt lookup [fixed]",
    ]
    with pytest.raises(ValueError, match="Unknown proposer"):
        build_methods(["snapkv"], [0.75], proposers=["eagle"])
    with pytest.raises(ValueError, match="Only VeriCache takes a proposer"):
        Method("full", proposer="prompt_lookup")
    workload = synthetic_workload(2, pad=3)
    ids = workload.batches[0].input_ids
    workload.batches[0].input_ids[:] = torch.cat([ids[:, :35], ids[:, :35]], dim=1)  # something to look up
    samples = run_bench(
        llama, [workload], [Method("full"), *composed], max_new_tokens=16, repeats=1, progress=False
    )
    (row,) = [r for r in summarize(samples, [workload]) if r["family"] == "vericache"]
    assert row["identical_share"] == 1.0 and row["proposer"] == "prompt_lookup" and row["proposed_tokens"] > 0


def test_draft_schedules_run_side_by_side_each_lossless(llama, tmp_path):
    methods = build_methods(["streaming_llm"], [0.5], peers=False, draft_schedules=["adaptive", "cost_aware"])
    assert [m.name for m in methods if m.family == "vericache"] == [
        "VeriCache streaming_llm@0.5 [adaptive]",
        "VeriCache streaming_llm@0.5 [cost_aware]",
    ]
    workloads = [synthetic_workload(2, pad=5)]
    samples = run_bench(llama, workloads, methods, max_new_tokens=16, repeats=1, progress=False)
    rows = summarize(samples, workloads)
    vericache = [r for r in rows if r["family"] == "vericache"]
    assert [r["draft_schedule"] for r in vericache] == ["adaptive", "cost_aware"]
    assert [r["identical_share"] for r in vericache] == [1.0, 1.0]
    assert len(plot_all(rows, tmp_path)) == 3
    with pytest.raises(ValueError, match="draft schedule"):
        build_methods(["snapkv"], [0.75], draft_schedules=["sometimes"])


def test_each_workload_is_handed_over_with_its_own_samples_as_it_ends(llama):
    workloads = [synthetic_workload(1), synthetic_workload(2)]
    handed = []
    samples = run_bench(
        llama,
        workloads,
        [Method("full")],
        max_new_tokens=2,
        repeats=1,
        progress=False,
        on_workload=lambda workload, mine: handed.append((workload.name, [s.workload for s in mine])),
    )
    assert handed == [(w.name, [w.name]) for w in workloads]
    assert [s.workload for s in samples] == [w.name for w in workloads]


def test_a_cut_short_workload_goes_on_from_its_saved_repeats(llama):
    from vericache_tools.bench.runner import Sample

    two_batches = synthetic_workload(1)
    two_batches.batches.append(
        PromptBatch(random_prompt(60, seed=7), torch.ones(1, 60, dtype=torch.long), [None])
    )
    # a fixed schedule drafts in 6 tokens (the cost-aware one may rightly find no build worth paying there)
    methods = [Method("full"), Method("vericache", "snapkv", 0.75, draft_schedule="fixed")]
    saved = []  # what a run would have on disk after each repeat
    first = run_bench(
        llama,
        [two_batches],
        methods,
        max_new_tokens=6,
        repeats=2,
        progress=False,
        on_repeat=lambda workload, group: saved.append([json.loads(json.dumps(s.to_dict())) for s in group]),
    )
    assert [(g[0]["batch_index"], [len(d["seconds"]) for d in g]) for g in saved] == [
        (0, [1, 1]), (0, [2, 2]), (1, [1, 1]), (1, [2, 2])
    ]  # fmt: skip
    # As if the run had stopped inside batch 1's second repeat: batch 0 is kept whole, batch 1 goes on from its
    # first repeat, so each of its methods runs once more.
    kept = [Sample.from_dict(d) for d in saved[1] + saved[2]]
    batch_1_first_seconds = [s.seconds[0] for s in kept[2:]]
    again = run_bench(
        llama, [two_batches], methods, max_new_tokens=6, repeats=2, progress=False, measured=kept
    )
    assert all(a is k for a, k in zip(again, kept, strict=True))
    assert [len(s.seconds) for s in again] == [2, 2, 2, 2]
    assert [s.seconds[0] for s in again[2:]] == batch_1_first_seconds
    assert again[1].stats == first[1].stats and again[1].stats.rounds > 0
    assert [s.rows for s in again] == [s.rows for s in first]
    rows = summarize(again, [two_batches])
    assert [r["identical_share"] for r in rows] == [1.0, 1.0]
    for row in rows:  # the same tokens as full cache: the cell's ratio pools the batches' decode times
        per_batch = row["decode_ratio_per_batch"]
        assert len(per_batch) == 2 and min(per_batch) <= row["decode_ratio"] <= max(per_batch)
    assert rows[0]["decode_ratio_per_batch"] == [1.0, 1.0]  # full cache against itself
    # A batch that is one method short (as written by older versions mid-batch) runs again from the start.
    short = [Sample.from_dict(d) for d in saved[1] + saved[3][:1]]
    third = run_bench(
        llama, [two_batches], methods, max_new_tokens=6, repeats=2, progress=False, measured=short
    )
    assert third[2] is not short[2] and [len(s.seconds) for s in third] == [2, 2, 2, 2]


def test_trimming_between_runs_returns_freed_heap_memory():
    """Under the bench's malloc settings freed memory stays resident until `release_free_memory`, and
    `PeakMemory` sees the peak a block reached even after the block freed it."""
    import os
    import subprocess
    import sys

    from vericache_tools.bench.command import CPU_ENV

    script = (
        "import torch\n"
        "from vericache_tools.bench.runner import PeakMemory, release_free_memory, resident_bytes\n"
        "base = resident_bytes()\n"
        "with PeakMemory() as peak:\n"
        "    chunks = [torch.ones(2**18) for _ in range(300)]\n"  # 300 MiB in 1 MiB pieces, on the heap
        "    kept = chunks[-1]\n"  # holds the top of the heap, as a live tensor of a later step would
        "    del chunks\n"
        "held = resident_bytes()\n"
        "release_free_memory()\n"
        "print(base, peak.bytes, held, resident_bytes())\n"
    )
    env = {**os.environ, **CPU_ENV}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    base, peak, held, trimmed = (int(v) / 2**20 for v in out.stdout.split())
    assert peak - base > 250  # the block's 300 MiB were seen
    assert held - base > 250  # freed, yet still resident: what piled up over a grid
    assert held - trimmed > 250  # handed back


def test_resumed_samples_come_only_from_a_run_with_the_same_settings(tmp_path):
    from vericache_tools.bench.command import IN_PROGRESS, resumed_samples, save_in_progress
    from vericache_tools.bench.runner import Sample

    settings = run_settings(build_parser().parse_args(["bench", "--out", str(tmp_path)]))
    assert resumed_samples(tmp_path, settings) == []
    sample = Sample(Method("full"), "code-2k-b1", 3, 1, seconds=[1.5], rows=[[5, 6]], finished=[True])
    save_in_progress(tmp_path, settings, [sample])
    assert resumed_samples(tmp_path, settings) == [sample]
    with pytest.raises(SystemExit, match="repeats=3, this run asks for 2"):
        resumed_samples(tmp_path, {**settings, "repeats": 2})
    save_in_progress(tmp_path, settings, [])  # every workload ended: nothing left in progress
    assert not (tmp_path / IN_PROGRESS).exists()


def test_resume_keeps_saved_rows_only_under_the_same_settings(tmp_path):
    from vericache_tools.bench.command import RESUME_KEYS, resumed_rows

    settings = run_settings(build_parser().parse_args(["bench", "--out", str(tmp_path)]))
    assert resumed_rows(tmp_path, settings) == []  # nothing saved yet
    saved_settings = {key: settings[key] for key in RESUME_KEYS}
    rows = [{"workload": "code-2048-b1", "method": "full cache"}]
    (tmp_path / "results.json").write_text(json.dumps({"settings": saved_settings, "rows": rows}))
    assert resumed_rows(tmp_path, settings) == rows
    with pytest.raises(SystemExit, match="max_new_tokens=128, this run asks for 64"):
        resumed_rows(tmp_path, {**settings, "max_new_tokens": 64})
    # the default schedule is recorded as run: a file from before the option was made with "adaptive"
    assert settings["draft_schedules"] == [VeriCacheConfig().draft_schedule]
    del saved_settings["draft_schedules"]
    (tmp_path / "results.json").write_text(json.dumps({"settings": saved_settings, "rows": rows}))
    assert resumed_rows(tmp_path, {**settings, "draft_schedules": ["adaptive"]}) == rows
    with pytest.raises(
        SystemExit, match="draft_schedules=\\['adaptive'\\], this run asks for \\['cost_aware'\\]"
    ):
        resumed_rows(tmp_path, {**settings, "draft_schedules": ["cost_aware"]})


def test_quick_flag_sets_the_quick_sizes():
    args = apply_quick(build_parser().parse_args(["bench", "--quick"]))
    assert (args.contexts, args.batch_sizes, args.repeats) == (QUICK["contexts"], QUICK["batch_sizes"], 2)
    assert args.peers == ["prompt_lookup"]  # early-exit assisting alone takes minutes on a CPU
    assert build_parser().parse_args(["bench", "--contexts", "2048,4096"]).contexts == [2048, 4096]


def test_code_quality_checks():
    assert trim(torch.tensor([5, 6, 2, 0, 0]), {2}) == [5, 6, 2]
    answer = "Here it is:\n```python\ndef f(x):\n    return x\n```\nDone."
    assert extract_code(answer) == "def f(x):\n    return x\n"
    assert parses(extract_code(answer)) and not parses("def f(:\n")
    problem = humaneval_problems()[0]
    assert passes_humaneval(problem, extract_code(problem["canonical_solution"], problem))
    wrong = "def has_close_elements(numbers, threshold):\n    return True\n"
    assert passes_humaneval(problem, extract_code(wrong, problem)) is False
    assert (
        passes_humaneval(problem, extract_code("    while True:\n        pass\n", problem), timeout=2.0)
        is False
    )


def test_extract_code_builds_the_program_from_a_whole_function_or_a_body():
    problem = humaneval_problems()[0]  # has_close_elements; its prompt imports List
    function = (
        "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1 :])\n"
    )
    chat = f"Sure! Here is the function:\n\n```python\n{function}```\n\nIt compares every pair."
    program = extract_code(chat, problem)
    assert program == problem["prompt"] + "    pass\n\n" + function  # the prompt's imports, then the answer
    assert parses(program) and passes_humaneval(problem, program)
    body = problem["canonical_solution"]
    assert extract_code(body, problem) == problem["prompt"] + body
    assert not parses(body) and parses(extract_code(body, problem))  # a body only parses behind its prompt
    # Prose before an unfenced function is dropped; a fence may name another language (or none).
    assert extract_code("Here you go:\ndef f(x):\n    return x\n") == "def f(x):\n    return x\n"
    assert extract_code("```Python3\ndef f(x):\n    return x\n```\nprose") == "def f(x):\n    return x\n"
    assert (
        extract_code("import math\n\ndef f(x):\n    return math.pi\n")
        == "import math\n\ndef f(x):\n    return math.pi\n"
    )


@pytest.mark.parametrize(
    "tail",
    [
        "\ndef helper():\n    pass\n",
        "\nclass Test:\n    pass\n",
        "\nif __name__ == '__main__':\n    main()\n",
        "\nprint(f([1, 2]))\n",
        "\n# Example usage\nf([1, 2]\n",
    ],
)
def test_extract_code_stops_at_humaneval_stop_sequences(tail):
    function = "def f(numbers):\n    # an indented comment is not a stop\n    return sum(numbers)\n"
    # The tail may itself be unfinished: it is cut off whether or not the token limit was hit.
    for truncated in (False, True):
        assert extract_code(function + tail, truncated=truncated) == function + "\n"
        assert extract_code(f"```python\n{function}{tail}", truncated=truncated) == function + "\n"
    body = "    return sum(numbers)\n"
    problem = {"prompt": 'def f(numbers):\n    """Sum."""\n', "entry_point": "f"}
    assert extract_code(body + tail, problem) == problem["prompt"] + body + "\n"


def test_extract_code_drops_what_the_token_limit_cut():
    done = "def f(numbers, threshold):\n    total = 0\n    for x in numbers:\n        total += x\n"
    cut = done + "    return any(\n        abs(total - x) < thr"  # cut mid-line, inside an open bracket
    assert not parses(extract_code(cut))  # ended at EOS: judged as written
    assert extract_code(cut, truncated=True) == done and parses(done)
    assert extract_code(f"```python\n{cut}", truncated=True) == done  # a fence the limit left open
    # A closed fence is a finished answer, even if the limit came later (in the prose after it).
    closed = f"```python\n{cut}\n```\nThis function"
    assert not parses(extract_code(closed, truncated=True))
    # A real syntax error is not hidden by dropping the lines after it.
    broken = "def f(x):\n    w = 0\n    y = = 1\n    z = 2\n    return (\n        x"
    assert not parses(extract_code(broken, truncated=True))
    # Nothing finished before the cut: the function is not reduced to nothing, and does not parse.
    assert not parses(extract_code("def f(x):\n    return any(\n        x > 0", truncated=True))
    problem = {"prompt": 'def f(x):\n    """Doc."""\n', "entry_point": "f"}
    assert not parses(extract_code("    return any(\n        x > 0", problem, truncated=True))
    assert (
        extract_code("    y = x\n    return any(\n", problem, truncated=True)
        == problem["prompt"] + "    y = x\n"
    )
    assert not parses(extract_code("\n\n    return any(\n        x > 0", problem, truncated=True))
    # No answer at all does not parse, though the prompt's stub alone would.
    assert extract_code("", problem) == "" and not parses("") and parses(problem["prompt"])


@pytest.mark.slow
def test_bench_command_on_the_embedded_model(tmp_path):
    import vericache_hf
    from vericache_tools.cli import main

    argv = ["bench", "--kinds", "code", "--contexts", "512", "--batch-sizes", "1", "--num-prompts", "1"]
    argv += ["--max-new-tokens", "12", "--compressors", "snapkv", "--ratios", "0.75", "--repeats", "1"]
    argv += ["--no-peers", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    vericache = next(r for r in rows if r["family"] == "vericache")
    assert vericache["identical_share"] == 1.0 and vericache["parse_share"] is not None
    assert all(r["code_version"].startswith(vericache_hf.__version__) for r in rows)  # which code measured it
    assert markdown_table(rows).count("\n") == len(rows) + 1
    assert (tmp_path / "throughput_vs_ratio.png").is_file()
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["complete"] is True
    assert not (tmp_path / "in_progress.json").exists()  # removed as the last workload ended
    # Resumed with the same settings, every workload is already there: the saved rows are kept, not re-measured.
    assert main([*argv, "--resume"]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == rows
