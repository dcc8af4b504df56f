"""What a plain round costs: one token through VeriCache's verify phase plus its commit (what the cost-aware
schedule does when drafting does not pay), against a stock `DynamicCache` decode step. SmolLM2 shapes with random
weights, fp32, the two interleaved step by step, medians of 10 after 2 warm-ups.

    python benchmarks/plain_round.py
"""

import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from vericache_hf import VeriCache
from vericache_hf.compat import cache_kwargs
from vericache_hf.compressors import build_compressor
from vericache_hf.passes import forward


def smollm2_shaped() -> LlamaForCausalLM:
    """SmolLM2-135M's shapes with random weights (seed 0), fp32: its costs without its files."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=16384,
    )
    return LlamaForCausalLM(config).eval()


def main() -> None:
    model = smollm2_shaped()
    cfg = model.config
    for B, L in ((1, 2048), (4, 2048), (4, 8000)):
        with torch.inference_mode():
            ids = torch.randint(0, 49152, (B, L))
            stock_cache = DynamicCache(config=cfg)
            model(ids, use_cache=True, **cache_kwargs(model, stock_cache))
            cache = VeriCache(30, build_compressor("snapkv", 0.875))
            with cache.prefilling(model, torch.ones(B, L, dtype=torch.long)):
                model(ids, use_cache=True, **cache_kwargs(model, cache))
            token = torch.randint(0, 49152, (B, 1))
            pos = torch.full((B,), L)
            stock_t, plain_t = [], []
            for step in range(12):
                t = time.perf_counter()
                model(
                    token,
                    use_cache=True,
                    position_ids=pos[:, None] + step,
                    **cache_kwargs(model, stock_cache),
                )
                stock_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                cache.stream.prefetch(
                    room=1
                )  # as the loop's plain round: nothing drafts, the full tier is queued
                with cache.verifying():
                    forward(model, cache, token, pos + step)
                cache.commit(1, torch.ones(B, 1, dtype=torch.bool))
                plain_t.append(time.perf_counter() - t)
        s, p = statistics.median(stock_t[2:]), statistics.median(plain_t[2:])
        print(f"B={B} L={L}: stock step {s * 1000:.1f} ms, plain round {p * 1000:.1f} ms, ratio {p / s:.2f}")


if __name__ == "__main__":
    main()
