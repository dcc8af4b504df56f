"""The full tier's device staging against context, on the embedded model: whole layers against fixed-size chunks.

With `stage_on_cpu=True` a CPU runs the accelerator's path (the full tier copied through staging buffers by the
transfer thread), so what a GPU would hold for the full tier is measured here as `peak_staging_bytes`. For each
context, stock `generate` and VeriCache with whole-layer staging (`staging_chunk_tokens=None`) and with chunks
(the default, 2048 tokens, merged by log-sum-exp in the verify pass's attention): the staging peak, whether the output
equals stock's (float32: the chunked merge adds rounding of its own), and the verify pass's seconds.

    python benchmarks/staging_bound.py --contexts 2048,8192 --out docs/benchmarks/staging-bound-in-context/results.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import vericache_hf
from vericache_tools.bench.workloads import build_workloads
from vericache_tools.embedded import load_embedded_model

DEFAULT_CHUNK = vericache_hf.VeriCacheConfig.staging_chunk_tokens


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    model, tokenizer = load_embedded_model()
    rows = []
    for context in map(int, args.contexts.split(",")):
        (workload,) = build_workloads(
            tokenizer, ["code"], [context], [args.batch], args.batch, max_positions=8192,
            max_new_tokens=args.max_new_tokens,
        )  # fmt: skip
        batch = workload.batches[0]
        common = dict(
            attention_mask=batch.attention_mask, max_new_tokens=args.max_new_tokens, do_sample=False
        )
        stock = model.generate(batch.input_ids, **common)
        for chunk in (None, DEFAULT_CHUNK):
            stats = vericache_hf.VeriCacheStats()
            config = vericache_hf.VeriCacheConfig(
                compressor="snapkv", compression_ratio=0.875, stage_on_cpu=True, staging_chunk_tokens=chunk,
                stats=stats,
            )  # fmt: skip
            started = time.perf_counter()
            out = model.generate(
                batch.input_ids, generation_mode="vericache", vericache_config=config, **common
            )
            row = dict(
                workload=workload.name,
                prompt_tokens=batch.input_ids.shape[-1],
                staging="whole layers" if chunk is None else f"chunks of {chunk}",
                peak_staging_MiB=round(stats.peak_staging_bytes / 2**20, 2),
                identical=bool(torch.equal(out, stock)),
                verify_passes=stats.rounds + stats.plain_rounds,
                verify_s=round(stats.verify_seconds, 2),
                call_s=round(time.perf_counter() - started, 1),
                chunk_transfers=stats.chunk_transfers,
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
