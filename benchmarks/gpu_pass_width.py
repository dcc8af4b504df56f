"""What one pass costs on a GPU, by width and by weight type: the premises of composed drafting there.

- a full-KV step (one token over the whole context on the device) and a verify-width pass (k + 1 tokens);
- draft-tier passes (over an eighth of the context, a draft tier at ratio 0.875) of 1 to 11 tokens a row: composed
  drafting pays when a wider pass keeps more tokens than it costs (on the 2-core CPU a 2-token pass costs 1.6-2.2
  one-token passes at batch 1, `draft_pass_width.py`);
- the one-token draft pass of a float32 model on its own weights and on the bfloat16 copy `draft_dtype` makes.

Random-weight Llama shapes, the K/V synthesized (no prefill), medians of 10 timed passes after 3 warm-ups, each
synchronized. `python benchmarks/gpu_pass_width.py` (about a minute on one H200); `--dry-run`: tiny, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).parent))

from gpu_offload import build_model, random_kv  # noqa: E402

from vericache_hf.compat import cache_kwargs  # noqa: E402
from vericache_hf.drafting.draft_model import draft_model  # noqa: E402

WIDTHS = (1, 2, 4, 8, 11)


def cache_of(model, batch: int, tokens: int, device: str, dtype: torch.dtype) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for layer in range(model.config.num_hidden_layers):
        keys, values = random_kv(model, batch, tokens, device, dtype, layer)
        cache.update(keys, values, layer)
    return cache


def pass_ms(model, cache: DynamicCache, batch: int, width: int, device: str) -> float:
    """Median milliseconds of one `width`-token pass per row over `cache` (the pass's tokens cropped after)."""
    start = cache.get_seq_length()
    positions = torch.arange(start, start + width, device=device).expand(batch, -1)
    tokens = torch.randint(0, model.config.vocab_size, (batch, width), device=device)
    seconds = []
    with torch.inference_mode():
        for attempt in range(13):
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            model(
                tokens,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=width,
                **cache_kwargs(model, cache),
            )
            if device == "cuda":
                torch.cuda.synchronize()
            if attempt >= 3:
                seconds.append(time.perf_counter() - started)
            cache.crop(-width)
    return 1000 * statistics.median(seconds)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="1b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--verify-width", type=int, default=9)
    parser.add_argument(
        "--sweeps", type=int, default=2, help="sweeps over the draft widths, every other reversed"
    )
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the rows")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.size, args.context, args.batch, device = "tiny", 256, 2, "cpu"
    else:
        device = "cuda"
    rows = []

    def row(model_dtype: str, what: str, tokens: int, width: int, ms: float) -> None:
        rows.append(dict(model=model_dtype, pass_=what, cached_tokens=tokens, width=width, ms=round(ms, 2)))
        print(
            f"{model_dtype:>9} {what:<22} cached {tokens:>6} x{args.batch} width {width:>2}: {ms:8.2f} ms",
            flush=True,
        )

    draft_tokens = args.context // 8
    model = build_model(args.size, device, torch.bfloat16)
    full = cache_of(model, args.batch, args.context, device, torch.bfloat16)
    for width in (1, args.verify_width):
        row("bfloat16", "full KV", args.context, width, pass_ms(model, full, args.batch, width, device))
    del full
    draft = cache_of(model, args.batch, draft_tokens, device, torch.bfloat16)
    # a second sweep, in reverse, tells a width's cost from the clock's warm-up
    for sweep in range(args.sweeps):
        for width in WIDTHS if sweep % 2 == 0 else WIDTHS[::-1]:
            row(
                "bfloat16",
                "draft tier",
                draft_tokens,
                width,
                pass_ms(model, draft, args.batch, width, device),
            )
    del model, draft
    if device == "cuda":
        torch.cuda.empty_cache()
    model = build_model(args.size, device, torch.float32)
    narrow = draft_model(model, torch.bfloat16)
    for dtype, drafter in ((torch.float32, model), (torch.bfloat16, narrow)):
        draft = cache_of(model, args.batch, draft_tokens, device, dtype)
        what = "draft tier, own" if dtype == torch.float32 else "draft tier, bf16 copy"
        row("float32", what, draft_tokens, 1, pass_ms(drafter, draft, args.batch, 1, device))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(size=args.size, batch=args.batch, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
