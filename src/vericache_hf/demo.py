"""`vericache-hf demo`: one long code prompt on the embedded model, three ways, side by side.

Full-cache greedy decoding is the reference. Compressed-only decoding (the lossy method on its own) leaves it at
some token; VeriCache, drafting with the same compressor, reproduces it exactly.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .config import VeriCacheConfig
from .stats import VeriCacheStats
from .table import timed


@dataclass
class Run:
    name: str
    tokens: torch.Tensor  # (new_tokens,)
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else float("nan")


def timed_run(name: str, fn, prompt_length: int) -> Run:
    """Time `fn()` (a generate call) and keep the first row's new tokens."""
    sequences, seconds = timed(fn)
    return Run(name, sequences[0, prompt_length:], seconds)


def add_demo_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="full cache vs compressed-only vs VeriCache on the embedded model"
    )
    parser.add_argument("--compressor", default="snapkv", help="draft-tier method (default: snapkv)")
    parser.add_argument(
        "--compression-ratio", type=float, default=0.75, help="fraction of the KV cache removed"
    )
    parser.add_argument("--context-tokens", type=int, default=2000, help="prompt length in tokens")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--problem", type=int, default=0, help="HumanEval problem index")
    parser.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from .embedded import load_embedded_model
    from .lossy import compressed_only_generate, first_divergence
    from .prompts import humaneval_problems, long_code_prompt

    config = VeriCacheConfig(compressor=args.compressor, compression_ratio=args.compression_ratio)
    stats = VeriCacheStats()
    steps = tqdm(
        total=4, desc="loading the embedded model", bar_format="{desc:<42}{bar:20}| {n}/{total} [{elapsed}]"
    )
    model, tokenizer = load_embedded_model()
    problem = humaneval_problems()[args.problem]
    text = long_code_prompt(tokenizer, problem, args.context_tokens)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    length, new = ids.shape[-1], args.max_new_tokens
    steps.update()

    steps.set_description("full-cache greedy (reference)")
    full = timed_run("full cache", lambda: model.generate(ids, max_new_tokens=new, do_sample=False), length)
    steps.update()
    steps.set_description(f"compressed-only greedy ({args.compressor})")
    lossy = timed_run(
        f"{args.compressor} only (lossy)",
        lambda: compressed_only_generate(
            model, ids, config.compressor, new, compression_ratio=config.compression_ratio
        ),
        length,
    )
    steps.update()
    steps.set_description("VeriCache greedy")
    config.stats = stats
    veri = timed_run(
        "VeriCache",
        lambda: model.generate(
            ids, max_new_tokens=new, do_sample=False, generation_mode="vericache", vericache_config=config
        ),
        length,
    )
    steps.update()
    steps.close()

    decode = lambda run: tokenizer.decode(run.tokens, skip_special_tokens=True)  # noqa: E731
    print(
        f"\nPrompt: HumanEval/{args.problem} behind real source code, {length} tokens; {new} new tokens, greedy."
    )
    print(f"Draft tier: {args.compressor} at compression_ratio={args.compression_ratio}.\n")
    print("=== full-cache output (reference) ===\n" + decode(full))
    where = first_divergence(full.tokens[None], lossy.tokens[None], 0)
    print(f"\n=== {args.compressor}-only output (lossy) ===\n" + decode(lossy))
    if where == len(full.tokens):
        print("--> identical to full-cache output on this prompt")
    else:
        shared = tokenizer.decode(full.tokens[:where], skip_special_tokens=True)
        print(f"--> leaves the full-cache output at generated token {where}, after: {shared[-60:]!r}")
    identical = torch.equal(veri.tokens, full.tokens)
    print("\n=== VeriCache output ===\n" + decode(veri))
    print(f"--> identical to full-cache output: {identical}")
    print(
        f"\nAcceptance: {stats.rounds} drafted rounds (and {stats.plain_rounds} plain full-cache steps, where "
        f"drafting did not pay), {stats.mean_accepted_per_round:.1f} accepted drafts per round, "
        f"acceptance rate {stats.acceptance_rate:.0%}; draft tier {stats.draft_tier_bytes / 2**20:.1f} MiB vs full "
        f"tier {stats.full_tier_bytes / 2**20:.1f} MiB; {stats.bytes_to_device / 2**20:.0f} MiB staged for verification."
    )
    print("\nThroughput (this machine, one run each):")
    for run in (full, lossy, veri):
        print(
            f"  {run.name:<28} {run.tokens_per_second:7.1f} tok/s  ({run.tokens_per_second / full.tokens_per_second:.2f}x full)"
        )
    return 0 if identical else 1
