"""The compressor table (docs/compressor_table.md), produced by one command: `vericache-hf table`.

For each compressor and ratio, on SmolLM2-135M (fp32) with HumanEval problems behind standard-library source
(`prompts.long_code_prompt`), greedy:
- draft-tier bytes as a share of the full cache (at the end of the run);
- the compressed-only output's first divergence from full-cache output (`lossy.compressed_only_generate`);
- mean accepted drafts per round under VeriCache (the bonus token not counted);
- VeriCache decode tokens/s relative to stock full-cache decoding (prefill excluded from both).
VeriCache output is checked against stock output on every run; a mismatch stops the command.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from vericache_hf import VeriCacheConfig
from vericache_hf.compressors import ComposedCompressor, KIVICompressor, SnapKVCompressor, build_compressor

from .arguments import HelpFormatter, comma_list
from .lossy import compressed_only_generate, first_divergence

#: name -> factory(ratio) -> compressor. Quantizers map the ratio to bits (0.5 -> 8, 0.75 -> 4, 0.875 -> 2).
TABLE_COMPRESSORS: dict[str, Any] = {
    "streaming_llm": lambda r: "streaming_llm",
    "snapkv": lambda r: "snapkv",
    "knorm": lambda r: "knorm",
    "h2o": lambda r: "h2o",
    "kivi": lambda r: "kivi",
    "hqq": lambda r: "hqq",
    "bnb": lambda r: "bnb",
    "fp8": lambda r: "fp8",
    "quanto": lambda r: "quanto",
    "snapkv+kivi4": lambda r: ComposedCompressor([SnapKVCompressor(r), KIVICompressor(bits=4)]),
}
DEFAULT_COMPRESSORS = ("streaming_llm", "snapkv", "knorm", "h2o", "kivi", "hqq", "bnb", "fp8", "snapkv+kivi4")


def timed(fn) -> tuple[Any, float]:
    """`fn()` and the wall seconds it took."""
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


@torch.no_grad()
def stock_decode_seconds(model, ids: torch.Tensor, new_tokens: int) -> float:
    """Stock full-cache decode time: a run of `new_tokens` minus a run of one token (the prefill)."""
    _, prefill_s = timed(lambda: model.generate(ids, do_sample=False, max_new_tokens=1))
    _, total_s = timed(
        lambda: model.generate(ids, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    )
    return max(total_s - prefill_s, 1e-9)


@torch.no_grad()
def measure(model, ids: torch.Tensor, name: str, ratio: float, new_tokens: int, reference):
    """One cell row: a dict of the four numbers, or None when the compressor cannot meet this ratio."""
    try:
        compressor = TABLE_COMPRESSORS[name](ratio)
        config = VeriCacheConfig(compressor=compressor, compression_ratio=ratio, draft_length=16)
        build_compressor(compressor, ratio)
    except ValueError:
        return None
    lossy = compressed_only_generate(model, ids, compressor, new_tokens, compression_ratio=ratio)
    out, seconds = timed(
        lambda: model.generate(
            ids,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            generation_mode="vericache",
            vericache_config=config,
            return_dict_in_generate=True,
        )
    )
    if not torch.equal(out.sequences, reference):
        raise RuntimeError(f"VeriCache output differs from stock generate for {name} at ratio {ratio}.")
    stats = out.vericache_stats
    decode_s = seconds - stats.prefill_seconds
    full_decode_s = stock_decode_seconds(model, ids, new_tokens)  # timed next to this run: the CPU is shared
    return {
        "bytes": stats.draft_tier_bytes / stats.full_tier_bytes,
        "divergence": first_divergence(reference, lossy, ids.shape[-1]),
        "accepted": stats.mean_accepted_per_round,
        "speed": full_decode_s / decode_s if decode_s > 0 else float("nan"),
    }


def build_table(
    context_tokens: int = 2048,
    new_tokens: int = 64,
    prompts: int = 1,
    ratios: tuple[float, ...] = (0.5, 0.75, 0.875),
    compressors: tuple[str, ...] = DEFAULT_COMPRESSORS,
    progress=print,
) -> str:
    """Measure and return the Markdown table (medians over `prompts` HumanEval problems)."""
    from .embedded import load_embedded_model  # noqa: PLC0415
    from .prompts import humaneval_problems, long_code_prompt  # noqa: PLC0415

    unknown = [name for name in compressors if name not in TABLE_COMPRESSORS]
    if unknown:
        raise ValueError(f"Unknown table compressors {unknown}; choose from {sorted(TABLE_COMPRESSORS)}.")
    model, tokenizer = load_embedded_model()
    cells: dict[tuple[str, float], list[dict]] = {}
    for problem in humaneval_problems()[:prompts]:
        text = long_code_prompt(tokenizer, problem, context_tokens)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        reference = model.generate(ids, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        for name in compressors:
            for ratio in ratios:
                row = measure(model, ids, name, ratio, new_tokens, reference)
                progress(f"{problem['task_id']} {name} {ratio}: {row}")
                if row is not None:
                    cells.setdefault((name, ratio), []).append(row)
    return render(cells, compressors, ratios, context_tokens, new_tokens, prompts)


def render(cells, compressors, ratios, context_tokens: int, new_tokens: int, prompts: int) -> str:
    lines = [
        f"SmolLM2-135M-Instruct, fp32, CPU; {prompts} HumanEval prompt(s) behind stdlib source, ~{context_tokens} "
        f"tokens; {new_tokens} new tokens, greedy; medians. Quantizers map the ratio to bits "
        "(0.5: 8-bit, 0.75: 4-bit, 0.875: 2-bit); `snapkv+kivi4` drops to the ratio then stores 4-bit.",
        "",
        "| compressor | ratio | draft tier / full cache | compressed-only diverges at token | "
        "accepted per round | VeriCache tok/s vs full |",
        "|---|---|---|---|---|---|",
    ]
    for name in compressors:
        for ratio in ratios:
            rows = cells.get((name, ratio))
            if not rows:
                lines.append(f"| {name} | {ratio} | n/a | n/a | n/a | n/a |")
                continue
            med = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
            diverge = f"{med['divergence']:g}" if med["divergence"] < new_tokens else f"none in {new_tokens}"
            lines.append(
                f"| {name} | {ratio} | {med['bytes']:.1%} | {diverge} | {med['accepted']:.1f} | {med['speed']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def run_table(args: argparse.Namespace) -> int:
    table = build_table(
        args.context_tokens, args.new_tokens, args.prompts, tuple(args.ratios), tuple(args.compressors)
    )
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(table)
    print(table)
    return 0


def add_table_command(subparsers) -> argparse.ArgumentParser:
    """Add `table` to a CLI's subparsers; the handler is `args.run`."""
    parser = subparsers.add_parser(
        "table",
        help="measure the compressor table on SmolLM2",
        description="Measure the compressor table on the embedded SmolLM2. Lists are comma-separated.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--context-tokens", type=int, default=2048, help="prompt length in tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run")
    parser.add_argument("--prompts", type=int, default=1, help="HumanEval problems (medians are reported)")
    parser.add_argument(
        "--ratios",
        type=comma_list(float),
        metavar="RATIO,...",
        default="0.5,0.75,0.875",
        help="compression ratios",
    )
    parser.add_argument(
        "--compressors",
        type=comma_list(choices=TABLE_COMPRESSORS),
        metavar="NAME,...",
        default=",".join(DEFAULT_COMPRESSORS),
        help="table rows",
    )
    parser.add_argument(
        "--output", default=None, help="also write the Markdown to this file (None: print only)"
    )
    parser.set_defaults(run=run_table)
    return parser
