"""Device bytes one request holds, by layer kind, under VeriCache and with stock's cache: `footprint` on models
built on the meta device from real configs' dimensions (nothing is downloaded, no weights are allocated).

Stock holds every token in a full-attention layer and at most its window in a sliding one. VeriCache holds a draft
tier in every full-attention layer, plus the staging buffers its full tier visits the device through; a sliding
layer of a model that has full-attention layers too keeps its window, exact, as its one tier (with a trim's slack
and a round's tokens). Batch 1, bfloat16, the default VeriCacheConfig except for the compression ratio.

    python benchmarks/device_memory.py > docs/benchmarks/device_memory_by_layer_kind.md
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

import vericache_hf
from vericache_hf.layer_plan import layer_plan
from vericache_hf.serving.admission import footprint

#: Gemma 3 4B's text decoder: 34 layers, five sliding (1024 tokens) to one global, 4 KV heads of 256.
GEMMA3_4B = dict(
    hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, sliding_window=1024, vocab_size=262208, max_position_embeddings=131072,
)  # fmt: skip
#: Llama 3 8B: 32 full-attention layers, 8 KV heads of 128 (Llama 3.1's 128k positions, the same cache).
LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
)  # fmt: skip
MODELS = {"Gemma-3-4B": (Gemma3TextConfig, GEMMA3_4B), "Llama-3-8B": (LlamaConfig, LLAMA3_8B)}


def meta_model(config_class, sizes: dict):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_class(**sizes), dtype=torch.bfloat16)


def mib(count: int) -> str:
    return f"{count / 2**20:,.0f}"


def table(prompts: list[int], ratios: list[float], new_tokens: int) -> str:
    lines = [
        "| model | prompt | ratio | layer kind | layers | stock full KV (MiB) | VeriCache on the device (MiB) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    totals = [
        "| model | prompt | ratio | stock full KV (MiB) | VeriCache draft tier (MiB) | window layers (MiB) "
        "| staging (MiB) | VeriCache device total (MiB) | VeriCache / stock |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (config_class, sizes) in MODELS.items():
        model = meta_model(config_class, sizes)
        kinds = [plan.kind for plan in layer_plan(model, strict=False)]
        for prompt in prompts:
            for ratio in ratios:
                config = vericache_hf.VeriCacheConfig(compression_ratio=ratio)
                need = footprint(model, config, prompt, new_tokens, on_device=True)
                for kind in sorted(need.full_kv_by_kind):
                    lines.append(
                        f"| {name} | {prompt} | {ratio} | {kind} | {kinds.count(kind)} "
                        f"| {mib(need.full_kv_by_kind[kind])} | {mib(need.device_by_kind[kind])} |"
                    )
                totals.append(
                    f"| {name} | {prompt} | {ratio} | {mib(need.full_kv_bytes)} | {mib(need.draft_bytes)} "
                    f"| {mib(need.window_bytes)} | {mib(need.staging_bytes)} | {mib(need.device_bytes)} "
                    f"| {need.device_bytes / need.full_kv_bytes:.2f} |"
                )
    return "\n".join([*totals, "", *lines])


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="8192,32768")
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    text = table(
        [int(p) for p in args.prompts.split(",")],
        [float(r) for r in args.ratios.split(",")],
        args.max_new_tokens,
    )
    print(text)
    return text


if __name__ == "__main__":
    main()
