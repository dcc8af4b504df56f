"""A real model on one CUDA GPU: VeriCache's decode rate against stock `generate` with the full KV on the device,
with the acceptance the model really gives (not forced, not replayed).

The model is the embedded SmolLM2-135M-Instruct, read from its GGUF (98 MB: `scripts/gpu_check.sh wheels` splits it
in two parts that travel in two calls to a warm machine, and the `real` step joins them), dequantized to float32.
The prompts are token ids made here with its tokenizer (`--save-prompts`), so the machine needs neither the tokenizer
nor the prompt data: HumanEval problems behind long source code, as the CPU bench's `code` workload.

Both methods greedy; the answers must be identical (float32). Reports whole-call and decode tokens/s (decode:
the call less a one-token call's time, which is its prefill), accepted drafts a round and the transfer share hidden.

    python benchmarks/gpu_real_acceptance.py --gguf /tmp/model/SmolLM2.gguf --prompts .gpu/model-b/prompts.pt
    python benchmarks/gpu_real_acceptance.py --save-prompts .gpu/model-b/prompts.pt --context 8192 --batch 4
    python benchmarks/gpu_real_acceptance.py --dry-run   # a tiny random model on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import vericache_hf  # noqa: E402


def save_prompts(path: Path, context: int, batch: int, max_new_tokens: int) -> None:
    from vericache_tools.bench.workloads import build_workloads
    from vericache_tools.embedded import load_embedded_model

    model, tokenizer = load_embedded_model()
    (workload,) = build_workloads(
        tokenizer, ["code"], [context], [batch], batch, max_positions=8192, max_new_tokens=max_new_tokens
    )
    prompts = workload.batches[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        dict(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask, name=workload.name), path
    )


def load_model(gguf: Path, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.to(device).eval()


def timed(call, device: str) -> tuple[object, float]:
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = call()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - started


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="the embedded model's GGUF, joined")
    parser.add_argument("--prompts", type=Path, help="token ids saved by --save-prompts")
    parser.add_argument("--save-prompts", type=Path, help="make the prompts here (on the CPU) and stop")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--compressor", default="snapkv")
    parser.add_argument("--ratio", type=float, default=0.875)
    parser.add_argument("--out", type=Path, help="a JSON file for the row")
    parser.add_argument("--dry-run", action="store_true", help="a tiny random model on the CPU")
    args = parser.parse_args(argv)
    if args.save_prompts:
        save_prompts(args.save_prompts, args.context, args.batch, args.max_new_tokens)
        return {}
    if args.dry_run:
        from gpu_offload import build_model

        device, model = "cpu", build_model("tiny", "cpu", torch.float32)
        ids = torch.randint(3, model.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0))
        prompts = dict(input_ids=ids, attention_mask=torch.ones_like(ids), name="random-200-b2")
        args.max_new_tokens = 16
    else:
        if not torch.cuda.is_available():
            raise SystemExit("No CUDA GPU found: this benchmark needs one (or pass --dry-run).")
        device, model = "cuda", load_model(args.gguf, "cuda")
        prompts = torch.load(args.prompts)
    ids, mask = prompts["input_ids"].to(device), prompts["attention_mask"].to(device)
    common = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    stock = partial_generate(model, ids, common, args.max_new_tokens)
    stats = vericache_hf.VeriCacheStats()
    config = vericache_hf.VeriCacheConfig(compressor=args.compressor, compression_ratio=args.ratio, stats=stats,
                                          stage_on_cpu=device == "cpu")  # fmt: skip
    _, prefill = timed(lambda: model.generate(ids, max_new_tokens=1, **common), device)
    reference, stock_seconds = timed(stock, device)
    out, seconds = timed(
        lambda: model.generate(
            ids,
            max_new_tokens=args.max_new_tokens,
            generation_mode="vericache",
            vericache_config=config,
            **common,
        ),  # fmt: skip
        device,
    )
    tokens = ids.shape[0] * args.max_new_tokens
    decode_stock = tokens / max(stock_seconds - prefill, 1e-9)
    decode_vericache = tokens / max(seconds - stats.prefill_seconds, 1e-9)
    row = dict(
        acceptance="real",
        model="tiny random (dry run)" if args.dry_run else "SmolLM2-135M-Instruct, float32",
        workload=prompts["name"],
        new_tokens=args.max_new_tokens,
        identical=bool(torch.equal(out, reference)),
        stock_tokens_per_s=round(tokens / stock_seconds, 2),
        vericache_tokens_per_s=round(tokens / seconds, 2),
        stock_decode_tokens_per_s=round(decode_stock, 2),
        vericache_decode_tokens_per_s=round(decode_vericache, 2),
        decode_speedup=round(decode_vericache / decode_stock, 2),
        accepted_per_round=round(stats.mean_accepted_per_round, 2),
        rounds=stats.rounds,
        plain_rounds=stats.plain_rounds,
        hidden_share=round(stats.transfer_hidden_share, 3),
    )
    print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=1))
    return row


def partial_generate(model, ids, common: dict, new_tokens: int):
    return lambda: model.generate(ids, max_new_tokens=new_tokens, **common)


if __name__ == "__main__":
    main()
