"""The verify pass's attention, kernel by kernel: what a short causal block (k + 1 queries a row) over a long cache
costs, beside a one-token decode step over the same cache, so that `VeriCacheConfig.verify_attention="auto"` is
chosen from measurements (`verify_attention.AUTO`).

Two tables:
- **attention**: one layer's attention alone, each candidate kernel (`verify_attention.KERNELS`) at `--queries`
  queries a row over `--contexts` cached tokens, batch `--batches`, with every slot real (dense) and with a few slots
  masked per row (ragged: left padding and rejected drafts; lower_right and flash cannot serve those and hand them to
  sdpa); plus the same attention over the cache in staging chunks merged by log-sum-exp (`streamed`), and the
  one-token step (`step`) it is measured against;
- **pass**: whole forward passes of a random-weight model over a full KV on the device (`--pass-sizes`, at the first
  context and the largest batch): a one-token step, and a `--pass-width`-token verify pass with each kernel, through
  the pass model's attention as VeriCache runs it.

Llama-3.1-8B attention shapes (32 query heads, 8 key heads, 128 dims) in bf16 on CUDA; SmolLM2-135M's (9, 3, 64) in
float32 on a CPU (`--device cpu`, contexts 2k-8k, batch 1-4: the CPU's choice). Medians of `--repeats` timed calls
after warm-ups, each synchronized; FlexAttention's compilation falls in the warm-ups. `--dry-run`: tiny, in seconds.

    python benchmarks/gpu_verify_kernels.py --out docs/benchmarks/verify-kernels/gpu.json
    python benchmarks/gpu_verify_kernels.py --device cpu --out docs/benchmarks/verify-kernels/cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from vericache_hf.attention import _stock  # noqa: E402
from vericache_hf.verify_attention import KERNELS, VERIFY_KWARG, VerifyPass  # noqa: E402

SHAPES = {
    "cuda": (32, 8, 128, torch.bfloat16),
    "cpu": (9, 3, 64, torch.float32),
    "tiny": (4, 2, 16, torch.float32),
}


class _Layer(torch.nn.Module):
    """What attention functions read of an attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.layer_idx, self.num_key_value_groups, self.is_causal = 0, groups, True


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(call, device: str, repeats: int, warmups: int = 3) -> float:
    seconds = []
    for attempt in range(warmups + repeats):
        _sync(device)
        started = time.perf_counter()
        call()
        _sync(device)
        if attempt >= warmups:
            seconds.append(time.perf_counter() - started)
    return 1000 * statistics.median(seconds)


def block_mask(batch: int, queries: int, context: int, ragged: bool, device: str) -> torch.Tensor:
    """(B, 1, q, context + q) bool: lower-right causal, and in ragged rows some cached slots masked (row b's
    first 8b slots, as left padding, and 1 in 64 further on, as rejected drafts)."""
    keys = context + queries
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(context)[None, None]
    allowed = allowed.repeat(batch, 1, 1, 1)
    if ragged:
        for b in range(batch):
            allowed[b, :, :, : 8 * b] = False
        allowed[:, :, :, 5:context:64] = False
    return allowed


def attention_rows(args, device: str) -> list[dict]:
    heads, kv_heads, dim, dtype = SHAPES["tiny" if args.dry_run else device]
    module = _Layer(heads // kv_heads).to(device)
    stock = _stock("sdpa", module)
    rows, started = [], time.perf_counter()
    generator = torch.Generator(device).manual_seed(0)
    for context in args.contexts:
        for batch in args.batches:
            keys = torch.randn(batch, kv_heads, context + max(args.queries), dim, device=device, dtype=dtype,
                               generator=generator)  # fmt: skip
            values = torch.randn_like(keys)
            step_query = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype, generator=generator)
            step_keys, step_values = keys[:, :, : context + 1], values[:, :, : context + 1]
            step_call = partial(stock, module, step_query, step_keys, step_values, None, scaling=dim**-0.5)
            step = median_ms(step_call, device, args.repeats)
            rows.append(
                dict(table="attention", kernel="step", context=context, batch=batch, queries=1, ms=step)
            )
            for queries in args.queries:
                if time.perf_counter() - started > args.budget_s:
                    print(f"skip ctx={context} B={batch} q={queries}: over the time budget", flush=True)
                    continue
                query = torch.randn(
                    batch, heads, queries, dim, device=device, dtype=dtype, generator=generator
                )
                k, v = keys[:, :, : context + queries], values[:, :, : context + queries]
                for ragged in (False, True):
                    mask = block_mask(batch, queries, context, ragged, device)
                    for kernel in [*args.kernels, "streamed"]:
                        ms = _kernel_ms(
                            kernel, module, query, k, v, mask, stock, context, ragged, args, device
                        )
                        row = dict(table="attention", kernel=kernel, context=context, batch=batch,
                                   queries=queries, ragged=ragged, ms=ms, vs_step=round(ms / step, 2))  # fmt: skip
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    return rows


def _kernel_ms(kernel, module, query, keys, values, mask, stock, context, ragged, args, device) -> float:
    dim = query.shape[-1]
    if kernel == "streamed":
        chunk = args.chunk_tokens

        def chunks(_layer):
            for start in range(0, context, chunk):
                end = min(start + chunk, context)
                yield keys[:, :, start:end], values[:, :, start:end]

        def call():
            verify = VerifyPass(kernel="sdpa", dense=not ragged, chunks=chunks, streamed={0})
            verify.attend(module, query, keys[:, :, context:], values[:, :, context:], mask, stock,
                          scaling=dim**-0.5)  # fmt: skip

    else:
        verify = VerifyPass(kernel=kernel, dense=not ragged)

        def call():
            verify.attend(module, query, keys, values, mask, stock, scaling=dim**-0.5)

    return round(median_ms(call, device, args.repeats), 3)


def pass_rows(args, device: str) -> list[dict]:
    """Whole passes of a random-weight model over a full KV on the device: a one-token step, and a verify-width
    pass with each kernel, through the pass model's attention."""
    from gpu_offload import build_model, random_kv
    from transformers import DynamicCache

    from vericache_hf.pass_model import pass_model

    rows = []
    context, batch, width = args.contexts[0], max(args.batches), args.pass_width
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for size in args.pass_sizes:
        model = build_model(size, device, dtype)
        runner = pass_model(model)
        cache = DynamicCache(config=model.config)
        for layer in range(model.config.num_hidden_layers):
            cache.update(*random_kv(model, batch, context, device, dtype, layer), layer)

        one_pass = partial(_pass_ms, runner, cache, args, context, batch, device)
        step = one_pass(1, None)
        rows.append(
            dict(table="pass", size=size, kernel="step", context=context, batch=batch, queries=1, ms=step)
        )
        for kernel in args.kernels:
            for dense in (True, False):
                ms = one_pass(width, kernel, dense)
                row = dict(table="pass", size=size, kernel=kernel, context=context, batch=batch, queries=width,
                           ragged=not dense, ms=ms, vs_step=round(ms / step, 2))  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
        del model, runner, cache
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _pass_ms(runner, cache, args, context: int, batch: int, device: str, tokens: int, kernel: str | None,
             dense: bool = True) -> float:  # fmt: skip
    """Median milliseconds of a `tokens`-wide pass over `cache` (cropped after), with `kernel`'s VerifyPass (None:
    a plain step), every slot real (`dense`) or 1 in 64 cached slots masked."""
    from vericache_hf.compat import cache_kwargs

    ids = torch.randint(0, runner.config.vocab_size, (batch, tokens), device=device)
    positions = torch.arange(context, context + tokens, device=device).expand(batch, -1)
    mask = None
    if not dense:
        mask = torch.ones(batch, context + tokens, dtype=torch.long, device=device)
        mask[:, 5:context:64] = 0
    extra = {VERIFY_KWARG: VerifyPass(kernel=kernel, dense=dense)} if kernel else {}

    def call():
        with torch.inference_mode():
            runner(ids, position_ids=positions, attention_mask=mask, use_cache=True, logits_to_keep=tokens,
                   **cache_kwargs(runner, cache), **extra)  # fmt: skip
        cache.crop(-tokens)

    return round(median_ms(call, device, args.repeats), 2)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--contexts", help="cached tokens (cuda: 32768,65536,131072; cpu: 2048,8192)")
    parser.add_argument("--batches", help="batch sizes (cuda: 1,8; cpu: 1,4)")
    parser.add_argument("--queries", help="queries a row (9,17,33: k + 1 for k = 8, 16, 32)")
    parser.add_argument("--kernels", default=",".join(k for k in KERNELS if k != "auto"))
    parser.add_argument("--chunk-tokens", type=int, default=3072, help="staging chunk of the streamed row")
    parser.add_argument("--pass-sizes", help="model shapes for whole passes (cuda: 1b,8b; cpu: none)")
    parser.add_argument("--pass-width", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--budget-s", type=float, default=240, help="skip attention rows after this many seconds"
    )
    parser.add_argument("--out", type=Path, help="a JSON file for the rows")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, in seconds")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda" and not args.dry_run
    defaults = dict(
        contexts="32768,65536,131072" if gpu else "2048,8192",
        batches="1,8" if gpu else "1,4",
        queries="9,17,33",
        pass_sizes="1b,8b" if gpu else "",
    )
    if args.dry_run:
        defaults.update(contexts="300", batches="2", queries="5", pass_sizes="tiny")
        args.device, args.repeats, args.chunk_tokens = "cpu", 2, 128
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.contexts = [int(v) for v in args.contexts.split(",")]
    args.batches = [int(v) for v in args.batches.split(",")]
    args.queries = [int(v) for v in args.queries.split(",")]
    args.kernels = [k for k in args.kernels.split(",") if k]
    args.pass_sizes = [s for s in args.pass_sizes.split(",") if s]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA GPU found: pass --device cpu or --dry-run.")
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    rows = attention_rows(args, args.device) + pass_rows(args, args.device)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        settings["torch"] = torch.__version__
        if args.device == "cuda":
            settings["gpu"] = torch.cuda.get_device_name()
        args.out.write_text(json.dumps(dict(settings=settings, rows=rows), indent=1, default=str))
    return rows


if __name__ == "__main__":
    main()
