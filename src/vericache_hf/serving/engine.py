"""`VeriCacheEngine` and `generate_batch`: many requests at once, in the call shapes of transformers' continuous
batching (`add_request(s)`, `get_result`, `request_id_iter`, ids `req_0`, `req_1`, ..., and its `GenerationOutput`
with `RequestStatus`), so that a user of `model.generate_batch` changes one thing.

Each request runs as one VeriCache `generate` call on one of `max_concurrent` worker threads: it prefills alone
(one prompt at a time, beside the running rounds), then joins a cohort between that cohort's rounds (`cohort.py`):
the rows of a cohort draft and verify in shared forward passes, each with its own request's settings, stopping
criteria and streamer, and leave when they stop. Several cohorts take turns on the device, so while one drafts,
another's full tier streams in through the engine's one transfer queue and it verifies (the paper's staggering);
how many cohorts and how large is planned from measured copy and compute times (`cohorts=`, `cohort_size=`
override it; `cohort_size=1` serves every request alone on its worker, each on its own CUDA stream). Requests with
a proposer or `return_dict_in_generate`, and compressors whose draft tier cannot be split by row (kvpress presses),
decode alone on their worker; a request with a prefix store joins a cohort after its suffix's round. Prompts'
whole chunks are kept in host memory after their prefill (`prefix_cache_memory`, LRU), and a later prompt that
starts with some of them prefills only the rest (prefix caching, as transformers' continuous batching shares KV
blocks).

Requests join and leave at any time, a failing request fails alone with its error in its result, `cancel` ends a
request at its next round and frees its rows, and `stop` ends every request and leaves no thread behind.
`VeriCacheConfig(timeline=Timeline())` records each request's prefill on a track named after it and each cohort's
draft, transfer and verify spans on a track of its own. A device-memory budget admits requests by their draft tier
and staging buffers (`admission.py`).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from .._threads import waiting
from ..cache.transfer import TransferEngine
from ..checks import check_int
from ..decoding import resolve_config
from ..layer_plan import layer_plan, window_layers
from ..prefix.shared import SharedPrefixes
from ..registration import MODE
from .admission import Footprint, MemoryBudget, footprint, parse_bytes
from .cohort import CohortPool, own_stream

__all__ = ["GenerationOutput", "RequestStatus", "VeriCacheEngine", "generate_batch"]

_STOP = object()  # tells a worker to exit


class _Request:
    """One request's state, shared between the caller's threads and the worker that serves it."""

    def __init__(self, request_id: str, prompt_ids: list[int], generate_kwargs: dict[str, Any]) -> None:
        self.output = GenerationOutput(request_id=request_id, prompt_ids=prompt_ids, timestamps=[])
        self.generate_kwargs = generate_kwargs
        self.cancelled = threading.Event()
        self.changed = threading.Condition()
        self.prompt_streamed = False
        self.footprint: Footprint | None = None  # device bytes it holds, when the engine has a budget

    # The streamer protocol `generate` drives: the prompt first, then each new token.
    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_streamed:
            self.prompt_streamed = True
            return
        with self.changed:
            self.output.generated_tokens.extend(int(token) for token in value.reshape(-1))
            self.output.timestamps.extend([time.perf_counter()] * value.numel())
            self.output.status = RequestStatus.DECODING
            self.changed.notify_all()

    def end(self) -> None:
        pass

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        with self.changed:
            self.output.status, self.output.error = status, error
            self.output.lifespan = (self.output.lifespan[0], time.perf_counter())
            self.changed.notify_all()

    def snapshot(self) -> GenerationOutput:
        with self.changed:
            return replace(
                self.output,
                generated_tokens=list(self.output.generated_tokens),
                timestamps=list(self.output.timestamps or []),
            )


class _Cancelled(StoppingCriteria):
    """Stops a request's `generate` at its next emitted token once `cancel` was called."""

    def __init__(self, request: _Request) -> None:
        self.request = request

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        # on the ids' device: StoppingCriteriaList ORs every criterion's answer into a tensor there
        cancelled = self.request.cancelled.is_set()
        return torch.full((input_ids.shape[0],), cancelled, dtype=torch.bool, device=input_ids.device)


class VeriCacheEngine:
    """Serve requests with VeriCache decoding from any thread, at any time.

    `vericache_config` and `generate_kwargs` (for example `do_sample=False`) apply to every request; `add_request`
    takes per-request ones on top. `max_concurrent` requests are served at once (each holds its full tier in host
    memory meanwhile; the rest wait in order); they share forward passes in `cohorts` cohorts of at most
    `cohort_size` (each "auto": planned from measured times; `cohort_size=1`: every request alone, each prefilling
    on its own worker, so lower `max_concurrent` then; a model that counts positions from its cache's length, as the
    BART family's causal decoders do, needs it). `prefix_cache_memory` (host bytes, or None for none) keeps
    prompts' exact K/V for later requests that start the same way: their prefill computes only the rest (see
    `prefix/shared.py`); a model with window layers (`cache/window.py`) prefills every prompt whole, since they keep
    no full tier to share from. Use it as a context manager, or call `start()` and `stop()`.
    """

    def __init__(
        self,
        model,
        vericache_config=None,
        max_concurrent: int = 8,
        device_memory_budget: int | str | None = None,
        cohorts: int | str = "auto",
        cohort_size: int | str = "auto",
        prefix_cache_memory: int | str | None = "4GiB",
        **generate_kwargs: Any,
    ) -> None:
        check_int("max_concurrent", max_concurrent)
        self.model = model
        # requests share forward passes in cohorts, unless each is to run alone (its own passes, its own thread)
        self._cohorts = None if cohort_size == 1 else CohortPool(model, cohorts, cohort_size)
        self._budget = MemoryBudget(parse_bytes(device_memory_budget)) if device_memory_budget else None
        config = resolve_config(vericache_config, model.generation_config)
        # one transfer queue for every request (one link): a request's full tier streams in while others draft
        self._transfers = TransferEngine(
            config.staging_buffers * max_concurrent,
            config.transfer_timeout,
            config.emulated_link_bytes_per_s,
            slots_per_group=config.staging_buffers,
            timeline=config.timeline,
        )
        self.timeline = config.timeline  # each request's spans go on a track named after it
        # prompts' exact K/V kept for the requests after (prefix caching): a shared prefix is not prefilled again
        if prefix_cache_memory and window_layers(layer_plan(model, strict=False)):
            warnings.warn(
                f"{type(model).__name__}'s sliding-window or chunked layers keep one exact tier and no full tier to "
                "share a prefix from: the engine prefills every prompt whole (pass prefix_cache_memory=None to say "
                "so).",
                stacklevel=2,
            )
            prefix_cache_memory = None
        self._prefixes = (
            SharedPrefixes(model, parse_bytes(prefix_cache_memory), config.prefix_chunk_tokens)
            if prefix_cache_memory
            else None
        )
        self.generate_kwargs = {
            "vericache_config": vericache_config,
            "vericache_transfers": self._transfers,
            "vericache_cohorts": self._cohorts,
            "vericache_prefixes": self._prefixes,
            **generate_kwargs,
        }
        self.max_concurrent = max_concurrent
        self._requests: dict[str, _Request] = {}
        self._pending: queue.Queue = queue.Queue()
        self._finished: queue.Queue = queue.Queue()
        self._workers: list[threading.Thread] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._state = "new"

    # -- life cycle ---------------------------------------------------------------------------------------------
    def start(self) -> VeriCacheEngine:
        with self._lock:
            if self._state == "stopped":
                raise RuntimeError(
                    "this VeriCacheEngine was stopped; create a new one to serve more requests."
                )
            if self._state == "new":
                self._workers = [
                    threading.Thread(target=self._work, name=f"vericache-engine-{i}", daemon=True)
                    for i in range(self.max_concurrent)
                ]
                for worker in self._workers:
                    worker.start()
                self._state = "running"
        return self

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Cancel every request not yet finished and end the workers (waiting for them when `block`)."""
        with self._lock:
            if self._state != "running":
                self._state = "stopped"
                if self._cohorts is not None:
                    self._cohorts.close(0)
                return
            self._state = "stopped"
            for request in self._requests.values():
                request.cancelled.set()
            for _ in self._workers:
                self._pending.put(_STOP)
        if not block and self._cohorts is not None:
            self._cohorts.close(0)  # its threads end once the cancelled rows have left
        if block:
            deadline = None if timeout is None else time.monotonic() + timeout
            for worker in self._workers:
                worker.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if self._cohorts is not None:
                self._cohorts.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
            self._transfers.close()

    def __enter__(self) -> VeriCacheEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def is_running(self) -> bool:
        return self._state == "running" and any(worker.is_alive() for worker in self._workers)

    # -- requests -----------------------------------------------------------------------------------------------
    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        **generate_kwargs: Any,
    ) -> str:
        """Queue one prompt (token ids); returns its request id (`req_<n>` unless given)."""
        prompt = _prompt_ids(input_ids)
        kwargs = {**self.generate_kwargs, **generate_kwargs}
        if max_new_tokens is not None:
            check_int("max_new_tokens", max_new_tokens)
            kwargs["max_new_tokens"] = max_new_tokens
        need = self._footprint(len(prompt), kwargs) if self._budget is not None else None
        if need is not None:
            self._budget.check(need)
        with self._lock:
            if self._state == "stopped":
                raise RuntimeError(
                    "this VeriCacheEngine was stopped; create a new one to serve more requests."
                )
            request_id = request_id if request_id is not None else f"req_{next(self._ids)}"
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use; pass another or none.")
            request = self._requests[request_id] = _Request(request_id, prompt, kwargs)
            request.footprint = need
        self.start()
        self._pending.put(request)
        return request_id

    def add_requests(
        self, inputs: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int | None = None, **kwargs: Any
    ) -> list[str]:
        return [self.add_request(ids, max_new_tokens=max_new_tokens, **kwargs) for ids in inputs]

    def _footprint(self, prompt_tokens: int, kwargs: dict[str, Any]) -> Footprint:
        config = kwargs.get("generation_config") or self.model.generation_config
        new = kwargs.get("max_new_tokens") or config.max_new_tokens
        new = new if new is not None else max(1, config.max_length - prompt_tokens)
        return footprint(
            self.model, resolve_config(kwargs.get("vericache_config"), config), prompt_tokens, new
        )

    def cohort_stats(self) -> dict[str, float]:
        """Rounds the cohorts ran and how many requests shared their passes (empty when each runs alone)."""
        return self._cohorts.stats() if self._cohorts is not None else {}

    def prefix_stats(self) -> dict[str, int]:
        """Prefix caching: requests that started from a kept prefix and that did not, tokens reused, host bytes
        held, chunks evicted (empty when `prefix_cache_memory` is off)."""
        return self._prefixes.stats() if self._prefixes is not None else {}

    def memory_stats(self) -> dict[str, float]:
        """The device-memory budget, its peaks, and how many requests of the admitted ones' mean size it holds,
        VeriCache against full KV on the device (empty without a budget)."""
        return self._budget.stats() if self._budget is not None else {}

    def cancel(self, request_id: str) -> None:
        """End a request at its next round (or before it starts); its result says it was cancelled."""
        self._request(request_id).cancelled.set()

    def get_result(
        self, request_id: str | None = None, timeout: float | None = None
    ) -> GenerationOutput | None:
        """The finished output of `request_id`, or of the next request to finish when None; None on timeout.

        As in transformers, a result is handed out once: the engine then forgets the request, so a long-running
        engine holds only the requests whose results nobody has taken yet."""
        waiting(self.model.device)  # the caller's OpenMP team sits idle while the workers decode
        if request_id is not None:
            request = self._request(request_id)
            with request.changed:
                if not request.changed.wait_for(request.output.is_finished, timeout):
                    return None
            return self._take(request_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                finished = self._finished.get(timeout=left)
            except queue.Empty:
                return None
            output = self._take(finished)
            if output is not None:  # else its result was already taken by id
                return output

    def _take(self, request_id: str) -> GenerationOutput | None:
        with self._lock:
            request = self._requests.pop(request_id, None)
        return request.snapshot() if request is not None else None

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """The request's output each time new tokens arrive, the finished one last (which hands the result out, as
        `get_result` does)."""
        request = self._request(request_id)
        seen = -1
        while True:
            waiting(self.model.device)  # the caller's OpenMP team sits idle while the workers decode
            with request.changed:
                arrived = request.changed.wait_for(
                    lambda seen=seen: (
                        request.output.is_finished() or len(request.output.generated_tokens) > seen
                    ),
                    timeout,
                )
                if not arrived:
                    raise TimeoutError(f"request {request_id!r} produced nothing within {timeout} s.")
                seen = len(request.output.generated_tokens)
                done = request.output.is_finished()
            if done:
                yield self._take(request_id) or request.snapshot()
                return
            yield request.snapshot()

    def _request(self, request_id: str) -> _Request:
        with self._lock:
            request = self._requests.get(request_id)
        if request is None:
            raise KeyError(
                f"unknown request id {request_id!r}; add_request returns the ids this engine knows."
            )
        return request

    # -- the workers --------------------------------------------------------------------------------------------
    def _work(self) -> None:
        # On CUDA each worker runs its requests on its own stream: a verify pass that waits for its full tier's copy
        # (an event on the worker's stream) then holds back only its own request, not another's draft steps.
        with own_stream(self.model.device):
            while True:
                waiting(self.model.device)  # this worker's OpenMP team, idle until a request comes
                request = self._pending.get()
                if request is _STOP:
                    return
                self._serve(request)
                self._finished.put(request.output.request_id)

    def _serve(self, request: _Request) -> None:
        request.output.lifespan = (time.perf_counter(), -1)
        if request.cancelled.is_set():
            request.finish(RequestStatus.FAILED, "cancelled before it started")
            return
        kwargs = dict(request.generate_kwargs)
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(_Cancelled(request))
        if self._budget is not None and not self._budget.admit(request.footprint, request.cancelled):
            request.finish(RequestStatus.FAILED, "cancelled while waiting for device memory")
            return
        with request.changed:
            request.output.status = RequestStatus.PREFILLING
        track = self.timeline.track(request.output.request_id) if self.timeline is not None else nullcontext()
        try:
            prompt = torch.tensor([request.output.prompt_ids], device=self.model.device)
            with track:
                self.model.generate(
                    prompt,
                    generation_mode=MODE,
                    streamer=request,
                    stopping_criteria=criteria,
                    **kwargs,
                )
        except Exception as error:  # noqa: BLE001 - a failing request fails alone, its error in its result
            request.finish(RequestStatus.FAILED, f"{type(error).__name__}: {error}")
            return
        finally:
            if self._budget is not None:
                self._budget.release(request.footprint)
        if request.cancelled.is_set():
            request.finish(RequestStatus.FAILED, "cancelled")
        else:
            request.finish(RequestStatus.FINISHED)


def _prompt_ids(input_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.ndim == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.ndim != 1:
            raise ValueError(
                f"a request takes one prompt of token ids, shape (length,) or (1, length); got shape "
                f"{tuple(input_ids.shape)}. Add several prompts with add_requests."
            )
        input_ids = input_ids.tolist()
    prompt = list(input_ids)
    if not prompt or not all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
        raise ValueError("a request's prompt must be a non-empty sequence of integer token ids.")
    return prompt


def generate_batch(
    model,
    inputs: Sequence[Sequence[int] | torch.Tensor],
    max_new_tokens: int | None = None,
    vericache_config=None,
    max_concurrent: int = 8,
    device_memory_budget: int | str | None = None,
    cohorts: int | str = "auto",
    cohort_size: int | str = "auto",
    prefix_cache_memory: int | str | None = "4GiB",
    **generate_kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Serve `inputs` to the end, as `model.generate_batch` does: outputs keyed `req_0`, `req_1`, ... in input
    order. Each request's greedy output equals stock `generate` of that prompt alone."""
    engine = VeriCacheEngine(
        model,
        vericache_config,
        max_concurrent,
        device_memory_budget,
        cohorts,
        cohort_size,
        prefix_cache_memory,
        **generate_kwargs,
    )
    with engine:
        ids = engine.add_requests(inputs, max_new_tokens=max_new_tokens)
        return {request_id: engine.get_result(request_id) for request_id in ids}
