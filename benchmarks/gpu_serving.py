"""Many requests at equal device memory, on one CUDA GPU: transformers' continuous batching
(`generate_batch`) with the full KV on the device, its pages sized to the KV budget, against the VeriCache engine,
which admits requests by the same budget counting only their draft tiers and staging buffers (full tiers in pinned
host memory) and staggers them in cohorts.

Random-weight Llama shapes (`gpu_offload.SIZES`), prompts of random tokens, greedy, bf16. Acceptance is whatever the
random model gives (reported, not forced), and each VeriCache answer is compared with the full-KV answer to the same
prompt: in bf16 the share identical is measured, not claimed. Reports total tokens/s (prefill included, requests
arriving at once), how many requests each ran at once, the share of the full tier's copy time hidden behind compute,
and the copies' host-to-device bandwidth beside a measured pinned copy's.

Host memory bounds the requests: each holds its full tier pinned (4 GiB at 8B shapes and 32k tokens), and a cohort's
tier grows by doubling its rows (old and new beside each other while it grows), so 8 requests of 32k peak at about
55 GB. The defaults (8 requests, a 16 GiB budget: the full KV of 3 at once) fit a 128 GB host.

    python benchmarks/gpu_serving.py --size 8b --context 32768 --budget 16GiB --out docs/gpu/serving
    python benchmarks/gpu_serving.py --dry-run   # a tiny model on the CPU, full tiers staged through the queue
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

sys.path.insert(0, str(Path(__file__).parent))

from gpu_offload import build_model, kv_bytes, sync  # noqa: E402

import vericache_hf  # noqa: E402
from vericache_hf.serving.admission import parse_bytes  # noqa: E402


def _significant(value: float) -> float:
    """Three significant digits: a CPU dry run copies a few MB/s, which one decimal of GB/s would show as 0.0."""
    return float(f"{value:.3g}")


def peak_bandwidth(device: str, size: int = 2**30) -> float | None:
    """Bytes/s of one pinned host-to-device copy of `size` bytes (the link's measured peak)."""
    if not device.startswith("cuda"):
        return None
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(size, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)  # warm-up
    sync(device)
    started = time.perf_counter()
    for _ in range(3):
        target.copy_(host, non_blocking=True)
    sync(device)
    return 3 * size / (time.perf_counter() - started)


def full_kv(model, prompts: torch.Tensor, budget: int, new_tokens: int) -> tuple[list[list[int]], dict]:
    """transformers' continuous batching (`generate_batch`, paged attention) with the full KV on the device, its
    pages sized to `budget`: the serving baseline at equal device memory."""
    dtype = model.dtype
    page = 256
    blocks = budget // kv_bytes(model, 1, page, dtype)
    # auto_switch_to_flash would switch the model itself to a flash kernel where one is found, for the VeriCache run
    # after this one too: both methods keep the model's sdpa
    config = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, auto_switch_to_flash=False)
    generation = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None)
    started = time.perf_counter()
    results = model.generate_batch(
        [row.tolist() for row in prompts], generation_config=generation, continuous_batching_config=config
    )
    sync(str(model.device))
    seconds = time.perf_counter() - started
    answers = [list(results[f"req_{i}"].generated_tokens) for i in range(len(prompts))]
    pages = -(-(prompts.shape[-1] + new_tokens) // page)  # a request's pages
    return answers, {"seconds": seconds, "at_once": blocks // pages}


def engine(model, prompts: torch.Tensor, budget: int, new_tokens: int, args) -> tuple[list[list[int]], dict]:
    stats, timeline = vericache_hf.VeriCacheStats(), vericache_hf.Timeline()
    config = vericache_hf.VeriCacheConfig(
        compressor=args.compressor,
        compression_ratio=args.compression_ratio,
        draft_schedule=args.draft_schedule,
        staging_buffers=args.staging_buffers,
        chunk_tokens=args.chunk_tokens,
        stage_on_cpu=model.device.type == "cpu",  # the dry run exercises the copies too
        stats=stats,
        timeline=timeline,
    )
    started = time.perf_counter()
    with vericache_hf.VeriCacheEngine(
        model,
        config,
        max_concurrent=len(prompts),
        device_memory_budget=budget,
        prefix_cache_memory=None,  # random prompts share nothing; keeping them would only cost host memory
        max_new_tokens=new_tokens,
        do_sample=False,
    ) as served:
        ids = served.add_requests(list(prompts))
        outputs = [served.get_result(request_id) for request_id in ids]
        memory, cohorts = served.memory_stats(), served.cohort_stats()
    seconds = time.perf_counter() - started
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first with: {failed[0]}")
    busy = timeline.busy_seconds("transfer")
    return [list(o.generated_tokens) for o in outputs], {
        "seconds": seconds,
        "at_once": memory["peak_running"],
        "capacity_vericache": memory["vericache_capacity"],
        "capacity_full_kv": memory["full_kv_capacity"],
        "rows_per_round": round(cohorts.get("mean_rows_per_round", 0.0), 2),
        "accepted_per_round": round(stats.mean_accepted_per_round, 2),
        "hidden_share": round(stats.transfer_hidden_share, 3),
        "copy_GBps": _significant(stats.bytes_to_device / busy / 1e9) if busy else None,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="8b", help="a gpu_offload.SIZES shape (tiny with --dry-run)")
    parser.add_argument("--context", type=int, default=32768, help="prompt tokens (256 with --dry-run)")
    parser.add_argument(
        "--new-tokens", type=int, default=1024, help="tokens each answer has (16 with --dry-run)"
    )
    parser.add_argument("--requests", type=int, default=8, help="requests, all arriving at once")
    parser.add_argument("--budget", default="16GiB", help="device memory for KV, both methods alike")
    parser.add_argument("--compressor", default="snapkv")
    parser.add_argument("--compression-ratio", type=float, default=0.875)
    parser.add_argument(
        "--draft-schedule",
        default=vericache_hf.VeriCacheConfig.draft_schedule,
        help="VeriCacheConfig.draft_schedule (fixed: draft every round, whatever the clock says)",
    )
    parser.add_argument("--staging-buffers", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=4096)
    parser.add_argument("--out", help="write results.json and table.md here")
    parser.add_argument("--dry-run", action="store_true", help="tiny config on the CPU, in seconds")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.dry_run:
        raise SystemExit(
            "No CUDA GPU found: this benchmark needs one (or pass --dry-run for the CPU smoke test)."
        )
    if args.dry_run:
        args.size, args.context, args.new_tokens, args.requests = "tiny", 256, 16, 6
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build_model(args.size, device, dtype)
    model.generation_config.eos_token_id = None  # every answer has --new-tokens tokens, in both methods
    per_request = kv_bytes(model, 1, args.context + args.new_tokens, dtype)
    # the dry run's budget holds two requests' full KV and a half (at this tiny size a VeriCache request holds
    # most of its own: the staging buffers are two of six layers, and the draft tier keeps room for a round)
    budget = int(2.5 * per_request) if args.dry_run else parse_bytes(args.budget)
    if budget < per_request:
        raise SystemExit(
            f"--budget holds no request's full KV ({per_request / 2**30:.2f} GiB each): raise it."
        )
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (args.requests, args.context), generator=generator)
    prompts = prompts.to(device)
    reference, stock = full_kv(model, prompts, budget, args.new_tokens)
    answers, served = engine(model, prompts, budget, args.new_tokens, args)
    tokens = args.requests * args.new_tokens
    peak = peak_bandwidth(device)
    row = {
        "size": args.size,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "requests": args.requests,
        "budget_GiB": round(budget / 2**30, 2),
        "full_kv_tokens_per_s": round(tokens / stock["seconds"], 2),
        "full_kv_at_once": stock["at_once"],
        "vericache_tokens_per_s": round(tokens / served["seconds"], 2),
        "speedup": round(stock["seconds"] / served["seconds"], 2),
        "identical": sum(a == b for a, b in zip(answers, reference, strict=True)),
        "peak_copy_GBps": _significant(peak / 1e9) if peak else None,
        **{k: v for k, v in served.items() if k != "seconds"},
    }
    print(json.dumps(row), flush=True)
    if args.out:
        from vericache_tools.report import save_results

        save_results(
            args.out,
            [row],
            [
                f"{args.requests} requests of {args.context} random tokens, {args.new_tokens} new, greedy, "
                f"{args.size} Llama shapes in {str(dtype).removeprefix('torch.')}, {row['budget_GiB']} GiB of "
                f"device memory for KV; VeriCache {args.compressor}@{args.compression_ratio}.",
                "",
                "| method | tokens/s | requests at once | identical | hidden share | copy GB/s (peak) |",
                "|---|---|---|---|---|---|",
                f"| full KV on the device | {row['full_kv_tokens_per_s']} | {stock['at_once']} | | | |",
                f"| VeriCache engine | {row['vericache_tokens_per_s']} | {served['at_once']} | "
                f"{row['identical']}/{args.requests} | {served['hidden_share']} | "
                f"{served['copy_GBps']} ({row['peak_copy_GBps']}) |",
            ],
        )
    return row


if __name__ == "__main__":
    main()
