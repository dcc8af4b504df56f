"""Serve several requests at once with VeriCache, in transformers' continuous-batching call shapes.

    .venv/bin/python examples/serve_many.py

Requests are added from any thread at any time; each prefills alone, then decodes in passes shared with the others
(a cohort). One request is streamed as it decodes; every answer is checked against stock `generate` of its prompt.
"""

import torch

import vericache_hf
from vericache_tools import load_embedded_model

model, tokenizer = load_embedded_model()
questions = [
    "Write a Python function that reverses a string.",
    "Write a Python function that tells whether a year is a leap year.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that returns the n-th Fibonacci number.",
]
prompts = [
    tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
    for q in questions
]
config = vericache_hf.VeriCacheConfig(compressor="snapkv", compression_ratio=0.75)

with vericache_hf.VeriCacheEngine(model, config, max_concurrent=4, do_sample=False) as engine:
    ids = [engine.add_request(prompt, max_new_tokens=48) for prompt in prompts]
    for partial in engine.request_id_iter(ids[0]):  # the first answer, as it arrives
        print(f"\r{ids[0]}: {len(partial.generated_tokens)} tokens", end="", flush=True)
    print()
    results = {ids[0]: partial} | {request_id: engine.get_result(request_id) for request_id in ids[1:]}
    print("requests per shared pass:", round(engine.cohort_stats().get("mean_rows_per_round", 0.0), 2))

for (request_id, out), prompt in zip(results.items(), prompts, strict=True):
    stock = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    text = tokenizer.decode(out.generated_tokens, skip_special_tokens=True)
    print(f"{request_id} ({out.status.name}, identical: {out.generated_tokens == stock}): {text[:60]!r}")
    assert out.generated_tokens == stock, f"{request_id} differs from stock generate"
