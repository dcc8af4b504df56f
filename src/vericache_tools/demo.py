"""`vericache-hf demo`: one long code prompt on the embedded model, three ways, side by side.

Full-cache greedy decoding is the reference. Compressed-only decoding (the lossy method on its own) leaves it at
some token; VeriCache, drafting with the same compressor, reproduces it exactly.

The three runs cannot share one prefilled state: each method builds its own cache during its prefill (stock
`generate` a `DynamicCache` of exact K/V; compressed-only a draft tier that compresses each layer's K/V as the
prefill writes it; VeriCache a draft tier and a full tier on the host, both filled by its prefill), so each run
prefills for itself and the demo reports prefill and decode apart.

Timing is the same for all three: a streamer (`TokenClock`) notes when the first new token arrives. That token
comes out of the prefill forward, so prefill is the time to the first token, and decode is the rest, over the
remaining tokens. Every run is repeated (`--repeats`, interleaved) and medians are reported.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from vericache_hf import VeriCacheConfig, VeriCacheStats

from .arguments import HelpFormatter

IDENTICAL = "identical means token for token equal to this model's own full-cache `generate` output, whatever its quality"
SHARED_PREFILL = (
    "Each method builds its own cache during its prefill (exact K/V, a compressed draft tier, or both tiers), so "
    "they cannot start from one prefilled state: each run prefills for itself, and prefill is reported apart."
)


class TokenClock:
    """A transformers streamer that notes when the first new token arrives and advances a progress bar per token.

    `generate` streams the prompt first, then each new token; `compressed_only_generate` does the same."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar
        self.prompt_seen = False
        self.started = self.first_token = self.ended = time.perf_counter()
        self.new_tokens = 0

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.new_tokens == 0:
            self.first_token = time.perf_counter()
        self.new_tokens += value.numel()
        self.bar.update(value.numel())

    def end(self) -> None:
        self.ended = time.perf_counter()


@dataclass
class Run:
    """One generate call: its new tokens, time to the first token (prefill) and the rest (decode)."""

    tokens: torch.Tensor  # (new_tokens,)
    prefill_seconds: float
    decode_seconds: float
    stats: VeriCacheStats | None = None

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first (which the prefill produced) over the decode time."""
        decoded = len(self.tokens) - 1
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else float("nan")


def timed_run(fn, prompt_length: int, desc: str, new_tokens: int, progress: bool) -> Run:
    """Run `fn(streamer)` (a generate call) with a `TokenClock`; keep the first row's new tokens."""
    with tqdm(total=new_tokens, desc=desc, unit="tok", leave=False, disable=not progress) as bar:
        clock = TokenClock(bar)
        clock.started = time.perf_counter()
        sequences = fn(clock)
    return Run(
        sequences[0, prompt_length:], clock.first_token - clock.started, clock.ended - clock.first_token
    )


def add_demo_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="full cache vs compressed-only vs VeriCache on the embedded model",
        description="Full cache vs compressed-only vs VeriCache on one long code prompt, on the embedded "
        "SmolLM2-135M. About 2 minutes on 2 CPU cores with the defaults.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--compressor", default="snapkv", help="draft-tier method")
    parser.add_argument(
        "--compression-ratio", type=float, default=0.75, help="fraction of the KV cache removed"
    )
    parser.add_argument("--context-tokens", type=int, default=2000, help="prompt length in tokens")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per run")
    parser.add_argument("--problem", type=int, default=0, help="HumanEval problem index")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each method, interleaved (medians are reported)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no token-level progress bars")
    parser.set_defaults(run=run_demo)


def measure(model, ids: torch.Tensor, args: argparse.Namespace) -> dict[str, list[Run]]:
    """Each method `args.repeats` times, interleaved so that a slow spell of a shared CPU hits all three."""
    from .lossy import compressed_only_generate

    length, new, progress = ids.shape[-1], args.max_new_tokens, not args.no_progress

    def full(clock):
        return model.generate(ids, max_new_tokens=new, do_sample=False, streamer=clock)

    def lossy(clock):
        return compressed_only_generate(
            model, ids, args.compressor, new, compression_ratio=args.compression_ratio, streamer=clock
        )

    def vericache(clock, stats):
        config = VeriCacheConfig(
            compressor=args.compressor, compression_ratio=args.compression_ratio, stats=stats
        )
        return model.generate(
            ids, max_new_tokens=new, do_sample=False, streamer=clock, generation_mode="vericache",
            vericache_config=config,
        )  # fmt: skip

    runs: dict[str, list[Run]] = {"full cache": [], f"{args.compressor} only (lossy)": [], "VeriCache": []}
    for repeat in range(1, args.repeats + 1):
        for name in runs:
            desc = f"[{repeat}/{args.repeats}] {name}"
            if name == "VeriCache":
                stats = VeriCacheStats()
                run = timed_run(functools.partial(vericache, stats=stats), length, desc, new, progress)
                run.stats = stats
            else:
                run = timed_run(full if name == "full cache" else lossy, length, desc, new, progress)
            runs[name].append(run)
    return runs


def run_demo(args: argparse.Namespace) -> int:
    from .embedded import load_embedded_model
    from .prompts import humaneval_problems, long_code_prompt

    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}.")

    print("Loading the embedded SmolLM2-135M-Instruct ...", flush=True)
    model, tokenizer = load_embedded_model()
    text = long_code_prompt(tokenizer, humaneval_problems()[args.problem], args.context_tokens)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    runs = measure(model, ids, args)
    print(
        f"\nPrompt: HumanEval/{args.problem} behind real source code, {ids.shape[-1]} tokens; up to "
        f"{args.max_new_tokens} new tokens, greedy. Draft tier: {args.compressor} at "
        f"compression_ratio={args.compression_ratio}.\n"
    )
    identical = print_outputs(tokenizer, runs, args)
    print_acceptance(runs["VeriCache"][0].stats)
    print_speed(runs, args.repeats)
    return 0 if identical else 1


def print_outputs(tokenizer, runs: dict[str, list[Run]], args: argparse.Namespace) -> bool:
    """The three outputs (first run of each), where compressed-only leaves the reference, and whether every
    VeriCache run matched it."""
    from .lossy import first_divergence

    full, lossy, veri = (group[0] for group in runs.values())
    text = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
    print("=== full-cache output (reference) ===\n" + text(full.tokens))
    where = first_divergence(full.tokens[None], lossy.tokens[None], 0)
    ends = (lossy.tokens == tokenizer.eos_token_id).nonzero()
    shown = lossy.tokens[: int(ends[0, 0])] if len(ends) else lossy.tokens  # it decodes on past its end token
    print(f"\n=== {args.compressor}-only output (lossy) ===\n" + text(shown))
    if where == len(full.tokens):
        print("--> identical to full-cache output on this prompt")
    else:
        shared = text(full.tokens[:where])
        print(f"--> leaves the full-cache output at generated token {where}, after: {shared[-60:]!r}")
    identical = all(torch.equal(run.tokens, full.tokens) for run in runs["VeriCache"])
    print("\n=== VeriCache output ===\n" + text(veri.tokens))
    print(f"--> identical to full-cache output: {identical} (in each of {args.repeats} runs)")
    print(f"    ({IDENTICAL}.)")
    return identical


def print_acceptance(stats: VeriCacheStats) -> None:
    staged = (
        f"{stats.bytes_to_device / 2**20:.0f} MiB staged for verification"
        if stats.bytes_to_device
        else "the full tier is read in place for verification (nothing staged)"
    )
    print(
        f"\nAcceptance: {stats.rounds} drafted rounds (and {stats.plain_rounds} plain full-cache steps, where "
        f"drafting did not pay), {stats.mean_accepted_per_round:.1f} accepted drafts per round, "
        f"acceptance rate {stats.acceptance_rate:.0%}; draft tier {stats.draft_tier_bytes / 2**20:.1f} MiB vs full "
        f"tier {stats.full_tier_bytes / 2**20:.1f} MiB; {staged}."
    )


def print_speed(runs: dict[str, list[Run]], repeats: int) -> None:
    """Median prefill seconds and decode tokens/s of each method, and where VeriCache's decode time went."""
    median_speed = {
        name: statistics.median(r.decode_tokens_per_second for r in group) for name, group in runs.items()
    }
    reference = median_speed["full cache"]
    print(f"\nSpeed on this machine, medians of {repeats} interleaved run(s). {SHARED_PREFILL}")
    print(f"  {'':<28} {'prefill':>9}  {'decode':>12}")
    for name, group in runs.items():
        prefill = statistics.median(r.prefill_seconds for r in group)
        print(
            f"  {name:<28} {prefill:8.2f}s  {median_speed[name]:7.1f} tok/s  ({median_speed[name] / reference:.2f}x full)"
        )
    stats = runs["VeriCache"][0].stats
    busy = stats.draft_seconds + stats.verify_seconds
    if busy:
        print(
            f"  VeriCache's decode time: {stats.draft_seconds / busy:.0%} drafting on the compressed cache, "
            f"{stats.verify_seconds / busy:.0%} verifying against the full cache (first run)."
        )
