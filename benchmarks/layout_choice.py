"""Which layouts `draft_matmul="measured"` chooses, call after call, and what a draft step then costs: each call
starts from a fresh layout table (as a new process would), so a choice that depends on timer noise shows as calls
that disagree. SmolLM2-135M's shapes with random weights (seed 0), fp32, batch 4, a `--context`-token prompt with
SnapKV keeping 1,024 tokens (the draft tier at 8k tokens and ratio 0.875), 8 drafts a round (fixed), 28 new tokens.
Then, with `--forced`, the same calls with the attention projections forced to `linear` and to `weight_first` in
turn, which prices a wrong choice there.

    python benchmarks/layout_choice.py [--context 8192] [--calls 3] [--forced 0]
"""

import argparse
import time

import torch
from draft_step import drafted
from plain_round import smollm2_shaped

from vericache_hf.drafting import draft_model as dm
from vericache_hf.drafting.draft_matmul import LAYOUTS, MeasuredLinear

KEPT = 1024


def measured(model) -> list[MeasuredLinear]:
    """The linears of `model`'s drafting copy, which share one `LayoutTable`."""
    return [module for module in dm.draft_model(model, None).modules() if isinstance(module, MeasuredLinear)]


def call(model, ids: torch.Tensor) -> float:
    """One VeriCache call; its mean draft step in milliseconds."""
    _, stats = drafted(model, ids, 28, 1 - KEPT / ids.shape[-1])
    return 1000 * stats.draft_seconds / stats.draft_forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument(
        "--forced", type=int, default=0, help="pairs of calls with the attention layouts forced"
    )
    args = parser.parse_args()
    model = smollm2_shaped()
    ids = torch.randint(0, 49152, (4, args.context), generator=torch.Generator().manual_seed(0))
    for index in range(args.calls):
        dm._COPIES.pop(model, None)  # a fresh drafting copy, so a fresh table
        started = time.perf_counter()
        step = call(model, ids)
        chosen = {
            f"{group[0]}x{group[1]}": layout
            for (group, rows), layout in sorted(measured(model)[0].layouts.chosen.items())
        }
        print(
            f"call {index}: draft step {step:.1f} ms, {time.perf_counter() - started:.0f} s; {chosen}",
            flush=True,
        )
    layers = measured(model)
    table, groups = layers[0].layouts, {layer.group for layer in layers}
    for index in range(args.forced):
        for attention in LAYOUTS:
            table.chosen.clear()
            for group in groups:  # q, k, v and o projections: 576 or 192 rows by 576
                in_attention = group[1] == 576 and group[0] in (192, 576)
                table.chosen[(group, 4)] = attention if in_attention else "weight_first"
            print(
                f"forced {index}: attention projections in {attention}: draft step {call(model, ids):.1f} ms"
            )


if __name__ == "__main__":
    main()
