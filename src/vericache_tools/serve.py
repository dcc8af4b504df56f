"""`vericache-hf serve`: transformers' own OpenAI-compatible server (`transformers serve`), VeriCache in every request.

The server, its endpoints, handlers, model process and options are transformers' (`transformers.cli.serve.Serve`);
this module adds three things to it:

- the server's VeriCache settings (`--compressor`, `--compression-ratio`, `--vericache-config`), carried by a
  `GenerationState` that the handlers and the model's process both see;
- the request side: each request's generate kwargs get `generation_mode="vericache"` and the server's
  `vericache_config`, which the request's own `generation_config` may override (`{"vericache_config": {...}}`) or
  turn off (`{"generation_mode": null}`: stock `generate`). Unknown or invalid VeriCache settings are a 422 that
  names them, never a silent fallback;
- the model's process: it imports `vericache_hf` (which registers `generation_mode`), and with `--prefix-store`
  opens the store once and hands it to every request's config (a store is a live connection, it cannot travel in
  a request).
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Any

from transformers.cli.serving.model_manager import ModelLoader
from transformers.cli.serving.utils import BaseHandler, GenerationState
from transformers.utils import logging

# imports vericache_hf, which registers generation_mode, in every process of the server that unpickles this module
from vericache_hf import VeriCacheConfig, VeriCacheStats
from vericache_hf.registration import MODE

__all__ = [
    "VeriCacheGenerationState",
    "VeriCacheModelLoader",
    "install_request_settings",
    "open_prefix_store",
]

logger = logging.get_logger("transformers.cli.serving.vericache")

#: Settings a request may set in `vericache_config`: the config's fields but the live objects, which JSON cannot
#: carry (`prefix_store` is the server's, from `--prefix-store`).
REQUEST_FIELDS = frozenset(f.name for f in fields(VeriCacheConfig)) - {"stats", "timeline", "prefix_store"}


def checked_config(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """`settings` as a JSON-friendly dict once `VeriCacheConfig` accepts it; a ValueError naming the problem."""
    if not isinstance(settings, dict):
        raise ValueError(f"{where} must be a JSON object of VeriCacheConfig settings, got {settings!r}.")
    unknown = sorted(set(settings) - REQUEST_FIELDS)
    if unknown:
        raise ValueError(
            f"unknown VeriCache settings {unknown} in {where}; known settings: {', '.join(sorted(REQUEST_FIELDS))}."
        )
    try:
        VeriCacheConfig(**settings)
    except (TypeError, ValueError) as error:
        raise ValueError(f"invalid VeriCache settings in {where}: {error}") from None
    return dict(settings)


class VeriCacheGenerationState(GenerationState):
    """transformers' `GenerationState` plus the server's VeriCache settings (`vericache_config`, a dict)."""

    vericache_config: dict[str, Any]

    @classmethod
    def adopt(cls, state: GenerationState, vericache_config: dict[str, Any]) -> VeriCacheGenerationState:
        adopted = cls.__new__(cls)
        adopted.__dict__.update(vars(state))
        adopted.vericache_config = dict(vericache_config)
        return adopted

    def apply(self, generation_kwargs: dict[str, Any]) -> None:
        """Turn a request's generate kwargs into VeriCache ones, in place (a ValueError for a bad setting)."""
        stray = sorted(
            name for name in generation_kwargs if name in REQUEST_FIELDS or name.startswith("vericache_")
        )
        stray = [name for name in stray if name != "vericache_config"]
        if stray:
            raise ValueError(
                f"generation_config sets VeriCache settings {stray} at its top level; put them in its "
                '"vericache_config" object, e.g. {"vericache_config": {"compression_ratio": 0.875}}.'
            )
        mode = generation_kwargs.pop("generation_mode", MODE)
        override = generation_kwargs.pop("vericache_config", None)
        if mode is None:  # the request asked for stock generate
            if override is not None:
                raise ValueError(
                    'generation_config has "generation_mode": null (stock generate) and a "vericache_config"; '
                    "drop one of them."
                )
            return
        if mode != MODE:
            raise ValueError(
                f"generation_mode must be {MODE!r} (the default here) or null (stock generate), got {mode!r}."
            )
        override = checked_config(
            override if override is not None else {}, "generation_config.vericache_config"
        )
        generation_kwargs["generation_mode"] = MODE
        generation_kwargs["vericache_config"] = {**self.vericache_config, **override}


_stock_build_generation_kwargs = BaseHandler._build_generation_kwargs


@functools.wraps(_stock_build_generation_kwargs)
def _build_generation_kwargs(self, body: dict, model_generation_config) -> dict:
    generation_kwargs = _stock_build_generation_kwargs(self, body, model_generation_config)
    if isinstance(self.generation_state, VeriCacheGenerationState):
        from fastapi import HTTPException

        try:
            self.generation_state.apply(generation_kwargs)
        except ValueError as error:
            raise HTTPException(status_code=422, detail=str(error)) from None
    return generation_kwargs


def install_request_settings() -> None:
    """Route every handler's generate kwargs through the server's `VeriCacheGenerationState` (once per process).

    transformers builds its handlers inside `Serve.run`, with no hook for their class, so the shared
    `BaseHandler._build_generation_kwargs` is wrapped. The wrapper dispatches on the handler's generation state:
    a server without VeriCache settings (stock `transformers serve` in the same process) is left exactly as it was.
    """
    BaseHandler._build_generation_kwargs = _build_generation_kwargs


def open_prefix_store(location: str):
    """A `redis://`, `rediss://` or `unix://` URL: a `RedisStore`; anything else: a `DiskStore` directory."""
    from vericache_hf.prefix import DiskStore, RedisStore

    if location.split("://", 1)[0] in ("redis", "rediss", "unix"):
        return RedisStore(location)
    if "://" in location:
        raise ValueError(
            f"--prefix-store takes a redis://, rediss:// or unix:// URL, or a directory; got {location!r}."
        )
    return DiskStore(location)


class VeriCacheModelLoader(ModelLoader):
    """transformers' `ModelLoader`, loaded in the model's process: unpickling it there imports this module, and so
    `vericache_hf`, which registers `generation_mode`. With a prefix store, the model's `generate` gets the store;
    with `engine_config` (the server's VeriCache settings, under `--continuous-batching`), requests are served
    together by a `VeriCacheEngine` (`serve_engine.py`)."""

    prefix_store: str | None
    engine_config: dict[str, Any] | None

    @classmethod
    def adopt(
        cls, loader: ModelLoader, prefix_store: str | None, engine_config: dict[str, Any] | None = None
    ) -> VeriCacheModelLoader:
        adopted = cls.__new__(cls)
        adopted.__dict__.update(vars(loader))
        adopted.prefix_store, adopted.engine_config = prefix_store, engine_config
        return adopted

    def load_model_and_processor(self, model_id: str, on_progress=None):
        if self.engine_config is not None:
            from .serve_engine import ENGINE_MAX_CONCURRENT, install_engine_runner

            install_engine_runner(self.engine_config, ENGINE_MAX_CONCURRENT)
        model, processor = super().load_model_and_processor(model_id, on_progress=on_progress)
        if self.prefix_store is not None:
            # Set once, at load, as transformers installs a repository's custom generate: requests then only read it.
            model.generate = _GenerateWithStore(model, open_prefix_store(self.prefix_store))
        return model, processor


class _GenerateWithStore:
    """The model's `generate` in a server with a prefix store: a VeriCache request's config gets the store, and the
    prompt tokens it reused are logged, a line per request."""

    def __init__(self, model, store) -> None:
        self.model, self.store = model, store

    def __call__(self, *args, vericache_config=None, **kwargs):
        model = self.model
        if not isinstance(vericache_config, dict):
            return type(model).generate(model, *args, vericache_config=vericache_config, **kwargs)
        stats = VeriCacheStats()
        config = VeriCacheConfig(**vericache_config, prefix_store=self.store, stats=stats)
        output = type(model).generate(model, *args, vericache_config=config, **kwargs)
        logger.info("Prefix store: %d prompt tokens reused", stats.prefix_tokens_reused)
        return output

    def __deepcopy__(self, memo: dict) -> _GenerateWithStore:
        # VeriCache's passes run on a deep copy of the module tree (`vericache_hf.pass_model`); the store is a live
        # connection, which cannot be copied, and the copy only runs forward passes: it shares this one.
        return self
