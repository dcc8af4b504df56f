"""The cache keyword that moved within transformers 5.x: models take their `Cache` as `cache=` from 5.24 on, and
as `past_key_values=` before; the old name warns now and goes away in 5.40. Each call site asks here, so every 5.x
release works without deprecation warnings."""

from __future__ import annotations

import functools
import inspect

from transformers.generation.utils import GenerateDecoderOnlyOutput

# The field of generate's output that holds the cache, in the installed transformers.
CACHE_OUTPUT_FIELD = (
    "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
)


def passed_cache(model_kwargs: dict):
    """The cache in `generate`'s model kwargs, under either name (None when there is none)."""
    return model_kwargs.get("cache", model_kwargs.get("past_key_values"))


def cache_kwargs(model, cache) -> dict:
    """`{name: cache}` under the keyword this model's `forward` takes its cache by, plus what the cache's current
    pass hands the model's attention (`VeriCache.pass_kwargs`)."""
    extra = cache.pass_kwargs() if hasattr(cache, "pass_kwargs") else {}
    return {_cache_keyword(type(model)): cache, **extra}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
