"""What the linear layers of one SmolLM2-135M forward cost per row count in each layout `draft_matmul="measured"`
chooses from (`vericache_hf.drafting.draft_matmul.LAYOUTS`): every weight of the model in turn, so that they stream from
memory as in a draft step. Random weights (seed 0) in float32 and bfloat16; best of 4 per cell, milliseconds.

    python benchmarks/linear_layouts.py [--rows 1,2,3,4,6,8,12,16]
"""

import argparse
import time

import torch
from plain_round import smollm2_shaped

from vericache_hf.drafting.draft_matmul import LAYOUTS, product


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    args = parser.parse_args()
    model = smollm2_shaped()
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    print("dtype    rows  " + "  ".join(f"{name:>20}" for name in LAYOUTS))
    for dtype in (torch.float32, torch.bfloat16):
        weights = [layer.weight.detach().to(dtype) for layer in layers]
        for rows in map(int, args.rows.split(",")):
            inputs = {w.shape[1]: torch.randn(1, rows, w.shape[1], dtype=dtype) for w in weights}
            cells = []
            for layout in LAYOUTS:
                best = float("inf")
                for _ in range(5):  # the first warms up
                    started = time.perf_counter()
                    for weight in weights:
                        product(layout, inputs[weight.shape[1]], weight, None)
                    best = min(best, time.perf_counter() - started)
                cells.append(f"{1000 * best:20.1f}")
            print(f"{str(dtype).removeprefix('torch.'):8} {rows:4}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
