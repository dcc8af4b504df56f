"""Many requests on the embedded model (issue 21, part 6, CPU): code prompts of mixed length, all arriving at once,
answered by stock static batching, transformers' continuous batching, VeriCache in static batches (lockstep) and
the VeriCache engine (one call per request on worker threads, one transfer queue).

Each method runs in its own process, so that its peak RSS is its own. Reports total tokens/s, time to first token,
p50/p99 inter-token latency (where the method records per-token times), the share of requests identical to stock
`generate` of that prompt alone, and peak RSS.

    python benchmarks/serving.py --out docs/bench-serving
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")

METHODS = ("stock-batches", "hf-generate-batch", "vericache-batches", "vericache-engine")


def prompts(tokenizer, count: int, contexts: list[int]) -> list[list[int]]:
    from vericache_tools.prompts import humaneval_problems, long_code_prompt

    problems = humaneval_problems()
    return [
        tokenizer(
            long_code_prompt(tokenizer, problems[i], context_tokens=contexts[i % len(contexts)]),
            add_special_tokens=False,
        ).input_ids
        for i in range(count)
    ]


class Times:
    """A streamer that notes when each step's tokens arrive (the prompt comes first)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.calls = 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run(method: str, args) -> dict:
    import torch

    import vericache_hf
    from vericache_tools.embedded import load_embedded_model

    torch.set_num_threads(2)
    model, tokenizer = load_embedded_model()
    inputs = prompts(tokenizer, args.requests, [int(c) for c in args.contexts.split(",")])
    new = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    config = vericache_hf.VeriCacheConfig(compressor="snapkv", compression_ratio=0.875)
    if method == "reference":
        return {"tokens": [model.generate(torch.tensor([p]), **new)[0, len(p) :].tolist() for p in inputs]}
    started = time.perf_counter()
    tokens, first, gaps = [], [], []
    if method in ("stock-batches", "vericache-batches"):
        mode = (
            {"generation_mode": "vericache", "vericache_config": config}
            if method == "vericache-batches"
            else {}
        )
        for at in range(0, len(inputs), args.batch):
            group = inputs[at : at + args.batch]
            batch = tokenizer.pad({"input_ids": group}, return_tensors="pt")
            streamer = Times()
            out = model.generate(**batch, streamer=streamer, **new, **mode)
            tokens += [row[batch["input_ids"].shape[-1] :].tolist() for row in out]
            first += [streamer.times[0] - started] * len(group)
            steps = [b - a for a, b in zip(streamer.times, streamer.times[1:], strict=False)]
            gaps += steps * len(group)  # every row of a static batch waits the same step
    else:
        kwargs = {"generation_mode": "vericache", "vericache_config": config, "max_concurrent": args.batch}
        if method == "hf-generate-batch":
            kwargs = {"record_timestamps": True}
        results = model.generate_batch(inputs, **kwargs, **new)
        for output in results.values():
            tokens.append(list(output.generated_tokens))
            stamps = output.timestamps or []
            if stamps:
                first.append(stamps[0] - started)
                gaps += [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    seconds = time.perf_counter() - started
    gaps = sorted(gaps)
    return {
        "method": method,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(sum(len(t) for t in tokens) / seconds, 2),
        "ttft_mean_s": round(statistics.mean(first), 2) if first else None,
        "itl_p50_ms": round(1000 * gaps[len(gaps) // 2], 1) if gaps else None,
        "itl_p99_ms": round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 1) if gaps else None,
        "tokens": tokens,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--contexts", default="1024,2048,3072,4096")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="static batch size, and the engine's workers")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default="docs/bench-serving")
    parser.add_argument("--method", help=argparse.SUPPRESS)  # one method, in a child process
    args = parser.parse_args()
    from vericache_tools.report import save_results

    if args.method:
        print(json.dumps(run(args.method, args)))
        return
    forwarded = [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("method", "methods")
    ]

    def child(method: str) -> dict:
        done = subprocess.run(
            [sys.executable, __file__, f"--method={method}", *forwarded],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    reference = child("reference")["tokens"]
    rows = []
    for method in args.methods.split(","):
        row = child(method)
        row["identical"] = sum(a == b for a, b in zip(row.pop("tokens"), reference, strict=True))
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = [
        f"{args.requests} requests arriving at once, code prompts of {args.contexts} tokens, {args.new_tokens} new "
        f"tokens, greedy; static batches of {args.batch}, the engine with {args.batch} workers; VeriCache snapkv@0.875.",
        "",
        "| method | tokens/s | mean TTFT (s) | ITL p50 (ms) | ITL p99 (ms) | identical | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {r['tokens_per_s']} | {r['ttft_mean_s']} | {r['itl_p50_ms']} | {r['itl_p99_ms']} | "
        f"{r['identical']}/{args.requests} | {r['peak_rss_mib']} |"
        for r in rows
    ]
    save_results(args.out, rows, lines)


if __name__ == "__main__":
    main()
