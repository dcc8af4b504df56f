"""The one registration of `generation_mode="vericache"`.

Transformers has no registry of decoding modes, so `import vericache_hf` wraps `GenerationMixin.generate` once:
a call with `generation_mode="vericache"` is routed to `vericache_hf.generate` through transformers' own
`custom_generate` path; every other call reaches stock `generate` untouched.
"""

from __future__ import annotations

import functools

from transformers.generation.utils import GenerationMixin

from .decoding import generate as vericache_decoding

MODE = "vericache"
_stock_generate = GenerationMixin.generate


def vericache_generate(model, *args, **kwargs):
    """Stock `generate` preparation, then VeriCache decoding.

    `streamer` and `tokenizer` never reach a `custom_generate` callable, so they are handed over under names of
    their own (`vericache_streamer`; stop strings become a stopping criterion built here).
    """
    streamer = kwargs.pop("streamer", None)
    if kwargs.get("assistant_model") is not None:
        raise ValueError(
            "generation_mode='vericache' drafts with the model itself and cannot be combined with assistant_model; "
            "drop one of them."
        )
    if kwargs.get("custom_generate") is not None:
        raise ValueError("generation_mode='vericache' and custom_generate cannot be combined; drop one of them.")
    if streamer is not None:
        kwargs["vericache_streamer"] = streamer
    return _stock_generate(model, *args, custom_generate=vericache_decoding, **kwargs)


@functools.wraps(_stock_generate)
def generate_with_modes(self, *args, generation_mode: str | None = None, **kwargs):
    if generation_mode is None:
        return _stock_generate(self, *args, **kwargs)
    if generation_mode != MODE:
        raise ValueError(f"Unknown generation_mode={generation_mode!r}; vericache_hf adds {MODE!r}.")
    return vericache_generate(self, *args, **kwargs)


def register() -> None:
    """Install the `generation_mode` kwarg on every transformers model (idempotent)."""
    if GenerationMixin.generate is not generate_with_modes:
        GenerationMixin.generate = generate_with_modes
