"""What a wider pass costs: one forward of w tokens per row over 1,024 cached tokens (about a draft tier at 8k tokens
and ratio 0.875), for w = 1-6 and 11 (prompt lookup offers up to 10), at batch 1 and 4, on the embedded model.
Hierarchical drafting pays only when the tokens a wider pass keeps outweigh what the width costs. On a 2-core CPU
with MKL, one row per weight product is a matrix-vector product; 2-3 rows cost 2-3 of those and 4+ rows take a packed
path at about twice one, so at batch 1 any pass wider than one token costs 1.6-2.2x a one-token pass.

    python benchmarks/draft_pass_width.py
"""

import time

import torch
from transformers import DynamicCache

from vericache_hf.compat import cache_kwargs
from vericache_tools import load_embedded_model

model, _ = load_embedded_model()
torch.manual_seed(0)
for batch in (1, 4):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(100, 20000, (batch, 1024)), **cache_kwargs(model, cache), use_cache=True)
        for width in (1, 2, 3, 4, 5, 6, 11):
            seconds = []
            for _ in range(4):
                tokens = torch.randint(100, 20000, (batch, width))
                started = time.perf_counter()
                model(tokens, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=width)
                seconds.append(time.perf_counter() - started)
                cache.crop(-width)
            print(f"batch {batch}, width {width}: {1000 * sorted(seconds)[1]:.1f} ms (second fastest of 4)")
