"""What sharing one link buys, on a CPU: the full tier is staged through the transfer queue
(`stage_on_cpu`) over an emulated link, and requests run in lockstep (one `generate` call, the batch drafts and then
verifies together), through the engine in one cohort (shared passes; rows join after their own prefill), in two
staggered cohorts (one's copies run while the other drafts or verifies), or alone (one call per request on worker
threads, one shared queue). Embedded model, fp32; prompts of code with different tasks. Each run records a
`Timeline`; `timeline.png` draws the prefill, draft, transfer and verify spans of every track (a request's prefill,
a cohort's rounds; lockstep's batch is one track) at the `--plot-link` bandwidth.

    python benchmarks/emulated_link.py --out bench-results/link
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import vericache_hf
from vericache_hf import VeriCacheConfig, VeriCacheStats
from vericache_hf.timeline import KINDS
from vericache_tools.embedded import load_embedded_model
from vericache_tools.prompts import humaneval_problems, long_code_prompt
from vericache_tools.report import save_results


def run(method: str, model, tokenizer, prompts: list[list[int]], link: float, new_tokens: int, workers: int):
    stats, timeline = VeriCacheStats(), vericache_hf.Timeline()
    config = VeriCacheConfig(
        compressor="snapkv",
        compression_ratio=0.875,
        stage_on_cpu=True,
        emulated_link_bytes_per_s=link,
        stats=stats,
        timeline=timeline,
    )
    started = time.perf_counter()
    if method == "lockstep":
        batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
        out = model.generate(
            **batch,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            generation_mode="vericache",
            vericache_config=config,
        )
        generated = [row[batch["input_ids"].shape[-1] :].tolist() for row in out]
    else:
        results = vericache_hf.generate_batch(
            model,
            prompts,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            vericache_config=config,
            max_concurrent=workers,
            **ENGINE[method],
        )
        generated = [result.generated_tokens for result in results.values()]
    seconds = time.perf_counter() - started
    return generated, {
        "method": method,
        "link_GBps": link / 1e9,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(len(prompts) * new_tokens / seconds, 2),
        "transfer_s": round(stats.transfer_seconds, 2),
        "transfer_wait_s": round(stats.transfer_wait_seconds, 2),
        "hidden_share": round(stats.transfer_hidden_share, 3),
        "gib_to_device": round(stats.bytes_to_device / 2**30, 2),
        # wall time a copy ran while some request drafted (or verified), over the wall time any copy ran
        "copy_beside_draft": round(ratio(timeline.overlap_seconds("transfer", "draft"), timeline), 3),
        "copy_beside_verify": round(ratio(timeline.overlap_seconds("transfer", "verify"), timeline), 3),
        "timeline": merged(timeline.to_dicts()),
    }


#: How each engine method groups its requests.
ENGINE = {
    "one-cohort": {"cohorts": 1},
    "two-cohorts": {"cohorts": 2},
    "alone": {"cohort_size": 1},
}


def merged(spans: list[dict], gap: float = 2e-3) -> list[dict]:
    """Spans with each track's back-to-back spans of one kind joined (a round's layer copies become one bar)."""
    out: list[dict] = []
    last: dict[tuple[str, str], dict] = {}
    for span in spans:
        key = (span["track"], span["kind"])
        before = last.get(key)
        if before is not None and span["start"] - before["end"] <= gap:
            before["end"] = max(before["end"], span["end"])
            continue
        last[key] = dict(span)
        out.append(last[key])
    return out


def ratio(seconds: float, timeline) -> float:
    busy = timeline.busy_seconds("transfer")
    return seconds / busy if busy else 0.0


COLORS = dict(zip(KINDS, ("tab:gray", "tab:blue", "tab:orange", "tab:green"), strict=True))


def plot_timelines(rows: list[dict], link_gbps: float, out: Path) -> None:
    """One panel per method: a row per track, a bar per span (copies drawn thin, over the compute spans)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [r for r in rows if r["link_GBps"] == link_gbps]
    figure, axes = plt.subplots(len(chosen), 1, figsize=(11, 1.2 + 0.6 * 4 * len(chosen)), squeeze=False)
    for ax, row in zip(axes[:, 0], chosen, strict=True):
        tracks = sorted({span["track"] for span in row["timeline"]})
        for y, track in enumerate(tracks):
            for span in (s for s in row["timeline"] if s["track"] == track):
                thin = span["kind"] == "transfer"
                ax.barh(
                    y + (0.25 if thin else 0),
                    span["end"] - span["start"],
                    left=span["start"],
                    height=0.25 if thin else 0.7,
                    color=COLORS[span["kind"]],
                )
        ax.set_yticks(range(len(tracks)), tracks)
        ax.set_title(f"{row['method']}, {link_gbps:g} GB/s: {row['tokens_per_s']} tokens/s")
        ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for color in COLORS.values()]
    axes[0, 0].legend(handles, list(COLORS), loc="upper right", fontsize=8, ncol=4)
    figure.tight_layout()
    figure.savefig(out / "timeline.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", default="4,16,32,64", help="GB/s")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--plot-link", type=float, default=4.0, help="GB/s of the timeline plot")
    parser.add_argument("--methods", default="lockstep,one-cohort,two-cohorts,alone")
    parser.add_argument("--out", default="bench-results/link")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_embedded_model()
    problems = humaneval_problems()[: args.requests]
    prompts = [
        tokenizer(
            long_code_prompt(tokenizer, p, context_tokens=args.context), add_special_tokens=False
        ).input_ids
        for p in problems
    ]
    reference = [
        model.generate(
            torch.tensor([p]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    rows = []
    for link in (float(g) * 1e9 for g in args.links.split(",")):
        for method in args.methods.split(","):
            generated, row = run(method, model, tokenizer, prompts, link, args.new_tokens, args.requests)
            row["identical"] = sum(g == r for g, r in zip(generated, reference, strict=True))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "timeline"}), flush=True)
    lines = [
        f"{args.requests} requests, {args.context}-token code prompts, {args.new_tokens} new tokens, snapkv@0.875, "
        "full tier staged through the transfer queue (`stage_on_cpu`) over an emulated link.",
        "",
        "Copy time beside drafting / verifying: the share of the wall time any copy ran during which some request "
        "drafted / verified (from the run's timeline).",
        "",
        "| link (GB/s) | method | tokens/s | transfer (s) | waited (s) | hidden share | copy beside drafting | "
        "copy beside verifying | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['link_GBps']:g} | {r['method']} | {r['tokens_per_s']} | {r['transfer_s']} | {r['transfer_wait_s']} | "
        f"{r['hidden_share']:.0%} | {r['copy_beside_draft']:.0%} | {r['copy_beside_verify']:.0%} | "
        f"{r['identical']}/{args.requests} |"
        for r in rows
    ]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    plot_timelines(rows, args.plot_link, Path(args.out))
    timelines = {f"{r['method']}@{r['link_GBps']:g}": r.pop("timeline") for r in rows}
    save_results(args.out, rows, lines)
    chosen = {name: spans for name, spans in timelines.items() if name.endswith(f"@{args.plot_link:g}")}
    (Path(args.out) / "timeline.json").write_text(json.dumps(chosen))


if __name__ == "__main__":
    main()
