"""How often greedy VeriCache output differs from stock `generate` in half precision, beside how often stock
`generate` differs from itself when only the kernel shapes change.

In float32/float64 a verify pass over k+1 tokens and k+1 single-token steps agree to the last bit often enough that
greedy output is identical; in bfloat16/float16 the two shapes round differently, and a near-tie between the top two
logits can flip. Stock decoding has the same sensitivity: the same prompt decoded alone or inside a left-padded
batch of 4, or prefilled whole or in two pieces, is a different computation too. This script measures all three
over the same prompts, so the documentation can state exactly what holds.

    python benchmarks/half_precision.py --json docs/benchmarks/half-precision/results.json   # tiny models, SmolLM2
    python benchmarks/half_precision.py --models tiny --prompts 8 --new-tokens 8                # a quick look
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import vericache_hf
from vericache_hf.compat import cache_kwargs

TINY_VOCAB = 96


def tiny_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    """The tests' tiny random Llama (sharpened output layer, so drafts run long), in `dtype`."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model.to(dtype)


def tiny_prompts(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, TINY_VOCAB, (1, 48 + 5 * (i % 8)), generator=generator) for i in range(count)]


def smollm2_prompts(tokenizer, count: int) -> list[torch.Tensor]:
    from vericache_tools.prompts import humaneval_problems

    problems = humaneval_problems()[:count]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Complete this function:\n" + p["prompt"]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for p in problems
    ]
    return [tokenizer(text, return_tensors="pt").input_ids for text in texts]


def greedy(model, ids, new_tokens: int, **kwargs) -> torch.Tensor:
    """The generated tokens only (a row of `ids` may be left-padded)."""
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    return out[:, ids.shape[-1] :]


def left_pad(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[-1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[-1] :] = prompt[0]
        mask[row, width - prompt.shape[-1] :] = 1
    return ids, mask


def two_piece(model, ids, new_tokens: int) -> torch.Tensor:
    """Stock greedy output with the prompt prefilled in two forward passes instead of one."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, : ids.shape[-1] // 2], use_cache=True, **cache_kwargs(model, cache))
    return greedy(model, ids, new_tokens, **cache_kwargs(model, cache))


def measure(model, prompts: list[torch.Tensor], new_tokens: int, config) -> dict:
    pad = model.config.pad_token_id or 0
    alone = [greedy(model, ids, new_tokens) for ids in prompts]
    vericache = [
        greedy(model, ids, new_tokens, generation_mode="vericache", vericache_config=config)
        for ids in prompts
    ]
    batched = []
    for start in range(0, len(prompts), 4):
        group = prompts[start : start + 4]
        ids, mask = left_pad(group, pad)
        batched.extend(greedy(model, ids, new_tokens, attention_mask=mask).split(1))
    split = [two_piece(model, ids, new_tokens) for ids in prompts]

    def differ(outputs):
        return sum(not torch.equal(a, b) for a, b in zip(alone, outputs, strict=True))

    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "vericache_differs": differ(vericache),
        "stock_batch_of_4_differs": differ(batched),
        "stock_two_piece_prefill_differs": differ(split),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32", help="comma-separated torch dtypes")
    parser.add_argument("--prompts", type=int, default=52, help="prompts per model and dtype")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--compressor", default="snapkv", help="VeriCache compressor")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    config = vericache_hf.VeriCacheConfig(compressor=args.compressor, compression_ratio=0.75)
    rows = []
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            if name == "tiny":
                model, prompts = tiny_llama(dtype), tiny_prompts(args.prompts)
            else:
                if dtype == torch.float16:
                    continue  # fp16 matmuls on a CPU are emulated and far too slow for 50 prompts
                from vericache_tools import load_embedded_model

                model, tokenizer = load_embedded_model(dtype=dtype)
                prompts = smollm2_prompts(tokenizer, args.prompts)
            started = time.perf_counter()
            row = {"model": name, "dtype": dtype_name, **measure(model, prompts, args.new_tokens, config)}
            row["seconds"] = round(time.perf_counter() - started, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
