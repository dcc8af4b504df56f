"""What one draft step costs inside the loop, per draft-tier setting: the model's own weights or `draft_dtype=
"bfloat16"`, each with `draft_matmul="stock"` and `"measured"`. SmolLM2-135M's shapes with random weights (seed 0),
fp32, a 2048-token prompt at batch 4 (`--batch`), SnapKV at 0.5 (a 1024-token draft tier, as at 8k tokens and
0.875), 8 drafts a round (fixed), 40 new tokens. The settings take turns for `--repeats` rounds (the first also
measures the layouts); drafts are verified as always, so every call decodes the same tokens.

    python benchmarks/draft_step.py [--batch 4] [--repeats 2]
"""

import argparse
import time

import torch
from plain_round import smollm2_shaped

from vericache_hf import VeriCacheConfig, VeriCacheStats

SETTINGS = [(None, "stock"), (None, "measured"), ("bfloat16", "stock"), ("bfloat16", "measured")]


def drafted(
    model, ids: torch.Tensor, new_tokens: int, ratio: float, **settings
) -> tuple[torch.Tensor, VeriCacheStats]:
    """One greedy VeriCache call of exactly `new_tokens`, SnapKV at `ratio`, 8 drafts a round (fixed), with
    `settings` for its `VeriCacheConfig`: its output and its stats."""
    stats = VeriCacheStats()
    config = VeriCacheConfig(
        compressor="snapkv",
        compression_ratio=ratio,
        draft_schedule="fixed",
        draft_length=8,
        stats=stats,
        **settings,
    )
    return exactly(model, ids, new_tokens, generation_mode="vericache", vericache_config=config), stats


def exactly(model, ids: torch.Tensor, new_tokens: int, **kwargs) -> torch.Tensor:
    """A greedy call of exactly `new_tokens`, with `kwargs` for `generate`: its output."""
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        **kwargs,
    )


def costs(stats: VeriCacheStats) -> str:
    """A call's mean draft step and verify pass."""
    return (
        f"draft step {1000 * stats.draft_seconds / stats.draft_forwards:.1f} ms ({stats.draft_forwards} steps), "
        f"verify pass {1000 * stats.verify_seconds / stats.rounds:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = smollm2_shaped()
    ids = torch.randint(0, 49152, (args.batch, 2048), generator=torch.Generator().manual_seed(0))
    outputs = []
    for repeat in range(args.repeats):
        for dtype, matmul in SETTINGS:
            started = time.perf_counter()
            output, stats = drafted(model, ids, 40, 0.5, draft_dtype=dtype, draft_matmul=matmul)
            outputs.append(output)
            print(
                f"repeat {repeat} draft_dtype={dtype} draft_matmul={matmul}: {costs(stats)}, "
                f"call {time.perf_counter() - started:.1f} s",
                flush=True,
            )
    print("same tokens:", all(torch.equal(outputs[0], out) for out in outputs))


if __name__ == "__main__":
    main()
