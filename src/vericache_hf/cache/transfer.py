"""The transfer engine: a queue of chunk transfers (host full tier -> device staging buffer) served by one worker.

It belongs to no request: any cache may `submit` a layer's chunks, in the order it will read them. A transfer waits
in the backlog until a staging slot is free (backpressure: at most `num_buffers` chunks are on the device), then
the worker thread copies it. With CUDA the copy runs on a dedicated stream and the consumer's stream waits on an
event, so the host never blocks on the copy. When the device is the CPU the full tier already lies in its memory:
a transfer is then ready at once and hands out views of the host chunks, unless `stage_on_cpu=True` asks for the
accelerator's path (buffers, queue and worker thread, with plain copies), which is how that path is tested here.

Life of a transfer: backlog -> queued (holds a slot) -> copying -> ready -> released (slot free again); or failed /
cancelled. The worker starts on demand and exits when its queue is empty, so an idle engine holds no thread.
Every wait has a timeout, and an error in the worker fails the transfer (and the rest of its group) and is raised
in the caller's `wait`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checks import check_seconds
from .full_tier import HostKVStore, HostSnapshot
from .staging import StagingBuffers, buffer_tokens

_ALL = object()
WORKER_THREAD_NAME = "vericache-transfer"  # one per engine while it has copies to make


class TransferError(RuntimeError):
    """A full-tier transfer failed, timed out or was cancelled; the verify pass cannot go on without its layer."""


@dataclass(eq=False)
class ChunkTransfer:
    """One chunk of one layer's full tier on its way to the device."""

    store: HostKVStore
    snapshot: HostSnapshot
    chunk: int
    device: torch.device
    group: Any = None
    label: Any = None
    state: str = "backlog"
    slot: int | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    error: BaseException | None = None
    bytes: int = 0
    seconds: float = 0.0  # copy time (CUDA: measured between events on the copy stream)
    waited: float = 0.0  # time the consumer waited for it (CUDA: stall of the consumer's stream)
    inference_mode: bool = (
        False  # the consumer's grad mode: buffers made under inference_mode need it to be written
    )
    done: threading.Event = field(default_factory=threading.Event)
    timed: threading.Event = field(default_factory=threading.Event)
    events: dict[str, Any] = field(default_factory=dict)

    @property
    def start(self) -> int:
        """Index of the chunk's first token in the layer."""
        return self.snapshot.chunk_span(self.chunk)[0]

    @property
    def tokens(self) -> int:
        """Tokens the chunk holds."""
        return self.snapshot.chunk_span(self.chunk)[1]

    @property
    def name(self) -> str:
        return f"layer {self.label}, chunk {self.chunk}"


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def _timing_event():
    return torch.cuda.Event(enable_timing=True)


class TransferEngine:
    """Chunk transfers for any number of requests, through `num_buffers` staging slots and one worker thread."""

    def __init__(self, num_buffers: int = 2, timeout: float = 60.0, stage_on_cpu: bool = False) -> None:
        check_seconds("transfer timeout", timeout)
        self.buffers = StagingBuffers(num_buffers)
        self.timeout = float(timeout)
        self.stage_on_cpu = stage_on_cpu
        self._lock = threading.RLock()
        self._backlog: deque[ChunkTransfer] = deque()
        self._queue: deque[ChunkTransfer] = deque()
        self._thread: threading.Thread | None = None
        self._last_thread: threading.Thread | None = None
        self._streams: dict[torch.device, Any] = {}
        self._free_events: dict[int, Any] = {}

    # -- the consumer's side ------------------------------------------------------------------------------------
    def submit(
        self, store: HostKVStore, device: torch.device | str, group: Any = None, label: Any = None
    ) -> list[ChunkTransfer]:
        """Queue copies of `store`'s chunks as they are now, one transfer per chunk; transfers are served in
        submission order. `label` names the layer in errors."""
        snapshot, device = store.snapshot(), torch.device(device)
        events = {}
        if _cuda(device):  # the copies must follow the non-blocking appends queued on this stream
            events["submitted"] = torch.cuda.Event()
            events["submitted"].record(torch.cuda.current_stream(device))
        inference_mode = torch.is_inference_mode_enabled()
        transfers = [
            ChunkTransfer(
                store,
                snapshot,
                chunk,
                device,
                group,
                label,
                inference_mode=inference_mode,
                events=dict(events),
            )
            for chunk in range(snapshot.num_chunks)
        ]
        with self._lock:
            store.transfers_in_flight += len(transfers)
            if device.type == "cpu" and not self.stage_on_cpu:
                for transfer in transfers:
                    self._read_in_place(transfer)
                return transfers
            self._backlog.extend(transfers)
            self._dispatch()
        return transfers

    def wait(self, transfer: ChunkTransfer) -> tuple[torch.Tensor, torch.Tensor]:
        """Block until the transfer's buffers are ready for the current stream; returns (B, H, tokens, D) views of
        the chunk's stored tokens. Raises `TransferError` within the timeout."""
        started = time.perf_counter()
        if not transfer.done.wait(self.timeout):
            self.cancel(transfer.group)
            raise TransferError(
                f"the transfer of {transfer.name} did not finish within {self.timeout:.0f} s "
                f"(state {transfer.state!r}); raise the transfer timeout if the host is this slow."
            )
        transfer.waited += time.perf_counter() - started
        if transfer.error is not None:
            self._join_idle_worker()
            if isinstance(transfer.error, TransferError):
                raise transfer.error
            raise TransferError(
                f"the transfer of {transfer.name} failed in the worker: {transfer.error!r}"
            ) from (transfer.error)
        if _cuda(transfer.device):
            stream = torch.cuda.current_stream(transfer.device)
            before, after = _timing_event(), _timing_event()
            before.record(stream)
            stream.wait_event(transfer.events["ready"])
            after.record(stream)
            transfer.events.update(before=before, after=after)
        take = transfer.tokens
        return transfer.keys[:, :, :take], transfer.values[:, :, :take]

    def release(self, transfer: ChunkTransfer) -> None:
        """The consumer is done reading the transfer's buffers (or no longer wants them): free its slot."""
        with self._lock:
            if transfer.state in ("backlog", "queued"):
                self._cancel_one(transfer, TransferError(f"the transfer of {transfer.name} was cancelled."))
                self._dispatch()
                return
        if transfer.state == "copying":
            transfer.done.wait(self.timeout)
        with self._lock:
            if transfer.state != "ready":
                return  # already released, or failed / cancelled (which freed the slot)
            if transfer.slot is not None:
                if _cuda(transfer.device):
                    freed = torch.cuda.Event()
                    freed.record(torch.cuda.current_stream(transfer.device))
                    self._free_events[transfer.slot] = freed
                self.buffers.release(transfer.slot)
                transfer.slot = None
            transfer.state = "released"
            transfer.store.transfers_in_flight -= 1
            self._dispatch()

    def settle(self, transfer: ChunkTransfer) -> None:
        """Fill in `seconds` and `waited` from CUDA events (blocks until they have run); nothing to do on CPU."""
        if not transfer.timed.wait(self.timeout):
            raise TransferError(f"the timing of {transfer.name}'s transfer never arrived.")
        if "after" in transfer.events:
            transfer.events["after"].synchronize()
            stall = transfer.events.pop("before").elapsed_time(transfer.events.pop("after")) / 1000
            transfer.waited += stall  # host wait for the worker to enqueue + the consumer stream's stall

    def cancel(self, group: Any = _ALL) -> None:
        """Cancel every transfer of `group` (every transfer when no group is given) that no worker has started."""
        with self._lock:
            for pending in list(self._backlog) + list(self._queue):
                if group is _ALL or pending.group is group:
                    self._cancel_one(pending, TransferError(f"the transfer of {pending.name} was cancelled."))
            self._dispatch()

    def close(self) -> None:
        """Cancel what is pending and wait for the worker to exit."""
        self.cancel()
        self._join_idle_worker()

    @property
    def worker_alive(self) -> bool:
        thread = self._thread or self._last_thread
        return thread is not None and thread.is_alive()

    # -- the engine's side --------------------------------------------------------------------------------------
    @staticmethod
    def _read_in_place(transfer: ChunkTransfer) -> None:
        """A CPU consumer reads the host chunk itself: no slot, no copy, nothing for the worker. The transfer still
        counts as in flight until released, so the store cannot be truncated under the reader."""
        transfer.keys = transfer.snapshot.key_chunks[transfer.chunk]
        transfer.values = transfer.snapshot.value_chunks[transfer.chunk]
        transfer.state = "ready"
        transfer.done.set()
        transfer.timed.set()

    def _cancel_one(self, transfer: ChunkTransfer, error: BaseException) -> None:
        for line in (self._backlog, self._queue):
            if transfer in line:
                line.remove(transfer)
        if transfer.slot is not None:
            self.buffers.release(transfer.slot)
            transfer.slot = None
        if transfer.state in ("backlog", "queued"):
            transfer.store.transfers_in_flight -= 1
        transfer.state, transfer.error = "cancelled", error
        transfer.done.set()
        transfer.timed.set()

    def _dispatch(self) -> None:
        """Give free slots to the oldest backlog transfers (allocating buffers here, on the consumer's thread and
        stream) and make sure a worker serves the queue. Call with the lock held."""
        while self._backlog:
            slot = self.buffers.try_acquire()
            if slot is None:
                break
            transfer = self._backlog.popleft()
            transfer.slot, transfer.state = slot, "queued"
            snapshot = transfer.snapshot
            tokens = buffer_tokens(snapshot.length, snapshot.chunk_tokens)
            transfer.keys, transfer.values = self.buffers.buffers(
                slot, transfer.device, snapshot.dtype, snapshot.shape, tokens
            )
            self._queue.append(transfer)
        if self._queue and self._thread is None:
            self._thread = threading.Thread(target=self._work, name=WORKER_THREAD_NAME, daemon=True)
            self._last_thread = self._thread
            self._thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                transfer = self._queue.popleft()
                transfer.state = "copying"
                freed = self._free_events.pop(transfer.slot, None)
            try:
                with torch.inference_mode(transfer.inference_mode):
                    self._copy(transfer, freed)
            except BaseException as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
                self._fail(transfer, error)
                continue
            transfer.state = "ready"
            transfer.done.set()
            if "end" in transfer.events:
                transfer.events["end"].synchronize()  # the worker blocks on the copy, never the consumer
                transfer.seconds = transfer.events["start"].elapsed_time(transfer.events["end"]) / 1000
            transfer.timed.set()

    def _copy(self, transfer: ChunkTransfer, freed: Any) -> None:
        started = time.perf_counter()
        if not _cuda(transfer.device):
            transfer.bytes = transfer.snapshot.copy_chunk_into(transfer.chunk, transfer.keys, transfer.values)
            transfer.seconds = time.perf_counter() - started
            return
        stream = self._streams.get(transfer.device)
        if stream is None:
            stream = self._streams[transfer.device] = torch.cuda.Stream(transfer.device)
        start, end, ready = _timing_event(), _timing_event(), torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_event(transfer.events["submitted"])
            if freed is not None:
                stream.wait_event(freed)  # the slot's previous chunk has been read
            start.record(stream)
            transfer.bytes = transfer.snapshot.copy_chunk_into(transfer.chunk, transfer.keys, transfer.values)
            end.record(stream)
            ready.record(stream)
        transfer.keys.record_stream(stream)
        transfer.values.record_stream(stream)
        transfer.events.update(start=start, end=end, ready=ready)

    def _fail(self, transfer: ChunkTransfer, error: BaseException) -> None:
        with self._lock:
            if transfer.slot is not None:  # its buffers hold garbage: free the slot now
                self.buffers.release(transfer.slot)
                transfer.slot = None
            transfer.store.transfers_in_flight -= 1
            transfer.state, transfer.error = "failed", error
            transfer.done.set()
            transfer.timed.set()
            for pending in list(self._backlog) + list(self._queue):
                if pending.group is transfer.group:
                    self._cancel_one(
                        pending,
                        TransferError(f"cancelled: the transfer of {transfer.name} failed ({error!r})."),
                    )
            self._dispatch()

    def _join_idle_worker(self) -> None:
        thread = self._last_thread
        if thread is None or thread is threading.current_thread():
            return
        with self._lock:
            busy = bool(self._queue)
        if not busy:
            thread.join(self.timeout)
            if thread.is_alive():
                raise TransferError(f"the transfer worker did not stop within {self.timeout:.0f} s.")
