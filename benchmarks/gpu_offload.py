"""Full KV off the device, on one CUDA GPU with no network: decode throughput and device memory of

  full-kv     greedy decoding with the whole KV cache in device memory (where it fits);
  offloaded   greedy decoding with transformers' `DynamicCache(offloading=True)` (CUDA only);
  vericache   draft on a StreamingLLM draft tier on the device, verify against the full tier in pinned host memory,
              staged layer by layer into device buffers by the transfer engine while the draft runs,

on random-weight Llama configs of about 1B and 8B parameters, contexts of 32k and 128k tokens, batch 1 and 8 (the
combinations whose KV cache fits the GPU's, or the host's, memory). Run: `python benchmarks/gpu_offload.py`
(about 6 minutes on one H200); `--dry-run` runs a tiny config on the CPU in seconds.

How it stays short and fair: the prompt's KV cache is synthesized (random K/V written straight into each cache)
instead of a prefill, which every method would pay alike; only decoding is timed. Acceptance on random weights is
meaningless, so it is given:
- forced (default): each VeriCache round drafts `--accepted-per-round` tokens (k), feeding the draft the given
  continuation tokens (teacher forcing, so the draft "matches"), verifies [pending + k drafts] in one pass over the
  full tier, and commits all k plus the bonus token;
- replayed (`--replay TRACE`): each round drafts and accepts, row by row, what a real model's round did
  (`benchmarks/acceptance_trace.py` records them from the embedded model on a CPU); rows accept different counts,
  so commits are ragged and the full tier holds masked slots, as in real decoding. Rows are labelled `replay`.
Token values do not change the cost of any pass.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from vericache_hf import VeriCache, VeriCacheConfig
from vericache_hf.compat import cache_kwargs
from vericache_hf.compressors import build_compressor
from vericache_hf.pass_model import pass_model
from vericache_hf.passes import forward

SIZES = {  # Llama-3.2-1B- and Llama-3.1-8B-shaped; "small" and "tiny" are for CPU runs
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "small": dict(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, vocab_size=4096
    ),
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}


def build_model(size: str, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    shape = dict(vocab_size=128256, num_key_value_heads=8) | SIZES[size]
    config = LlamaConfig(max_position_embeddings=262144, **shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def kv_bytes(model, batch: int, tokens: int, dtype: torch.dtype) -> int:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize
    return batch * tokens * per_token


def random_kv(model, batch: int, tokens: int, device: str, dtype: torch.dtype, layer: int):
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    generator = torch.Generator(device).manual_seed(layer)
    shape = (batch, config.num_key_value_heads, tokens, head_dim)
    return (torch.randn(shape, generator=generator, device=device, dtype=dtype) for _ in range(2))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_bytes_now(device: str) -> int:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else 0


def step(model, cache, tokens, positions):
    """One full-KV forward of (B, q) tokens at absolute start `positions`; returns the greedy choice of the last."""
    query = tokens.shape[-1]
    position_ids = positions[:, None] + torch.arange(query, device=tokens.device)
    out = model(
        input_ids=tokens,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **cache_kwargs(model, cache),
    )
    return out.logits[:, -1].argmax(dim=-1)


@torch.inference_mode()  # as in `generate`: no autograd graph holding every layer's activations
def run_full_kv(model, args, batch, context, device, dtype, offloading: bool) -> dict:
    """Plain greedy decoding over a DynamicCache (optionally transformers' offloaded one)."""
    base = device_bytes_now(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    cache = DynamicCache(config=model.config, offloading=offloading)
    for layer in range(model.config.num_hidden_layers):
        cache.update(*random_kv(model, batch, context, device, dtype, layer), layer)
    token = torch.randint(0, model.config.vocab_size, (batch,), device=device)
    positions = torch.full((batch,), context, device=device)
    step(model, cache, token[:, None], positions)  # warm-up
    sync(device)
    started = time.perf_counter()
    for offset in range(1, args.baseline_tokens + 1):
        token = step(model, cache, token[:, None], positions + offset)
    sync(device)
    seconds = time.perf_counter() - started
    peak = (
        torch.cuda.max_memory_allocated() - base
        if device.startswith("cuda")
        else kv_bytes(model, batch, context + args.baseline_tokens + 1, dtype)
    )
    return dict(tokens_per_s=batch * args.baseline_tokens / seconds, device_bytes=peak)


def round_plan(args, batch: int) -> list[tuple[int, list[int]]]:
    """(drafted, accepted per row) for every round, the warm-up first: forced (all k accepted), or the trace's
    rounds in order (its rows repeated to fill the batch; a row the trace had stopped accepts nothing)."""
    k = args.accepted_per_round
    if not args.replay:
        return [(k, [k] * batch)] * (args.rounds + 1)
    trace = json.loads(Path(args.replay).read_text())
    plan = []
    for call in trace["calls"]:
        for turn in call["rounds"]:
            rows = [turn["accepted"][b % call["rows"]] if b % call["rows"] in turn["active"] else -1 for b in
                    range(batch)]  # fmt: skip
            plan.append((turn["drafted"], rows))
    return plan[: args.rounds + 1] if args.rounds else plan


@torch.inference_mode()
def run_vericache(model, args, batch, context, device, dtype) -> dict:
    """VeriCache rounds with given acceptance (`round_plan`): draft k on the draft tier, verify k+1 on the staged
    full tier, commit what each row accepted plus its bonus token."""
    base = device_bytes_now(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    compressor = build_compressor("streaming_llm", args.compression_ratio)
    layers = model.config.num_hidden_layers
    cache = VeriCache(
        layers,
        compressor,
        chunk_tokens=args.chunk_tokens,
        staging_buffers=args.staging_buffers,
        staging_chunk_tokens=args.staging_chunk_tokens or None,
        verify_attention=args.verify_attention,
        stage_on_cpu=True,  # a CPU dry run takes the accelerator's transfer path too
    )
    runner = pass_model(model)  # VeriCache's passes run its attention (the verify kernel, streamed chunks)
    prompt_valid = torch.ones(batch, context, dtype=torch.long, device=device)
    with cache.prefilling(
        model, prompt_valid
    ):  # the synthesized prompt: full tier and draft tier, as a prefill
        for layer in range(layers):
            cache.update(*random_kv(model, batch, context, device, dtype, layer), layer)
    plan = round_plan(args, batch)
    positions = torch.full((batch,), context, device=device)

    def one_round(k: int, accepted: list[int]) -> int:
        nonlocal positions
        block = torch.randint(0, model.config.vocab_size, (batch, k + 1), device=device)  # pending + k drafts
        if k:
            with cache.drafting(k):  # queues the full tier's transfers, which run during the draft
                for i in range(k):  # teacher-forced draft: the draft is fed the block
                    forward(runner, cache, block[:, i : i + 1], positions + i)
        with cache.verifying():
            forward(runner, cache, block, positions)
        counts = torch.tensor([a + 1 for a in accepted])  # a stopped row (-1) commits nothing
        width = int(counts.max())
        cache.commit(width, torch.arange(width)[None, :] < counts[:, None])
        positions = positions + counts.to(device)
        return int(counts.sum())

    one_round(*plan[0])  # warm-up
    sync(device)
    stats = cache.stats
    before = (stats.transfer_seconds, stats.transfer_wait_seconds, stats.bytes_to_device, stats.bytes_to_host)
    started = time.perf_counter()
    emitted = sum(one_round(k, accepted) for k, accepted in plan[1:])
    sync(device)
    seconds = time.perf_counter() - started
    transfer = stats.transfer_seconds - before[0]
    waited = stats.transfer_wait_seconds - before[1]
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() - base
    else:  # accounting: draft tier + staging buffers
        peak = stats.peak_draft_tier_bytes + stats.peak_staging_bytes
    cache.close()
    return dict(
        acceptance="replay" if args.replay else "forced",
        rounds=len(plan) - 1,
        tokens_per_round=round(emitted / batch / max(1, len(plan) - 1), 2),
        tokens_per_s=emitted / seconds,
        device_bytes=peak,
        draft_tier_bytes=stats.peak_draft_tier_bytes,
        staging_bytes=stats.peak_staging_bytes,
        transfer_s=round(transfer, 4),
        waited_s=round(waited, 4),
        hidden_share=round(max(0.0, 1 - waited / transfer), 3) if transfer else 0.0,
        gib_to_device=round((stats.bytes_to_device - before[2]) / 2**30, 3),
        bytes_to_host=stats.bytes_to_host - before[3],
    )


def fits(args, model, batch, context, dtype, device) -> tuple[bool, bool, bool]:
    """(full KV fits on the device, the offloaded baseline fits in host memory, the full tier fits in host memory),
    with headroom for activations. The offloaded baseline gets a wider margin: on an H200 VM with 125 GiB of RAM, a
    run with it at 32 GiB of KV pinned 128 GB of host memory and was killed by the OOM killer, while full-KV decoding
    and VeriCache alone ran at that size."""
    need = kv_bytes(model, batch, context + 512, dtype)
    if not device.startswith("cuda"):
        return True, True, True
    gc.collect()
    torch.cuda.empty_cache()  # what earlier runs left in the caching allocator is free for this one
    free, _ = torch.cuda.mem_get_info()
    host = _host_bytes()
    return need < 0.8 * free, 4 * need < 0.8 * host, need < 0.6 * host


def release_pinned_host_memory() -> None:
    """torch caches freed pinned host blocks for reuse, by size; a later method's differently sized chunks would pin
    new memory beside them, and at 32 GiB of KV the VM's driver runs out of page tables. Hand them back between runs."""
    gc.collect()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def _host_bytes() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", help="model sizes (default 1b,8b; tiny with --dry-run)")
    parser.add_argument("--contexts", help="context lengths (default 32768,131072; 256 with --dry-run)")
    parser.add_argument("--batches", help="batch sizes (default 1,8; 1,2 with --dry-run)")
    parser.add_argument(
        "--accepted-per-round", type=int, help="forced accepted drafts per round (default 16)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="timed VeriCache rounds per configuration (default 2; with --replay, 0: all)",
    )
    parser.add_argument("--baseline-tokens", type=int, help="timed tokens per baseline run (default 16)")
    parser.add_argument("--compression-ratio", type=float, default=0.875)
    parser.add_argument(
        "--staging-buffers", type=int, default=2, help="layers of the full tier on the device at once"
    )
    parser.add_argument("--chunk-tokens", type=int, default=4096, help="tokens the host full tier grows by")
    parser.add_argument(
        "--staging-chunk-tokens",
        type=int,
        default=VeriCacheConfig.staging_chunk_tokens,
        help="tokens of one staging buffer (0: whole layers)",
    )
    parser.add_argument("--verify-attention", default="auto", help="VeriCacheConfig.verify_attention")
    parser.add_argument(
        "--replay", help="an acceptance trace (benchmarks/acceptance_trace.py) to replay instead of forcing"
    )
    parser.add_argument(
        "--budget-s", type=float, default=420, help="skip what is left after this many seconds"
    )
    parser.add_argument(
        "--no-offloaded",
        action="store_true",
        help="skip transformers' offloaded cache (the slowest baseline)",
    )
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--dry-run", action="store_true", help="tiny config on the CPU, in seconds")
    args = parser.parse_args(argv)
    defaults = dict(
        sizes="1b,8b",
        contexts="32768,131072",
        batches="1,8",
        accepted_per_round=16,
        rounds=2,
        baseline_tokens=16,
    )
    if args.dry_run:
        defaults.update(
            sizes="tiny", contexts="256", batches="1,2", accepted_per_round=3, rounds=1, baseline_tokens=2
        )
    if args.replay:
        defaults["rounds"] = 0  # the whole trace
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.accepted_per_round < 1 or args.rounds < (0 if args.replay else 1) or args.baseline_tokens < 1:
        parser.error("--accepted-per-round, --rounds and --baseline-tokens must be positive.")
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.dry_run:
        raise SystemExit(
            "No CUDA GPU found: this benchmark needs one (or pass --dry-run for the CPU smoke test)."
        )
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows, started = [], time.perf_counter()
    for size in args.sizes.split(","):
        model = build_model(size, device, dtype)
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                if time.perf_counter() - started > args.budget_s:
                    print(f"skip {size} ctx={context} B={batch}: over the time budget")
                    continue
                on_device, offload_fits, on_host = fits(args, model, batch, context, dtype, device)
                row = dict(
                    size=size,
                    context=context,
                    batch=batch,
                    kv_gib=round(kv_bytes(model, batch, context, dtype) / 2**30, 2),
                )
                if on_device:
                    row["full_kv"] = run_full_kv(model, args, batch, context, device, dtype, offloading=False)
                if offload_fits and device.startswith("cuda") and not args.no_offloaded:
                    row["offloaded"] = run_full_kv(
                        model, args, batch, context, device, dtype, offloading=True
                    )
                    release_pinned_host_memory()
                if on_host:
                    row["vericache"] = run_vericache(model, args, batch, context, device, dtype)
                    release_pinned_host_memory()
                for name in ("full_kv", "offloaded"):
                    if name in row and "vericache" in row:
                        row[f"speedup_vs_{name}"] = round(
                            row["vericache"]["tokens_per_s"] / row[name]["tokens_per_s"], 2
                        )
                        row[f"memory_vs_{name}"] = round(
                            row["vericache"]["device_bytes"] / max(1, row[name]["device_bytes"]), 3
                        )
                print(json.dumps(row), flush=True)
                rows.append(row)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return rows


if __name__ == "__main__":
    main()
