"""Many requests on the embedded model, on a CPU: code prompts of mixed length, arriving all at once or
as a Poisson stream, answered by stock static batching, transformers' continuous batching, VeriCache in static
batches (lockstep), the VeriCache engine with every request alone (`cohort_size=1`: one call per request on
`--batch` worker threads, one transfer queue) and the VeriCache engine with cohorts (requests share forward passes,
joining after their prefill and leaving when they stop; cohorts planned from measured times, `--concurrent`
requests at once).

Each method runs in its own process, so that its peak RSS is its own. Reports total tokens/s, time to first token
(from each request's arrival), p50/p99 inter-token latency, the share of requests identical to stock `generate` of
that prompt alone, and peak RSS. Where requests overlap (the engine, continuous batching), inter-token gaps are also
split by whether another request was prefilling meanwhile (from when it left the queue to its first token): what a
new request's prefill costs the running ones. A static batch waits for its last request to arrive, and runs after
the batch before it.

    python benchmarks/serving.py --out bench-results/serving
    python benchmarks/serving.py --requests 16 --contexts 2048,4096,6144,8192 --arrivals poisson --rate 0.05
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

METHODS = (
    "stock-batches",
    "hf-generate-batch",
    "hf-generate-batch-no-sharing",
    "vericache-batches",
    "vericache-engine-alone",
    "vericache-engine",
    "vericache-engine-no-prefix-cache",
)


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


def arrival_offsets(args) -> list[float]:
    """Seconds after the start at which each request arrives: all at 0, or a seeded Poisson stream at `rate`."""
    if args.arrivals == "at-once":
        return [0.0] * args.requests
    draw, at, offsets = random.Random(args.seed), 0.0, []
    for _ in range(args.requests):
        offsets.append(at)
        at += draw.expovariate(args.rate)
    return offsets


def wait_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.perf_counter()))


def gaps_beside_prefills(outputs: list) -> tuple[list[float], list[float]]:
    """Inter-token gaps of every request, split by whether another request was prefilling during the gap (from
    the moment it left the queue, `lifespan[0]`, to its first token)."""
    prefills = [(o.lifespan[0], o.timestamps[0]) for o in outputs if o.timestamps and o.lifespan[0] > 0]
    beside, apart = [], []
    for i, output in enumerate(outputs):
        stamps = output.timestamps or []
        others = [p for j, p in enumerate(prefills) if j != i]
        for a, b in zip(stamps, stamps[1:], strict=False):
            (beside if any(start < b and end > a for start, end in others) else apart).append(b - a)
    return beside, apart


def percentile(values: list[float], share: float) -> float | None:
    values = sorted(values)
    return round(1000 * values[int(share * (len(values) - 1))], 1) if values else None


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
    offsets = arrival_offsets(args)
    started = time.perf_counter()
    tokens, first, gaps, beside, apart, shared = [], [], [], [], [], {}
    if method in ("stock-batches", "vericache-batches"):
        mode = (
            {"generation_mode": "vericache", "vericache_config": config}
            if method == "vericache-batches"
            else {}
        )
        for at in range(0, len(inputs), args.batch):
            group = inputs[at : at + args.batch]
            wait_until(started + max(offsets[at : at + args.batch]))  # the batch's last request arrives
            batch = tokenizer.pad({"input_ids": group}, return_tensors="pt")
            streamer = Times()
            out = model.generate(**batch, streamer=streamer, **new, **mode)
            tokens += [row[batch["input_ids"].shape[-1] :].tolist() for row in out]
            first += [streamer.times[0] - started - offsets[at + i] for i in range(len(group))]
            steps = [b - a for a, b in zip(streamer.times, streamer.times[1:], strict=False)]
            gaps += steps * len(group)  # every row of a static batch waits the same step
    else:
        outputs, shared = serve_as_they_arrive(method, model, inputs, offsets, started, config, new, args)
        for output, offset in zip(outputs, offsets, strict=True):
            tokens.append(list(output.generated_tokens))
            stamps = output.timestamps or []
            if stamps:
                first.append(stamps[0] - started - offset)
                gaps += [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        beside, apart = gaps_beside_prefills(outputs)
    seconds = time.perf_counter() - started
    return {
        "method": method,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(sum(len(t) for t in tokens) / seconds, 2),
        "ttft_mean_s": round(statistics.mean(first), 2) if first else None,
        "itl_p50_ms": percentile(gaps, 0.5),
        "itl_p99_ms": percentile(gaps, 0.99),
        "itl_p99_beside_prefill_ms": percentile(beside, 0.99),
        "itl_p99_apart_ms": percentile(apart, 0.99),
        "gaps_beside_prefill": len(beside),
        "tokens": tokens,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "rows_per_round": round(shared.get("mean_rows_per_round", 0.0), 2),
        "prefix_tokens_reused": shared.get("prefix_tokens_reused"),
    }


def serve_as_they_arrive(method, model, inputs, offsets, started, config, new, args) -> list:
    """Add each request at its arrival time to the VeriCache engine or to transformers' continuous batching
    manager; returns their finished `GenerationOutput`s in input order, and the engine's cohort stats."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    import vericache_hf

    if method.startswith("vericache-engine"):
        alone = method == "vericache-engine-alone"
        engine = vericache_hf.VeriCacheEngine(
            model,
            config,
            max_concurrent=args.batch if alone else args.concurrent,
            cohort_size=1 if alone else "auto",
            prefix_cache_memory=None if method.endswith("no-prefix-cache") else "8GiB",
            **new,
        )
        with engine:
            ids = []
            for prompt, offset in zip(inputs, offsets, strict=True):
                wait_until(started + offset)
                ids.append(engine.add_request(prompt))
            results = [engine.get_result(request_id) for request_id in ids]
            return results, {**engine.cohort_stats(), **engine.prefix_stats()}
    generation = GenerationConfig(do_sample=False, max_new_tokens=new["max_new_tokens"])
    # transformers shares KV blocks between requests with a common prefix by default: its prefix caching
    sharing = ContinuousBatchingConfig(allow_block_sharing=not method.endswith("no-sharing"))
    with model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=sharing
    ) as manager:
        ids = []
        for prompt, offset in zip(inputs, offsets, strict=True):
            wait_until(started + offset)
            ids.append(
                manager.add_request(prompt, max_new_tokens=new["max_new_tokens"], record_timestamps=True)
            )
        done = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before every request finished")
    return [done[request_id] for request_id in ids], {}


def stock_reference(args, compute) -> list[list[int]]:
    """Stock `generate`'s tokens for each prompt alone: the longest part of a run on this CPU, and the same every
    time, so kept (in the user's cache directory) per prompts, lengths and transformers version."""
    import transformers

    path = os.path.expanduser("~/.cache/vericache-hf/serving-reference.json")
    key = f"{args.requests}|{args.contexts}|{args.new_tokens}|{transformers.__version__}"
    kept = {}
    if os.path.exists(path):
        with open(path) as file:
            kept = json.load(file)
    if key not in kept:
        kept[key] = compute()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as file:
            json.dump(kept, file)
    return kept[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--contexts", default="1024,2048,3072,4096")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--batch",
        type=int,
        default=4,
        help="static batch size, and the engine's workers when requests run alone",
    )
    parser.add_argument(
        "--concurrent", type=int, default=16, help="requests the engine with cohorts serves at once"
    )
    parser.add_argument("--arrivals", choices=("at-once", "poisson"), default="at-once")
    parser.add_argument("--rate", type=float, default=0.05, help="Poisson arrivals per second")
    parser.add_argument("--seed", type=int, default=0, help="the Poisson stream's seed")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default="bench-results/serving")
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

    reference = stock_reference(args, lambda: child("reference")["tokens"])
    rows = []
    for method in args.methods.split(","):
        row = child(method)
        row["identical"] = sum(a == b for a, b in zip(row.pop("tokens"), reference, strict=True))
        rows.append(row)
        print(json.dumps(row), flush=True)
    arriving = (
        "arriving at once"
        if args.arrivals == "at-once"
        else f"arriving as a Poisson stream of {args.rate}/s (seed {args.seed})"
    )
    lines = [
        f"{args.requests} requests {arriving}, code prompts of {args.contexts} tokens, {args.new_tokens} new "
        f"tokens, greedy; static batches of {args.batch}, the engine alone with {args.batch} workers, the engine "
        f"with cohorts serving {args.concurrent} at once; VeriCache snapkv@0.875.",
        "",
        "| method | tokens/s | mean TTFT (s) | ITL p50 (ms) | ITL p99 (ms) | ITL p99 beside a prefill (ms, gaps) | "
        "ITL p99 otherwise (ms) | identical | peak RSS (MiB) | requests per shared pass | prefix tokens reused |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {r['tokens_per_s']} | {r['ttft_mean_s']} | {r['itl_p50_ms']} | {r['itl_p99_ms']} | "
        f"{r['itl_p99_beside_prefill_ms']} ({r['gaps_beside_prefill']}) | {r['itl_p99_apart_ms']} | "
        f"{r['identical']}/{args.requests} | {r['peak_rss_mib']} | {r['rows_per_round'] or ''} | "
        f"{'' if r['prefix_tokens_reused'] is None else r['prefix_tokens_reused']} |"
        for r in rows
    ]
    save_results(args.out, rows, lines)


if __name__ == "__main__":
    main()
