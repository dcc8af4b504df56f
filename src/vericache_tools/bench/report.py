"""Turn bench samples into one row per (workload, method): speed, ratios to full-cache decoding, quality, memory.

Speeds are medians over repeats, summed over a workload's batches. `tok/s` counts the whole `generate` call;
`decode tok/s` leaves out the method's own prefill (its first forward pass, with any compression done there), so it
shows the decoding loop, which is where the methods differ; at long contexts and batch 4 a prefill on this CPU takes
minutes and would drown it. A K/V-only compressor on the CPU compresses when drafting first needs it, so its cost
counts in decode time there. Quality is judged against full-cache output.

In a paired run (`--paired`) each method ran side by side with a full-cache call, taking turns, and its ratios are
to that call (`reference_seconds`); there, prefill time is the time to the first token, and absolute speeds are
those of calls taking turns (about a fifth slower than alone, every method alike).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import median
from typing import Any

from .quality import extract_code, parses, passes_humaneval
from .runner import Sample
from .workloads import Workload

MIB = 2**20


def _ratio(value: float, reference: float) -> float:
    return (
        value / reference
        if reference and not math.isnan(reference) and not math.isnan(value)
        else float("nan")
    )


class _Judge:
    """Decodes rows and runs HumanEval tests once per distinct (problem, code)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.cache = tokenizer, {}

    def code(self, tokens: list[int], problem: dict, finished: bool) -> str:
        """The program to judge: `extract_code`, the same for every method's output."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return extract_code(text, problem, truncated=not finished)

    def passes(self, problem: dict, code: str) -> bool:
        key = (problem["task_id"], code)
        if key not in self.cache:
            self.cache[key] = passes_humaneval(problem, code)
        return self.cache[key]


def summarize(samples: list[Sample], workloads: list[Workload], tokenizer=None) -> list[dict[str, Any]]:
    """One row per (workload, method), in the order the methods ran."""
    judge = _Judge(tokenizer) if tokenizer is not None else None
    by_name = {w.name: w for w in workloads}
    rows = []
    for workload in workloads:
        mine = [s for s in samples if s.workload == workload.name]
        reference = {s.batch_index: s for s in mine if s.method.family == "full"}
        names = list(dict.fromkeys(s.method.name for s in mine))
        for name in names:
            group = [s for s in mine if s.method.name == name]
            rows.append(_row(group, reference, by_name[workload.name], judge))
    _fill_lossy_bytes(rows)
    full = {row["workload"]: row for row in rows if row["family"] == "full"}
    for row in rows:
        base = full[row["workload"]]
        speed, decode = base["tokens_per_s"], base["decode_tokens_per_s"]
        if "reference_seconds" in row:  # paired: the full-cache calls that ran beside this method's
            speed = base["tokens_per_s"] * base["seconds"] / row["reference_seconds"]
            decode = base["decode_tokens_per_s"] * base["decode_seconds"] / row["reference_decode_seconds"]
        row["speed_ratio"] = _ratio(row["tokens_per_s"], speed)
        row["decode_ratio"] = _ratio(row["decode_tokens_per_s"], decode)
    return rows


def _row(group: list[Sample], reference: dict[int, Sample], workload: Workload, judge) -> dict[str, Any]:
    method = group[0].method
    row: dict[str, Any] = {
        "workload": workload.name,
        "kind": workload.kind,
        "context_tokens": workload.context_tokens,
        "batch_size": workload.batch_size,
        "method": method.name,
        "family": method.family,
        "compressor": method.compressor,
        "compression_ratio": method.compression_ratio,
        "lossless": method.lossless,
    }
    if method.draft_schedule:
        row["draft_schedule"] = method.draft_schedule
    if method.proposer:
        row["proposer"] = method.proposer
    if method.draft_dtype:
        row["draft_dtype"] = method.draft_dtype
    if method.draft_matmul != "measured":
        row["draft_matmul"] = method.draft_matmul
    if any(s.skipped for s in group):
        row["na"] = group[0].skipped
        for key in ("tokens_per_s", "decode_tokens_per_s", "identical_share"):
            row[key] = float("nan")
        return row
    seconds = sum(s.median_seconds for s in group)
    decode_seconds = sum(s.decode_seconds for s in group)
    tokens = sum(s.computed_tokens for s in group)
    rows_total = sum(s.batch_size for s in group)
    row["tokens_per_s"] = tokens / seconds
    row["decode_tokens_per_s"] = _decode_rate(tokens - rows_total, decode_seconds)
    row["seconds"] = seconds
    row["decode_seconds"] = decode_seconds
    row["first_pass_seconds"] = sum(median(s.prefill_seconds) for s in group)  # to the first token
    if method.family != "full" and all(s.reference_seconds for s in group):
        row["reference_seconds"] = sum(median(s.reference_seconds) for s in group)
        row["reference_decode_seconds"] = sum(s.reference_decode_seconds for s in group)
    if all(s.batch_index in reference for s in group):
        row["decode_ratio_per_batch"] = [_batch_decode_ratio(s, reference[s.batch_index]) for s in group]
    pairs = [
        (out, ref) for s in group for out, ref in zip(s.rows, reference[s.batch_index].rows, strict=True)
    ]
    row["identical_share"] = sum(out == ref for out, ref in pairs) / len(pairs)
    if judge is not None:  # the first row's text, to read what the numbers judged
        row["first_output"] = judge.tokenizer.decode(group[0].rows[0], skip_special_tokens=True)
    if workload.kind == "code" and judge is not None:
        _code_quality(row, group, reference, workload, judge)
    _vericache_numbers(row, group)
    if method.family == "full":
        row["full_tier_bytes"] = row["device_kv_bytes"] = sum(s.kv_bytes for s in group)
    peaks = [b for s in group for b in s.peak_rss_bytes]
    if peaks:  # the whole process at its peak in any run: weights, both tiers, activations, the heap
        row["peak_rss_bytes"] = max(peaks)
    return row


def _batch_decode_ratio(sample: Sample, full: Sample) -> float:
    """One prompt batch's decode speed against full cache's on it (in a paired run, the full-cache call that ran
    beside it): a cell's ratio pools its batches, and this shows whether one batch carried it."""
    reference = sample.reference_decode_seconds if sample.reference_seconds else full.decode_seconds
    return _ratio(
        _decode_rate(sample.computed_tokens - sample.batch_size, sample.decode_seconds),
        _decode_rate(full.computed_tokens - full.batch_size, reference),
    )


def _decode_rate(tokens: int, seconds: float) -> float:
    """Tokens after the first (which the prefill emits) per second of decoding."""
    return tokens / seconds if seconds > 0 else float("nan")


def _code_quality(row, group, reference, workload: Workload, judge: _Judge) -> None:
    parsed = passed = full_passed = 0
    total = 0
    for sample in group:
        problems = workload.batches[sample.batch_index].problems
        ref = reference[sample.batch_index]
        outputs = zip(sample.rows, sample.finished, ref.rows, ref.finished, problems, strict=True)
        for out, out_finished, ref_out, ref_finished, problem in outputs:
            total += 1
            code = judge.code(out, problem, out_finished)
            row.setdefault("first_code", code)  # what the parse and test checks judged
            parsed += parses(code)
            if judge.passes(problem, judge.code(ref_out, problem, ref_finished)):
                full_passed += 1
                passed += judge.passes(problem, code)
    row["parse_share"] = parsed / total
    row["full_passes"] = full_passed
    row["pass_share"] = passed / full_passed if full_passed else float("nan")


def _vericache_numbers(row: dict[str, Any], group: list[Sample]) -> None:
    stats = [s.stats for s in group if s.stats is not None]
    if not stats:
        return
    row_rounds = sum(st.row_rounds for st in stats)
    row["mean_accepted_per_round"] = (
        sum(st.accepted_tokens for st in stats) / row_rounds if row_rounds else 0.0
    )
    drafted = sum(st.drafted_tokens for st in stats)
    row["acceptance_rate"] = sum(st.accepted_tokens for st in stats) / drafted if drafted else 0.0
    row["rounds"] = sum(st.rounds for st in stats)
    row["plain_rounds"] = sum(st.plain_rounds for st in stats)  # rounds that drafted nothing
    row["draft_tier_bytes"] = max(st.draft_tier_bytes for st in stats)
    row["full_tier_bytes"] = max(st.full_tier_bytes for st in stats)
    # On the device: the draft tier plus the full tier's staging buffers (the full tier itself is on the host).
    row["device_kv_bytes"] = max(st.peak_draft_tier_bytes + st.peak_staging_bytes for st in stats)
    for name in (
        "prefill_seconds",
        "compress_seconds",
        "draft_seconds",
        "verify_seconds",
        "plain_round_seconds",
        "commit_seconds",
        "transfer_seconds",
        "transfer_wait_seconds",
    ):
        row[name] = sum(getattr(st, name, 0.0) for st in stats)
    row["bytes_to_device"] = sum(st.bytes_to_device for st in stats)
    for name in ("draft_forwards", "proposed_tokens", "proposal_kept_tokens", "proposals_verified_kept"):
        row[name] = sum(getattr(st, name, 0) for st in stats)
    positions = sum(sum(st.draft_lengths) for st in stats)
    row["draft_forwards_per_token"] = row["draft_forwards"] / positions if positions else float("nan")
    row["accepted_per_round"] = list(stats[0].accepted_per_round)
    row["draft_lengths"] = list(stats[0].draft_lengths)


def _fill_lossy_bytes(rows: list[dict[str, Any]]) -> None:
    """A compressed-only run keeps the same draft store as VeriCache with that compressor, and no full tier."""
    for row in rows:
        if row["family"] != "lossy":
            continue
        twin = next(
            (
                r
                for r in rows
                if r["family"] == "vericache"
                and r["workload"] == row["workload"]
                and (r["compressor"], r["compression_ratio"]) == (row["compressor"], row["compression_ratio"])
                and "draft_tier_bytes" in r
            ),
            None,
        )
        if twin is not None and "draft_tier_bytes" in twin:
            row["draft_tier_bytes"] = row["device_kv_bytes"] = twin["draft_tier_bytes"]
            row["full_tier_bytes"] = 0


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value / scale, spec)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| workload | method | tok/s | x full | decode tok/s | x full (decode) | identical | parses | passes* "
        "| accepted/round | draft tier MiB | full tier MiB | device KV MiB | peak RSS GiB | x full (decode), per batch |"
    )
    lines = [header, "|" + "---|" * 15]
    for r in rows:
        cells = [
            r["workload"],
            r["method"],
            _fmt(r.get("tokens_per_s"), ".2f"),
            _fmt(r.get("speed_ratio"), ".2f"),
            _fmt(r.get("decode_tokens_per_s"), ".2f"),
            _fmt(r.get("decode_ratio"), ".2f"),
            _fmt(r.get("identical_share"), ".0%"),
            _fmt(r.get("parse_share"), ".0%"),
            _fmt(r.get("pass_share"), ".0%"),
            _fmt(r.get("mean_accepted_per_round"), ".1f"),
            _fmt(r.get("draft_tier_bytes"), ".1f", MIB),
            _fmt(r.get("full_tier_bytes"), ".1f", MIB),
            _fmt(r.get("device_kv_bytes"), ".1f", MIB),
            _fmt(r.get("peak_rss_bytes"), ".1f", 2**30),
            ", ".join(_fmt(v, ".2f") for v in r.get("decode_ratio_per_batch", [])) or "n/a",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _overview_cell(row: dict[str, Any]) -> str:
    if "na" in row:
        return "n/a"
    cell = _fmt(row.get("decode_ratio"), ".2f")
    if row["family"] == "vericache":
        cell += f" ({_fmt(row.get('mean_accepted_per_round'), '.1f')})"
    identical = row.get("identical_share")
    if not row["lossless"]:
        cell += f" [{_fmt(identical, '.0%')}]"
    elif identical is not None and identical < 1.0:
        cell += f" DIFFERS [{_fmt(identical, '.0%')}]"
    return cell


def workload_order(rows: list[dict[str, Any]]) -> list[str]:
    """Workload names, shortest context and smallest batch first, then by kind: the column order of the overview
    table and the panel order of the figures, whatever order the (resumed) runs came in."""
    first: dict[str, dict[str, Any]] = {}
    for row in rows:
        first.setdefault(row["workload"], row)
    return sorted(
        first,
        key=lambda name: (first[name]["context_tokens"], first[name]["batch_size"], first[name]["kind"]),
    )


def overview_table(rows: list[dict[str, Any]]) -> str:
    """The whole run in one table: a method per line, a workload per column, decode speed against full cache; then
    each method's floor, its worst cell across the workloads, in decode and in whole-call (prefill included) speed."""
    workloads = workload_order(rows)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells = {(r["method"], r["workload"]): _overview_cell(r) for r in rows}
    header = ["method", *workloads, "floor (decode)", "floor (whole call)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        line = [cells.get((method, w), "") for w in workloads]
        mine = [r for r in rows if r["method"] == method and "na" not in r]
        for key in ("decode_ratio", "speed_ratio"):
            values = [r[key] for r in mine if isinstance(r.get(key), float) and not math.isnan(r[key])]
            line.append(_fmt(min(values), ".2f") if values else "n/a")
        lines.append(f"| {method} | " + " | ".join(line) + " |")
    return "\n".join(lines)


#: What `overview_table`'s cells say.
OVERVIEW_KEY = (
    "Decode tokens/s as a multiple of full-cache decoding. (n): VeriCache's accepted drafts per round. [k%]: share "
    "of a lossy method's outputs identical to full-cache output; a lossless method is marked DIFFERS if any "
    "output was not. n/a: HF's assisted decoding is batch-1 only. Floor: the method's worst cell across the "
    "workloads, in decode speed and in whole-call speed (prefill included), against full cache."
)


def time_table(rows: list[dict[str, Any]]) -> str:
    """Where VeriCache's time goes: prefill, compression (at prefill, or for a K/V-only compressor on the CPU when
    drafting first needs it), draft steps, verify passes (the part in plain rounds shown apart), commits into the
    tiers, transfers; with a proposer, draft-tier passes per drafted token and the share of proposed tokens kept."""
    lines = [
        "| workload | method | prefill s | vs full cache's | compress s | draft s | verify s | plain rounds s | "
        "commit s | transfer s (waited) | rounds (plain) | MiB staged | draft passes/token | proposals kept |",
        "|" + "---|" * 14,
    ]
    full = {r["workload"]: r.get("first_pass_seconds") for r in rows if r["family"] == "full"}
    for r in rows:
        if r["family"] != "vericache" or "rounds" not in r:
            continue
        mine, theirs, prefill = r.get("first_pass_seconds"), full.get(r["workload"]), r["prefill_seconds"]
        if "reference_seconds" in r:  # paired: the library's prefill timer ran through the other call's turns
            theirs, prefill = r["reference_seconds"] - r["reference_decode_seconds"], mine
        first_pass = f"{mine / theirs:.2f}x" if mine and theirs else "n/a"
        transfer = f"{r['transfer_seconds']:.2f} ({r['transfer_wait_seconds']:.2f})"
        lines.append(
            f"| {r['workload']} | {r['method']} | {prefill:.2f} | {first_pass} | "
            f"{r['compress_seconds']:.2f} | "
            f"{r['draft_seconds']:.2f} | {r['verify_seconds']:.2f} | {r.get('plain_round_seconds', 0.0):.2f} | "
            f"{r.get('commit_seconds', 0.0):.2f} | {transfer} | {r['rounds']} ({r.get('plain_rounds', 0)}) | "
            f"{r['bytes_to_device'] / MIB:.0f} | {_fmt(r.get('draft_forwards_per_token'), '.2f')} | "
            f"{_proposals_kept(r)} |"
        )
    return "\n".join(lines)


def _proposals_kept(row: dict[str, Any]) -> str:
    """Proposed tokens kept, by the draft tier or (in plain rounds) the full tier, of those offered."""
    if not row.get("proposed_tokens"):
        return "n/a"
    kept = row.get("proposal_kept_tokens", 0) + row.get("proposals_verified_kept", 0)
    return f"{kept / row['proposed_tokens']:.0%} of {row['proposed_tokens']}"


def _finite(value: Any) -> Any:
    """NaN (a method that does not apply) becomes null, so the file is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_report(rows: list[dict[str, Any]], out_dir: Path, settings: dict[str, Any]) -> tuple[Path, Path]:
    """results.json (settings and rows) and results.md (the two tables); returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    data = _finite({"settings": settings, "rows": rows})
    json_path.write_text(json.dumps(data, indent=1, default=str, allow_nan=False))
    notes = (
        "\n\n*passes: share of outputs that pass HumanEval's own tests, among problems whose full-cache output "
        "passes (n/a when none does). Speeds are medians over interleaved repeats in one process.\n"
    )
    if settings.get("paired"):
        notes += (
            "\nPaired run: each method ran side by side with a full-cache call, the two taking turns in "
            "half-second slices, and its ratios are to that call. Absolute speeds are those of calls taking "
            "turns.\n"
        )
    md_path.write_text(
        overview_table(rows)
        + f"\n\n{OVERVIEW_KEY}\n\nEvery number:\n\n"
        + markdown_table(rows)
        + notes
        + "\nWhere VeriCache's time goes:\n\n"
        + time_table(rows)
        + "\n"
    )
    return json_path, md_path
