"""What an idle OpenMP team elsewhere costs the thread that decodes (`vericache_hf.release_workers`): the same
greedy calls on the main thread, which loaded the model; on a new thread while the main thread keeps its team; and
on a new thread after the main thread gave its team back. VeriCache (SnapKV at 0.5, 8 drafts a round, fixed) and
full cache, SmolLM2-135M's shapes with random weights, fp32, a 2048-token prompt at batch 4, 40 new tokens.

    python benchmarks/thread_teams.py [--repeats 2]
"""

import argparse
import threading

import torch
from draft_step import costs, drafted, exactly
from plain_round import smollm2_shaped
from serving import Times

from vericache_hf import release_workers

NEW_TOKENS = 40


def full_cache(model, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A stock greedy call of exactly NEW_TOKENS: its output and its decode seconds (first token to last)."""
    clock = Times()
    output = exactly(model, ids, NEW_TOKENS, streamer=clock)
    return output, clock.times[-1] - clock.times[0]


def on_thread(where: str, call):
    """`call()` on the main thread, or on a new one (after the main thread's release, for "released")."""
    if where == "main":
        return call()
    if where == "released":
        release_workers()
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", call()))
    thread.start()
    thread.join()
    return out["value"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = smollm2_shaped()
    ids = torch.randint(0, 49152, (4, 2048), generator=torch.Generator().manual_seed(0))
    outputs = []
    for repeat in range(args.repeats):
        for where in ("main", "thread", "released"):
            output, stats = on_thread(where, lambda: drafted(model, ids, NEW_TOKENS, 0.5))
            reference, seconds = on_thread(where, lambda: full_cache(model, ids))
            outputs += [output, reference]
            step = 1000 * seconds / (NEW_TOKENS - 1)
            print(
                f"repeat {repeat} {where}: VeriCache {costs(stats)}; full-cache step {step:.0f} ms",
                flush=True,
            )
    print("same tokens:", all(torch.equal(outputs[0], out) for out in outputs))


if __name__ == "__main__":
    main()
