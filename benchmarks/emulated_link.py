"""What sharing one link buys, on a CPU (issue 21, part 4): the full tier is staged through the transfer queue
(`stage_on_cpu`) over an emulated link, and requests run either in lockstep (one `generate` call, the batch drafts
and then verifies together) or through the engine (one call per request on worker threads, one shared queue, so
one request's copies run while another drafts). Embedded model, fp32; prompts of code with different tasks.

    python benchmarks/emulated_link.py --out docs/bench-link
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")

import torch

import vericache_hf
from vericache_hf import VeriCacheConfig, VeriCacheStats
from vericache_tools.embedded import load_embedded_model
from vericache_tools.prompts import humaneval_problems, long_code_prompt
from vericache_tools.report import save_results


def run(method: str, model, tokenizer, prompts: list[list[int]], link: float, new_tokens: int, workers: int):
    stats = VeriCacheStats()
    config = VeriCacheConfig(
        compressor="snapkv",
        compression_ratio=0.875,
        stage_on_cpu=True,
        emulated_link_bytes_per_s=link,
        stats=stats,
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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", default="4,16,32,64", help="GB/s")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default="docs/bench-link")
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
        for method in ("lockstep", "engine"):
            generated, row = run(method, model, tokenizer, prompts, link, args.new_tokens, args.requests)
            row["identical"] = sum(g == r for g, r in zip(generated, reference, strict=True))
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [
        f"{args.requests} requests, {args.context}-token code prompts, {args.new_tokens} new tokens, snapkv@0.875, "
        "full tier staged through the transfer queue (`stage_on_cpu`) over an emulated link.",
        "",
        "| link (GB/s) | method | tokens/s | transfer (s) | waited (s) | hidden share | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['link_GBps']:g} | {r['method']} | {r['tokens_per_s']} | {r['transfer_s']} | {r['transfer_wait_s']} | "
        f"{r['hidden_share']:.0%} | {r['identical']}/{args.requests} |"
        for r in rows
    ]
    save_results(args.out, rows, lines)


if __name__ == "__main__":
    main()
