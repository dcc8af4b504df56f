"""`vericache-hf serve --continuous-batching`: the model's process serves requests with `VeriCacheEngine`.

transformers' continuous batching runs its own paged cache and batch loop, never `generate`, and takes only
`max_new_tokens`, eos and sampling from a request, so a request's VeriCache settings could not reach it. Here the
model's process swaps its runner instead: each VeriCache request joins the engine, whose cohorts share draft and
verify passes between requests as they arrive and leave, with the request's own settings (its `vericache_config`,
stop strings, sampling). A request that turns VeriCache off (`"generation_mode": null`) runs stock `generate` on
transformers' sequential runner, beside the engine.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from transformers.cli.serving import model_manager
from transformers.cli.serving.utils import GenerateRunner, prompt_length
from transformers.utils import logging

from vericache_hf import VeriCacheEngine
from vericache_hf.registration import MODE

__all__ = ["ENGINE_MAX_CONCURRENT", "EngineRunner", "install_engine_runner"]

#: requests the engine serves at once (the rest wait in order), as many as transformers' serve tests send at once
ENGINE_MAX_CONCURRENT = 8

logger = logging.get_logger("transformers.cli.serving.vericache")


class EngineRunner(GenerateRunner):
    """transformers' runner for the model's process, VeriCache requests served together by a `VeriCacheEngine`.

    It takes the arguments of transformers' `CBGenerateRunner`; the batching config and context length are the paged
    cache's, which the engine does not have (it sizes itself from the requests)."""

    def __init__(
        self,
        model,
        processor: Any,
        send_results,
        cb_config=None,
        context_length: int | None = None,
        *,
        vericache_config: dict[str, Any],
        max_concurrent: int = 8,
    ) -> None:
        super().__init__(model, processor, send_results)
        self.engine = VeriCacheEngine(model, vericache_config, max_concurrent=max_concurrent).start()
        self.engine_requests: set[int] = set()

    def generate(self, request_id: int, inputs: dict, generation_kwargs: dict, stream: bool) -> None:
        inputs = {  # continuous batching tokenizes to lists; stock generate wants a batch of tensors
            name: torch.tensor([value]) if isinstance(value, list) else value
            for name, value in inputs.items()
        }
        if generation_kwargs.get("generation_mode") != MODE:  # the request asked for stock generate
            super().generate(request_id, inputs, generation_kwargs, stream)
            return
        kwargs = {name: value for name, value in generation_kwargs.items() if value is not None}
        kwargs.pop("generation_mode")
        seed = kwargs.pop("seed", None)
        if (
            seed is not None
        ):  # as transformers' continuous batching does: the process's random numbers are shared
            torch.manual_seed(seed)
        self.count_tokens(prompt=prompt_length(inputs))
        with self.lock:
            self.engine_requests.add(request_id)
        try:
            self.engine.add_request(
                inputs["input_ids"][0], request_id=str(request_id), tokenizer=self.processor, **kwargs
            )
        except Exception as error:  # noqa: BLE001 - fails this request alone, as the runner's other paths do
            with self.lock:
                self.engine_requests.discard(request_id)
            self.send_results([], [], [(request_id, ValueError(f"{type(error).__name__}: {error}"))])
            return
        threading.Thread(
            target=self._deliver, args=(request_id, stream), name=f"deliver-{request_id}", daemon=True
        ).start()

    def _deliver(self, request_id: int, stream: bool) -> None:
        """Send a request's tokens as they come (when it streams), then its end."""
        sent, output = 0, None
        try:
            for output in self.engine.request_id_iter(str(request_id)):
                tokens = output.generated_tokens[sent:]
                self.count_tokens(generated=len(tokens))
                if stream and tokens and not output.error:
                    self.send_results([request_id] * len(tokens), tokens, [])
                sent = len(output.generated_tokens)
            if output is not None and output.error:
                result = None if output.error.startswith("cancelled") else RuntimeError(output.error)
            else:
                result = None if stream else list(output.generated_tokens if output is not None else [])
        except Exception as error:  # noqa: BLE001 - fails this request alone
            logger.exception("A request failed")
            result = RuntimeError(f"{type(error).__name__}: {error}")
        with self.lock:
            self.engine_requests.discard(request_id)
        self.send_results([], [], [(request_id, result)])
        shared = self.engine.cohort_stats()
        logger.info(
            "VeriCache engine: request %s ended; cohorts so far: %d rounds, at most %d rows a round",
            request_id,
            shared.get("rounds", 0),
            shared.get("most_rows_per_round", 1),
        )

    def cancel(self, request_id: int) -> None:
        with self.lock:
            in_engine = request_id in self.engine_requests
        if in_engine:
            with contextlib.suppress(KeyError):  # it ended, its result handed out, since the check above
                self.engine.cancel(str(request_id))
        else:
            super().cancel(request_id)

    def state(self) -> tuple[int, int, str]:
        with self.lock:
            engine = len(self.engine_requests)
        running, waiting, _ = super().state()
        return running + engine, waiting, ""


def install_engine_runner(vericache_config: dict[str, Any], max_concurrent: int) -> None:
    """Make this model's process build an `EngineRunner` where transformers would build its continuous-batching
    runner. transformers picks the runner inside the model's process (`EngineClient.run_engine`) with no hook for
    its class, so the name it looks up is rebound, once, in that process, which serves only this server."""

    def runner(*args, **kwargs) -> EngineRunner:
        return EngineRunner(*args, vericache_config=vericache_config, max_concurrent=max_concurrent, **kwargs)

    model_manager.CBGenerateRunner = runner
