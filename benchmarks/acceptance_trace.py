"""Record how far real drafts run, round by round, so that a machine without the real model can replay them.

Runs the embedded model (SmolLM2-135M, float32, on this CPU) through VeriCache on the bench's workloads with a fixed
draft length, and writes, for every round, the tokens each row drafted and how many of them the verify pass
accepted (per row: rows accept different counts, so replayed commits are ragged as real ones are). Every output is
checked against stock `generate` first: a trace of a call that was not lossless is refused.

`benchmarks/gpu_offload.py --replay TRACE` then decodes at 8B shapes on random weights, drafting and accepting what
the trace says (labelled a replay: the acceptance is the embedded model's, the costs are the GPU's).

    python benchmarks/acceptance_trace.py --kinds code --context 8192 --batch 4 --draft-length 16 \\
        --out docs/benchmarks/acceptance-traces/code-8k-b4-k16.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import vericache_hf
from vericache_hf import loop
from vericache_tools.bench.workloads import build_workloads
from vericache_tools.embedded import load_embedded_model


class RoundRecorder:
    """Wraps `loop.record_round` for the duration of a call: each round's drafted length and per-row accepted
    counts, the rows that took part, and whether it was plain."""

    def __init__(self) -> None:
        self.rounds: list[dict] = []
        self._original = loop.record_round

    def __enter__(self) -> RoundRecorder:
        def record(cache, turn, drafted, accepted, io):
            self.rounds.append(
                dict(drafted=drafted, accepted=[int(a) for a in accepted], active=list(turn.active))
            )
            return self._original(cache, turn, drafted, accepted, io)

        loop.record_round = record
        return self

    def __exit__(self, *exc) -> None:
        loop.record_round = self._original


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="code")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-length", type=int, default=16)
    parser.add_argument("--compressor", default="snapkv")
    parser.add_argument("--ratio", type=float, default=0.875)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    model, tokenizer = load_embedded_model()
    workloads = build_workloads(
        tokenizer,
        args.kinds.split(","),
        [args.context],
        [args.batch],
        args.num_prompts,
        max_positions=model.config.max_position_embeddings,
        max_new_tokens=args.max_new_tokens,
    )
    calls = []
    for workload in workloads:
        for batch in workload.batches:
            started = time.perf_counter()
            stock = model.generate(
                batch.input_ids, attention_mask=batch.attention_mask, max_new_tokens=args.max_new_tokens,
                do_sample=False,
            )  # fmt: skip
            config = vericache_hf.VeriCacheConfig(
                compressor=args.compressor,
                compression_ratio=args.ratio,
                draft_length=args.draft_length,
                draft_schedule="fixed",
            )
            with RoundRecorder() as recorder:
                out = model.generate(
                    batch.input_ids, attention_mask=batch.attention_mask, max_new_tokens=args.max_new_tokens,
                    do_sample=False, generation_mode="vericache", vericache_config=config,
                )  # fmt: skip
            if not torch.equal(out, stock):
                raise SystemExit(
                    f"{workload.name}: VeriCache's output differs from stock generate; no trace kept."
                )
            calls.append(dict(workload=workload.name, rows=batch.batch_size, rounds=recorder.rounds))
            drafted = [r for r in recorder.rounds if r["drafted"]]
            mean = sum(sum(r["accepted"]) / len(r["accepted"]) for r in drafted) / max(1, len(drafted))
            print(f"{workload.name}: {len(recorder.rounds)} rounds, {mean:.1f} accepted a round, identical, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
    trace = dict(
        model="SmolLM2-135M-Instruct (embedded GGUF, float32)",
        device="cpu",
        compressor=f"{args.compressor}@{args.ratio}",
        draft_length=args.draft_length,
        max_new_tokens=args.max_new_tokens,
        identical=True,
        calls=calls,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(trace, indent=1))
    return trace


if __name__ == "__main__":
    main()
