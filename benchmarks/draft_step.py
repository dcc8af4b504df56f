"""What one draft step costs inside the loop, with the model's own weights and with `draft_dtype="bfloat16"`:
SmolLM2-135M's shapes with random weights (seed 0), fp32, a 2048-token prompt at batch 4, SnapKV at 0.5 (a
1024-token draft tier, as at 8k tokens and 0.875), 8 drafts a round (fixed), 40 new tokens. One call each, not
interleaved; drafts are verified as always, so both calls decode the same tokens.

    python benchmarks/draft_step.py
"""

import os
import time

import torch

os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
from plain_round import smollm2_shaped

from vericache_hf import VeriCacheConfig, VeriCacheStats


def main() -> None:
    model = smollm2_shaped()
    ids = torch.randint(0, 49152, (4, 2048), generator=torch.Generator().manual_seed(0))
    outputs = []
    for dtype in (None, "bfloat16"):
        stats = VeriCacheStats()
        config = VeriCacheConfig(
            compressor="snapkv",
            compression_ratio=0.5,
            draft_schedule="fixed",
            draft_length=8,
            draft_dtype=dtype,
            stats=stats,
        )
        started = time.perf_counter()
        outputs.append(
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=40,
                min_new_tokens=40,
                do_sample=False,
                generation_mode="vericache",
                vericache_config=config,
            )
        )
        print(
            f"draft_dtype={dtype}: draft step {1000 * stats.draft_seconds / stats.draft_forwards:.0f} ms "
            f"({stats.draft_forwards} steps), verify pass {1000 * stats.verify_seconds / stats.rounds:.0f} ms, "
            f"call {time.perf_counter() - started:.1f} s",
            flush=True,
        )
    print("same tokens:", torch.equal(*outputs))


if __name__ == "__main__":
    main()
