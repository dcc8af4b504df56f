"""Remote prefix caching on the embedded model: a shared prefix of 2k-8k tokens stored in a real store
(a directory, and a Redis server started here on 127.0.0.1) behind an emulated link, a short suffix, 128 new tokens.

Three ways to answer, side by side in one run:
- recompute: stock `generate` on the whole prompt (no store);
- full-first: fetch the prefix's full KV from the store (as LMCache does), then stock `generate` with it, which
  prefills only the suffix;
- compressed-first: VeriCache with `prefix_store`: fetch the compressed draft tier (snapkv, 1/8 of the KV), draft at
  once while the full KV streams in behind, and let the first verify pass prefill the suffix exactly.

With `--draft-dtype bfloat16`, each compressed-first way also runs drafting on a bfloat16 copy of the weights.
With `--stock-matmuls`, each also runs with `draft_matmul="stock"` (drafts through the model's own `linear`)
beside the default measured layouts.
With `--proposer prompt_lookup`, compressed-first also runs composed with prompt lookup proposing to the draft tier,
against the same full-first. Full-first does not run with transformers' own prompt lookup: in
transformers 5.24-5.25, assisted decoding's first pass feeds the whole prompt again on top of a cache passed in
(its `prepare_inputs_for_generation` gets no `next_sequence_length` there, where `_prefill` slices off what is
cached), so the output differs and the first token takes longer than recomputing the prompt.

Reports time to first token, end-to-end latency, decode tokens/s and whether each output equals recompute's
(identical share), per prefix, link and backend; writes results.json, table.md and plot.png.

    python benchmarks/prefix_reuse.py --out bench-results/prefix
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import vericache_hf
from vericache_hf import VeriCacheConfig, VeriCacheStats
from vericache_hf.compat import cache_kwargs
from vericache_hf.prefix import DiskStore, PrefixCache, RedisStore, ThrottledStore, fingerprint_for
from vericache_tools.embedded import load_embedded_model
from vericache_tools.prompts import code_context, humaneval_problems
from vericache_tools.redis_server import running_redis, server_binary
from vericache_tools.report import save_results

PROMPT_LOOKUP = " + prompt lookup"


def ways(args) -> list[tuple[str, dict]]:
    """Compressed-first's variants in a run: (method suffix, config changes); alone first."""
    out = [("", {})]
    if args.proposer == "prompt_lookup":
        out.append((PROMPT_LOOKUP, {"proposer": "prompt_lookup"}))
    if args.draft_dtype:
        out += [
            (f"{suffix}, {args.draft_dtype} drafts", {**changes, "draft_dtype": args.draft_dtype})
            for suffix, changes in list(out)
        ]
    if args.stock_matmuls:
        out += [
            (f"{suffix}, stock matmuls", {**changes, "draft_matmul": "stock"})
            for suffix, changes in list(out)
        ]
    return out


LINKS = {"1": (1e9, 2e-3), "5": (5e9, 0.5e-3), "25": (25e9, 0.2e-3)}  # Gbit/s: (bit/s, latency per request)


class FirstToken:
    """A streamer that notes when the first generated token arrives (the prompt comes first)."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def timed(run) -> tuple[torch.Tensor, float, float]:
    """(output, seconds to the first token, seconds end to end) of `run(streamer)`."""
    streamer = FirstToken()
    started = time.perf_counter()
    out = run(streamer)
    ended = time.perf_counter()
    return out, streamer.first - started, ended - started


def prompts(tokenizer, prefix_tokens: int, count: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The shared prefix (exactly `prefix_tokens` of code) and `count` requests: prefix + a short coding task."""
    prefix = tokenizer(code_context(tokenizer, prefix_tokens + 64), return_tensors="pt").input_ids[
        :, :prefix_tokens
    ]
    tasks = [problem["prompt"] for problem in humaneval_problems()[:count]]
    suffixes = [
        tokenizer("\n\n" + task, return_tensors="pt", add_special_tokens=False).input_ids for task in tasks
    ]
    return prefix, [torch.cat([prefix, suffix], dim=-1) for suffix in suffixes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--prefixes", default="2048,4096,7680", help="7680: the 8k cell, room left for the suffix"
    )
    parser.add_argument("--gbits", default="1,5,25", help=f"links among {sorted(LINKS)}")
    parser.add_argument("--backends", default="disk,redis")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=1, help="requests (suffixes) per cell")
    parser.add_argument(
        "--proposer",
        choices=["none", "prompt_lookup"],
        default="none",
        help="also run both ways composed with it",
    )
    parser.add_argument(
        "--draft-dtype",
        choices=["bfloat16", "float16"],
        default=None,
        help="also run compressed-first (and composed) drafting on a copy of the weights in this type",
    )
    parser.add_argument(
        "--stock-matmuls",
        action="store_true",
        help="also run each compressed-first way with draft_matmul='stock' (the model's own linear in drafts)",
    )
    parser.add_argument("--out", default="bench-results/prefix")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_embedded_model()
    fingerprint = fingerprint_for(model)
    new = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    rows = []
    with tempfile.TemporaryDirectory() as disk, running_redis(server_binary()) as url:
        stores = {"disk": DiskStore(disk, max_bytes=64 << 30), "redis": RedisStore(url, timeout=30)}
        for prefix_tokens in (int(n) for n in args.prefixes.split(",")):
            prefix, requests = prompts(tokenizer, prefix_tokens, args.requests)
            for backend in args.backends.split(","):
                store = stores[backend]
                config = dict(compressor="snapkv", compression_ratio=0.875, prefix_store=store)
                vericache_hf.warm_prefix(model, prefix, VeriCacheConfig(**config))
                for index, ids in enumerate(requests):
                    for result in cell(
                        model, ids, store, prefix_tokens, backend, config, fingerprint, new, args
                    ):
                        rows.append({"request": index, **result})
    report(rows, Path(args.out), args)


def cell(model, ids, store, prefix_tokens, backend, config, fingerprint, new, args) -> list[dict]:
    """One request answered by recompute, then by full-first and compressed-first over each link."""
    reference, ttft, total = timed(lambda streamer: model.generate(ids, streamer=streamer, **new))
    rows = [row("recompute", backend, prefix_tokens, "-", ttft, total, True, args)]
    for gbit in args.gbits.split(","):
        bandwidth, latency = LINKS[gbit]
        link = ThrottledStore(store, bandwidth / 8, latency)

        def full_first(streamer, link=link):
            hit, kv = PrefixCache(link).load(ids[:, :prefix_tokens], fingerprint)
            assert hit == prefix_tokens, f"the full prefix is not stored ({hit} tokens hit)"
            cache = DynamicCache(ddp_cache_data=kv)
            return model.generate(ids, **cache_kwargs(model, cache), streamer=streamer, **new)

        out, ttft, total = timed(full_first)
        same = torch.equal(out, reference)
        rows.append(row("full-first", backend, prefix_tokens, gbit, ttft, total, same, args))
        for suffix, composed in ways(args):
            stats = VeriCacheStats()
            vericache = VeriCacheConfig(**{**config, **composed, "prefix_store": link}, stats=stats)
            out, ttft, total = timed(
                lambda streamer, vericache=vericache: model.generate(
                    ids, streamer=streamer, generation_mode="vericache", vericache_config=vericache, **new
                )
            )
            same = torch.equal(out, reference)
            method = "compressed-first" + suffix
            rows.append(row(method, backend, prefix_tokens, gbit, ttft, total, same, args, stats))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def row(method, backend, prefix, gbit, ttft, total, same, args, stats: VeriCacheStats | None = None) -> dict:
    out = {
        "method": method,
        "backend": backend,
        "prefix": prefix,
        "gbit": gbit,
        "ttft_s": round(ttft, 3),
        "end_to_end_s": round(total, 3),
        "decode_tok_s": round((args.new_tokens - 1) / (total - ttft), 2),
        "identical": same,
    }
    if stats is not None:
        out |= {
            "reused": stats.prefix_tokens_reused,
            "compressed_mib": round(stats.prefix_compressed_bytes / 2**20, 1),
            "full_mib": round(stats.prefix_full_bytes / 2**20, 1),
            "store_wait_s": round(stats.prefix_wait_seconds, 3),
            "load_s": round(stats.prefix_load_seconds, 3),
            "load_cpu_s": round(stats.prefix_load_cpu_seconds, 3),
            "first_draft_s": round(stats.first_draft_seconds, 3),
            "first_round_drafts": stats.draft_lengths[0] if stats.draft_lengths else 0,
            "first_round_accepted": stats.accepted_per_round[0] if stats.accepted_per_round else 0,
            # after the first round: what the draft tier earns over the rest of the answer
            "later_rounds": len(stats.accepted_per_round[1:]) + stats.plain_rounds,
            "later_accepted_per_round": round(mean(stats.accepted_per_round[1:] or [0.0]), 2),
            "compress_s": round(stats.compress_seconds, 3),
        }
    return out


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def report(rows: list[dict], out: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = sorted({r["backend"] for r in rows})
    prefixes = sorted({r["prefix"] for r in rows})
    links = [g for g in args.gbits.split(",")]

    def cell(method, backend, prefix, gbit):
        return [
            r
            for r in rows
            if (r["method"], r["backend"], r["prefix"], r["gbit"]) == (method, backend, prefix, gbit)
        ]

    header = [
        "| backend | prefix | link (Gbit/s) | recompute e2e (s) | full-first TTFT / e2e (s) | compressed-first TTFT / "
        "e2e (s) | e2e speedup | TTFT sooner by (s) | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines = [
        f"Means over {args.requests} request(s) per cell, {args.new_tokens} new tokens; speedup = full-first / "
        "compressed-first, per request, then averaged.",
        "",
        *header,
    ]
    suffixes = [suffix for suffix, _ in ways(args)]
    for suffix in suffixes:
        if suffix:
            lines += ["", f"Compressed-first{suffix}, against the same full-first:", "", *header]
        for backend in backends:
            for prefix in prefixes:
                recompute = cell("recompute", backend, prefix, "-")
                for gbit in links:
                    full, fast = (
                        cell("full-first", backend, prefix, gbit),
                        cell("compressed-first" + suffix, backend, prefix, gbit),
                    )
                    pairs = list(zip(full, fast, strict=True))
                    speedup = mean(f["end_to_end_s"] / c["end_to_end_s"] for f, c in pairs)
                    sooner = mean(f["ttft_s"] - c["ttft_s"] for f, c in pairs)
                    same = sum(r["identical"] for r in full + fast + recompute)
                    lines.append(
                        f"| {backend} | {prefix} | {gbit} | {mean(r['end_to_end_s'] for r in recompute):.2f} | "
                        f"{mean(r['ttft_s'] for r in full):.2f} / {mean(r['end_to_end_s'] for r in full):.2f} | "
                        f"{mean(r['ttft_s'] for r in fast):.2f} / {mean(r['end_to_end_s'] for r in fast):.2f} | "
                        f"{speedup:.2f}x | {sooner:+.2f} | {same}/{len(full + fast + recompute)} |"
                    )
    save_results(out, rows, lines)
    figure, axes = plt.subplots(
        len(backends), len(prefixes), figsize=(4 * len(prefixes), 3.2 * len(backends)), squeeze=False
    )
    for i, backend in enumerate(backends):
        for j, prefix in enumerate(prefixes):
            ax = axes[i][j]
            for method, marker in (("full-first", "o"), ("compressed-first", "s")):
                ends = [mean(r["end_to_end_s"] for r in cell(method, backend, prefix, g)) for g in links]
                ax.plot([float(g) for g in links], ends, marker=marker, label=method)
            recompute = mean(r["end_to_end_s"] for r in cell("recompute", backend, prefix, "-"))
            ax.axhline(recompute, color="grey", linestyle="--", label="recompute")
            ax.set_xscale("log")
            ax.set_title(f"{backend}, {prefix}-token prefix")
            ax.set_xlabel("link (Gbit/s)")
            ax.set_ylabel(f"end to end, {args.new_tokens} tokens (s)")
            ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "plot.png", dpi=110)


if __name__ == "__main__":
    main()
