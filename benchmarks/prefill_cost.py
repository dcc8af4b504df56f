"""What VeriCache adds to time to first token: its prefill (the prompt's pass into the full tier, with the
compressor building the draft tier as each layer's K/V arrive) against a stock prefill into a `DynamicCache`, both
keeping the last position's logits only, as `generate` does. SmolLM2 shapes with random weights, fp32; each repeat
runs the stock prefill and every compressor's once, in an order rotated by one each repeat, so a slow spell of
this machine falls on all of them alike; medians after one warm-up round. Whole bench calls minutes apart swing by
15% here, too much to show a few percent; side by side, one pass at a time, shows it.

On the CPU every compressor builds its draft tier when drafting first needs it (`compress_seconds` in decode time,
priced before it is paid, and never where every round is plain; a query-aware one holds the layer inputs it reads
until then), so its prefill should cost what a stock one does. `--at-prefill` builds it in the prefill instead, as
on an accelerator (`stage_on_cpu`), which shows what the build itself costs.

    python benchmarks/prefill_cost.py [--repeats 4] [--shapes 1x2048,4x2048] [--compressors snapkv@0.875,...]
        [--at-prefill]
"""

import argparse
import statistics
import time

import torch
from plain_round import smollm2_shaped  # noqa: E402
from transformers import DynamicCache

from vericache_hf import VeriCache
from vericache_hf.compat import cache_kwargs
from vericache_hf.compressors import build_compressor

DEFAULT = "snapkv@0.875,streaming_llm@0.875,kivi@0.875,quanto@0.875,hqq@0.875,fp8@0.5,bnb@0.75,knorm@0.875,h2o@0.875"


def stock(model, ids, mask) -> None:
    model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **cache_kwargs(model, DynamicCache()))


def vericache(model, ids, mask, name: str, ratio: float, at_prefill: bool) -> None:
    cache = VeriCache(model.config.num_hidden_layers, build_compressor(name, ratio), stage_on_cpu=at_prefill)
    with cache.prefilling(model, mask):
        model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--shapes", default="1x2048,4x2048", help="batch x prompt tokens, comma separated")
    parser.add_argument("--compressors", default=DEFAULT, help="name@ratio, comma separated")
    parser.add_argument("--at-prefill", action="store_true", help="build the draft tier in the prefill")
    args = parser.parse_args()
    model = smollm2_shaped()
    config = model.config
    methods = [("stock", None)] + [
        (name, (name.split("@")[0], float(name.split("@")[1]))) for name in args.compressors.split(",")
    ]
    print("| shape | method | prefill ms (median) | x stock |\n|---|---|---|---|")
    for shape in args.shapes.split(","):
        batch, length = (int(n) for n in shape.split("x"))
        ids = torch.randint(0, config.vocab_size, (batch, length))
        mask = torch.ones_like(ids)
        times: dict[str, list[float]] = {name: [] for name, _ in methods}
        with torch.no_grad():  # not inference_mode: see the transfer engine
            for repeat in range(args.repeats + 1):
                shift = repeat % len(methods)
                for name, compressor in methods[shift:] + methods[:shift]:
                    started = time.perf_counter()
                    if compressor is None:
                        stock(model, ids, mask)
                    else:
                        vericache(model, ids, mask, *compressor, args.at_prefill)
                    if repeat:  # the first round warms up
                        times[name].append(time.perf_counter() - started)
        base = statistics.median(times["stock"])
        for name, _ in methods:
            mine = statistics.median(times[name])
            print(f"| {shape} | {name} | {mine * 1000:.0f} | {mine / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
