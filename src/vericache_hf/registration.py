"""The one registration of `generation_mode="vericache"`.

Transformers has no registry of decoding modes, so `import vericache_hf` wraps `GenerationMixin.generate` once:
a call with `generation_mode="vericache"` (a kwarg, or an attribute of the call's or the model's
`generation_config`, so it is saved with the model) is routed to `vericache_hf.generate` through transformers' own
`custom_generate` path; every other call reaches stock `generate` untouched. `generate_batch` (transformers'
continuous batching) is wrapped the same way and routed to `vericache_hf.generate_batch`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

from transformers import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerationMixin

from .attention import register_attention
from .config import VeriCacheConfig
from .decoding import generate as vericache_decoding

MODE = "vericache"
#: Set on `generate_with_modes` to the stock `generate` it wraps. `importlib.reload` of this module runs this line
#: again while `GenerationMixin.generate` is the old wrapper; taking the wrapper's stock function instead of the
#: wrapper keeps a reload from wrapping the wrapper (which would recurse forever).
STOCK_ATTRIBUTE = "__wrapped_stock__"
_stock_generate = getattr(GenerationMixin.generate, STOCK_ATTRIBUTE, GenerationMixin.generate)
_stock_generate_batch = getattr(
    GenerationMixin.generate_batch, STOCK_ATTRIBUTE, GenerationMixin.generate_batch
)


def _take_stop_strings(model, kwargs: dict) -> None:
    """Turn `stop_strings` + `tokenizer` into a `StopStringCriteria` in `stopping_criteria`.

    In the `custom_generate` callable path transformers drops `tokenizer` before it builds the stop-string
    criterion, and then raises for want of it; building the criterion here, as stock `generate` would, avoids that.
    Without a tokenizer the stop strings are left to stock generate, which asks for one.
    """
    tokenizer = kwargs.pop("tokenizer", None)
    if "stop_strings" in kwargs:
        stop_strings = kwargs["stop_strings"]
    else:
        config = kwargs.get("generation_config") or model.generation_config
        stop_strings = getattr(config, "stop_strings", None)
    if not stop_strings or tokenizer is None:
        return
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None  # overrides a value saved in the generation config


def vericache_generate(model, *args, **kwargs):
    """Stock `generate` preparation, then VeriCache decoding.

    `streamer`, `assistant_model` and `tokenizer` never reach a `custom_generate` callable: stock generate still
    streams the prompt, the callable gets the streamer as `vericache_streamer` and the assistant (hierarchical
    drafting's proposer) as `vericache_assistant`, and stop strings become a criterion built here.
    """
    if kwargs.get("custom_generate") is not None:
        raise ValueError(
            "generation_mode='vericache' and custom_generate cannot be combined; drop one of them."
        )
    kwargs.pop("custom_generate", None)
    if kwargs.get("assistant_model") is not None:  # the proposer of hierarchical drafting
        kwargs["vericache_assistant"] = kwargs.pop("assistant_model")
    _take_stop_strings(model, kwargs)
    if kwargs.get("streamer") is not None:
        kwargs["vericache_streamer"] = kwargs["streamer"]
    return _stock_generate(model, *args, custom_generate=vericache_decoding, **kwargs)


def requested_mode(model, generation_mode: str | None, kwargs: dict) -> str | None:
    """The kwarg, else `generation_mode` saved in the call's or the model's generation config."""
    if generation_mode is not None:
        return generation_mode
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return getattr(config, "generation_mode", None)


@functools.wraps(_stock_generate)
def generate_with_modes(self, *args, generation_mode: str | None = None, **kwargs):
    generation_mode = requested_mode(self, generation_mode, kwargs)
    if generation_mode is None:
        return _stock_generate(self, *args, **kwargs)
    if generation_mode != MODE:
        raise ValueError(f"Unknown generation_mode={generation_mode!r}; vericache_hf adds {MODE!r}.")
    return vericache_generate(self, *args, **kwargs)


setattr(generate_with_modes, STOCK_ATTRIBUTE, _stock_generate)

#: transformers' continuous-batching settings that the VeriCache engine has no use for (it keeps no paged cache,
#: captures no graphs and always records timestamps).
_BATCHING_ONLY = (
    "continuous_batching_config",
    "record_timestamps",
    "progress_bar",
    "persistent_manager",
    "warmup",
)


#: What `generate_batch` runs in VeriCache's mode: the serving engine's, given to `register` and kept on the
#: wrapper, so that a reload of this module keeps it too.
BATCH_ATTRIBUTE = "__batch_decoding__"
_batch_decoding: Callable | None = getattr(GenerationMixin.generate_batch, BATCH_ATTRIBUTE, None)


@functools.wraps(_stock_generate_batch)
def generate_batch_with_modes(
    self, inputs, generation_config=None, *args, generation_mode: str | None = None, **kwargs
):
    generation_mode = requested_mode(self, generation_mode, {"generation_config": generation_config})
    if generation_mode is None:
        return _stock_generate_batch(self, inputs, generation_config, *args, **kwargs)
    if generation_mode != MODE:
        raise ValueError(f"Unknown generation_mode={generation_mode!r}; vericache_hf adds {MODE!r}.")
    if args:
        raise TypeError(
            "with generation_mode='vericache', pass generate_batch's settings by keyword (continuous_batching_config "
            "and the like are transformers' paged-cache settings, which the VeriCache engine does not use)."
        )
    if _batch_decoding is None:
        raise RuntimeError(
            "generate_batch's VeriCache mode needs `import vericache_hf`, which registers the engine."
        )
    for name in _BATCHING_ONLY:
        kwargs.pop(name, None)
    if generation_config is not None:
        kwargs["generation_config"] = generation_config
    return _batch_decoding(self, inputs, **kwargs)


setattr(generate_batch_with_modes, STOCK_ATTRIBUTE, _stock_generate_batch)


def set_default_mode(model, vericache_config=None) -> None:
    """Make VeriCache the model's default decoding, saved by `save_pretrained` with its generation config.

    The config is saved as JSON, so everything in it must be nameable: a compressor object of one's own (or an
    assistant model, a prefix store) is refused with a `ValueError` before anything is changed. A generation config
    made from a model config (`_from_model_config`) drops custom attributes on reload, so that flag is cleared here.
    """
    saved = None
    if vericache_config is not None:
        saved = _saved_form(VeriCacheConfig.from_any(vericache_config))
    config = model.generation_config
    config.generation_mode = MODE
    if saved is not None:
        config.vericache_config = saved
    config._from_model_config = False


def _saved_form(vericache_config: VeriCacheConfig) -> dict:
    """The config as the JSON a generation config saves, checked to read back into the same config, so that no
    later `generate` on the model meets a saved config it refuses."""
    saved = json.loads(json.dumps(vericache_config.to_dict()))
    try:
        again = VeriCacheConfig.from_any(saved).to_dict()
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"This VeriCacheConfig cannot be saved as the model's default: its saved form is refused when read "
            f"back ({error}). Pass it as vericache_config= to each generate call instead."
        ) from error
    if again != saved:
        raise ValueError(
            "This VeriCacheConfig cannot be saved as the model's default: its saved form reads back as a different "
            "config. Pass it as vericache_config= to each generate call instead."
        )
    return saved


def register(batch_decoding: Callable | None = None) -> None:
    """Install the `generation_mode` kwarg on every transformers model (idempotent, also after a reload of this
    module: the wrapper then replaces the old one, both wrapping the same stock `generate`), and the wrapped
    attention implementations VeriCache's passes run (`attention.py`). `batch_decoding` is what
    `generate_batch(..., generation_mode="vericache")` runs: the package passes the serving engine's
    `generate_batch`, so that this module, below serving, never imports it."""
    global _batch_decoding
    if batch_decoding is not None:
        _batch_decoding = batch_decoding
        setattr(generate_batch_with_modes, BATCH_ATTRIBUTE, batch_decoding)
    register_attention()
    if GenerationMixin.generate is not generate_with_modes:
        GenerationMixin.generate = generate_with_modes
    if GenerationMixin.generate_batch is not generate_batch_with_modes:
        GenerationMixin.generate_batch = generate_batch_with_modes
