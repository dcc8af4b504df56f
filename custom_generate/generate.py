"""Hub-style entry point: `model.generate(..., custom_generate="<repo or dir holding this folder>",
trust_remote_code=True, vericache_config={...})` runs VeriCache decoding without `import vericache_hf` in user code.

Transformers hands this function every `generate` argument (streamer and tokenizer included), so it routes them
through `vericache_generate`, the same front door as `generation_mode="vericache"`.
"""

from __future__ import annotations


def generate(model, *args, **kwargs):
    from vericache_hf.registration import vericache_generate

    kwargs.pop("generation_mode", None)
    return vericache_generate(model, *args, **kwargs)
