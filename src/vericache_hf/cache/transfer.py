"""The transfer engine: a queue of transfers (host full tier -> device staging buffer) served by one worker, each a
whole layer or one chunk of a layer (see `staging.py`).

It belongs to no request: any cache may `submit` its layers, in the order it will read them. A transfer waits in
the backlog until a staging slot is free (backpressure: at most `num_buffers` layers are on the device), then the
worker thread copies it. With CUDA the copy runs on a dedicated stream and the consumer's stream waits on an event,
so the host never blocks on the copy. On a CPU-only machine the same path runs with plain copies, which is how it is
tested here (a cache whose layers live on the CPU reads its full tier in place and needs no engine).

Life of a transfer: backlog -> queued (holds a slot) -> copying -> ready -> released (slot free again); or failed /
cancelled. The worker starts with the first transfer and waits for the next one between verify passes, so a round
starts no thread; it stops when the engine is closed (a cache closes its own engine when released) or garbage-collected,
and a later `submit` starts another. It holds its engine only while it copies, so an engine nobody holds is
collected. Every wait has a timeout, and an error in the worker fails the transfer (and the rest of its group) and is
raised in the caller's `wait`.

Each copy is recorded in `timeline`, when one is given, on the track of the thread that queued it.
`link_bytes_per_s` emulates a slower link, for study on a machine without one (benchmarks only, never on by
default): after each copy the worker sleeps until the copy has taken the time that many bytes would take on that
link. It sleeps, so it costs no CPU, and the transfer is not ready until then.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from .._threads import in_background
from ..checks import check_seconds
from ..timeline import Timeline
from .full_tier import HostKVStore, HostSnapshot
from .staging import StagingBuffers

_ALL = object()
_IDLE_CHECK_SECONDS = 5.0  # an idle worker looks again this often, should a wake-up ever be missed
WORKER_THREAD_NAME = "vericache-transfer"  # one per engine, from its first transfer until it is closed


class TransferError(RuntimeError):
    """A full-tier transfer failed, timed out or was cancelled; the verify pass cannot go on without its layer."""


@dataclass(eq=False)
class LayerTransfer:
    """One layer's full tier, or its tokens [start, end) (a chunk), on its way to the device, into a buffer with
    `room` free slots after them (of `capacity` tokens when one is set)."""

    store: HostKVStore
    snapshot: HostSnapshot
    device: torch.device
    room: int = 0
    start: int = 0
    end: int | None = None  # None: up to the snapshot's length
    capacity: int | None = None
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
    track: str | None = None  # the timeline track of the thread that queued it
    done: threading.Event = field(default_factory=threading.Event)
    timed: threading.Event = field(default_factory=threading.Event)
    events: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Tokens the layer held when the transfer was queued (what the verify pass must still find there)."""
        return self.snapshot.length

    @property
    def stop(self) -> int:
        """The end of the tokens the transfer copies."""
        return self.snapshot.length if self.end is None else self.end

    @property
    def count(self) -> int:
        """Tokens the transfer copies, into the first slots of its buffers."""
        return self.stop - self.start

    @property
    def name(self) -> str:
        return f"layer {self.label}"


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def _timing_event():
    return torch.cuda.Event(enable_timing=True)


class TransferEngine:
    """Layer transfers for any number of requests, through `num_buffers` staging slots and one worker thread;
    shared by several requests, give each at most `slots_per_group` of the slots."""

    def __init__(
        self,
        num_buffers: int = 2,
        timeout: float = 60.0,
        link_bytes_per_s: float | None = None,
        slots_per_group: int | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        check_seconds("transfer timeout", timeout)
        if link_bytes_per_s is not None and not link_bytes_per_s > 0:
            raise ValueError(
                f"link_bytes_per_s must be a positive number of bytes per second, got {link_bytes_per_s!r}"
            )
        self.buffers = StagingBuffers(num_buffers)
        self.timeout = float(timeout)
        self.link_bytes_per_s = link_bytes_per_s
        self.slots_per_group = slots_per_group
        self.timeline = timeline
        self._held: Counter[int] = Counter()  # slots each group holds, by id(group)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)  # the worker waits on it for transfers, or to stop
        self._stop: threading.Event | None = None  # the running worker's
        self._backlog: deque[LayerTransfer] = deque()
        self._queue: deque[LayerTransfer] = deque()
        self._thread: threading.Thread | None = None
        self._last_thread: threading.Thread | None = None
        self._streams: dict[torch.device, Any] = {}
        self._free_events: dict[int, Any] = {}

    # -- the consumer's side ------------------------------------------------------------------------------------
    def submit(
        self,
        store: HostKVStore,
        device: torch.device | str,
        group: Any = None,
        label: Any = None,
        room: int = 0,
        span: tuple[int, int] | None = None,
        capacity: int | None = None,
    ) -> LayerTransfer:
        """Queue a copy of `store` as it is now (or of its tokens in `span`, a chunk) into a device buffer with
        `room` free slots after it (for the tokens the verify pass checks), of `capacity` tokens when given (a
        chunk's fixed size); transfers are served in submission order. `label` names the layer in errors."""
        snapshot, device = store.snapshot(), torch.device(device)
        start, end = span if span is not None else (0, None)
        events = {}
        if _cuda(device):  # the copy must follow the non-blocking appends queued on this stream
            events["submitted"] = torch.cuda.Event()
            events["submitted"].record(torch.cuda.current_stream(device))
        transfer = LayerTransfer(
            store,
            snapshot,
            device,
            room,
            start,
            end,
            capacity,
            group,
            label,
            inference_mode=torch.is_inference_mode_enabled(),
            events=events,
            track=self.timeline.current_track() if self.timeline is not None else None,
        )
        with self._lock:
            store.transfers_in_flight += 1
            self._backlog.append(transfer)
            self._dispatch()
        return transfer

    def wait(self, transfer: LayerTransfer) -> tuple[torch.Tensor, torch.Tensor]:
        """Block until the transfer's buffers are ready for the current stream; returns its (B, H, capacity, D)
        buffers, whose first `transfer.tokens` slots hold the layer. Raises `TransferError` within the timeout."""
        started = time.perf_counter()
        if not transfer.done.wait(self.timeout):
            self.cancel(transfer.group)
            raise TransferError(
                f"the transfer of {transfer.name} did not finish within {self.timeout:.0f} s "
                f"(state {transfer.state!r}); raise the transfer timeout if the host is this slow."
            )
        transfer.waited += time.perf_counter() - started
        if transfer.error is not None:
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
        return transfer.keys, transfer.values

    def release(self, transfer: LayerTransfer) -> None:
        """The consumer is done reading the transfer's buffers (or will not read them): free its slot."""
        with self._lock:
            if transfer.state in ("backlog", "queued"):
                self._cancel_one(transfer, TransferError(f"the transfer of {transfer.name} was cancelled."))
                self._dispatch()
                return
        if transfer.state == "copying" and not transfer.done.wait(self.timeout):
            raise TransferError(
                f"the copy of {transfer.name} did not finish within {self.timeout:.0f} s, so its buffer cannot be "
                "freed; raise the transfer timeout if the host is this slow."
            )
        with self._lock:
            if transfer.state != "ready":
                return  # already released, or failed / cancelled (which freed the slot)
            if transfer.slot is not None:
                if _cuda(transfer.device):
                    freed = torch.cuda.Event()
                    freed.record(torch.cuda.current_stream(transfer.device))
                    self._free_events[transfer.slot] = freed
                self._free_slot(transfer)
            transfer.state = "released"
            transfer.store.transfers_in_flight -= 1
            self._dispatch()

    def settle(self, transfer: LayerTransfer) -> None:
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
        """Cancel what is pending and stop the worker (a later `submit` starts another)."""
        self.cancel()
        self.stop_worker()

    def stop_worker(self) -> None:
        """Stop the worker once its copy in progress is done and wait for it to exit; what is still queued, and any
        later `submit`, gets a new one. Raises `TransferError` if it does not exit within the timeout."""
        with self._lock:
            thread, stop = self._thread, self._stop
            self._thread = self._stop = None
            if stop is not None:
                stop.set()
                self._wake.notify_all()
        if thread is None or thread is threading.current_thread():
            return
        thread.join(self.timeout)
        if thread.is_alive():
            raise TransferError(f"the transfer worker did not stop within {self.timeout:.0f} s.")
        with self._lock:
            self._dispatch()  # another cache's transfers queued meanwhile get a new worker

    @property
    def worker_alive(self) -> bool:
        thread = self._thread or self._last_thread
        return thread is not None and thread.is_alive()

    # -- the engine's side --------------------------------------------------------------------------------------
    def _cancel_one(self, transfer: LayerTransfer, error: BaseException) -> None:
        for line in (self._backlog, self._queue):
            if transfer in line:
                line.remove(transfer)
        if transfer.slot is not None:
            self._free_slot(transfer)
        if transfer.state in ("backlog", "queued"):
            transfer.store.transfers_in_flight -= 1
        transfer.state, transfer.error = "cancelled", error
        transfer.done.set()
        transfer.timed.set()

    def _free_slot(self, transfer: LayerTransfer) -> None:
        self.buffers.release(transfer.slot)
        transfer.slot = None
        self._held[id(transfer.group)] -= 1
        if not self._held[id(transfer.group)]:
            del self._held[id(transfer.group)]

    def _dispatch(self) -> None:
        """Give free slots to the oldest backlog transfers (allocating buffers here, on the consumer's thread and
        stream) and make sure a worker serves the queue. A group (a cache) holds at most `slots_per_group` slots,
        so that a request still drafting cannot hold every slot while another waits to verify. Call with the lock
        held."""
        for transfer in list(self._backlog):
            if self.slots_per_group and self._held[id(transfer.group)] >= self.slots_per_group:
                continue
            slot = self.buffers.try_acquire()
            if slot is None:
                break
            self._backlog.remove(transfer)
            self._held[id(transfer.group)] += 1
            transfer.slot, transfer.state = slot, "queued"
            snapshot = transfer.snapshot
            transfer.keys, transfer.values = self.buffers.buffers(
                slot,
                transfer.device,
                snapshot.dtype,
                snapshot.shape,
                transfer.count + transfer.room,
                transfer.capacity,
            )
            self._queue.append(transfer)
        if not self._queue:
            return
        if self._thread is None or not self._thread.is_alive():
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=_serve,
                args=(weakref.ref(self), self._wake, self._stop),
                name=WORKER_THREAD_NAME,
                daemon=True,
            )
            self._last_thread = self._thread
            weakref.finalize(self, _stop, self._wake, self._stop)
            self._thread.start()
        else:
            self._wake.notify_all()

    def _next(self) -> tuple[LayerTransfer, Any] | None:
        """The next queued transfer, marked as copying, and the event its slot's last reader recorded; None when
        nothing is queued. Call with the lock held."""
        if not self._queue:
            return None
        transfer = self._queue.popleft()
        transfer.state = "copying"
        return transfer, self._free_events.pop(transfer.slot, None)

    def _work(self, transfer: LayerTransfer, freed: Any) -> None:
        """Copy one transfer on the worker thread; an error fails it and is raised in the consumer's `wait`."""
        in_background(transfer.device)
        try:
            started = time.perf_counter()
            with torch.inference_mode(transfer.inference_mode):
                self._copy(transfer, freed)
            if self.link_bytes_per_s is not None:  # an emulated link: the copy takes its time there
                self._emulate_link(transfer, started)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
            self._fail(transfer, error)
            return
        transfer.state = "ready"
        transfer.done.set()
        if "end" in transfer.events:
            transfer.events["end"].synchronize()  # the worker blocks on the copy, never the consumer
            transfer.seconds = transfer.events["start"].elapsed_time(transfer.events["end"]) / 1000
        if self.timeline is not None:  # on CUDA the copy ended at about the time its end event was seen
            ended = time.perf_counter()
            self.timeline.add("transfer", ended - transfer.seconds, ended, transfer.track)
        transfer.timed.set()

    def _emulate_link(self, transfer: LayerTransfer, started: float) -> None:
        """Sleep until the copy begun at `started` has taken what its bytes take on the emulated link."""
        time.sleep(max(0.0, transfer.bytes / self.link_bytes_per_s - (time.perf_counter() - started)))
        transfer.seconds = max(transfer.seconds, time.perf_counter() - started)

    def _copy(self, transfer: LayerTransfer, freed: Any) -> None:
        started = time.perf_counter()
        if not _cuda(transfer.device):
            transfer.bytes = transfer.snapshot.copy_into(
                transfer.keys, transfer.values, transfer.start, transfer.stop
            )
            transfer.seconds = time.perf_counter() - started
            return
        stream = self._streams.get(transfer.device)
        if stream is None:
            stream = self._streams[transfer.device] = torch.cuda.Stream(transfer.device)
        start, end, ready = _timing_event(), _timing_event(), torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_event(transfer.events["submitted"])
            if freed is not None:
                stream.wait_event(freed)  # the slot's previous layer has been read
            start.record(stream)
            transfer.bytes = transfer.snapshot.copy_into(
                transfer.keys, transfer.values, transfer.start, transfer.stop
            )
            end.record(stream)
            ready.record(stream)
        transfer.keys.record_stream(stream)
        transfer.values.record_stream(stream)
        transfer.events.update(start=start, end=end, ready=ready)

    def _fail(self, transfer: LayerTransfer, error: BaseException) -> None:
        with self._lock:
            if transfer.slot is not None:  # its buffers hold garbage: free the slot now
                self._free_slot(transfer)
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


def _serve(engine_ref: weakref.ref, wake: threading.Condition, stop: threading.Event) -> None:
    """The worker thread: copy the engine's queued transfers in order and wait for more, until `stop` is set or
    the engine is collected. It holds the engine only while it copies."""
    while True:
        with wake:
            while True:
                engine = engine_ref() if not stop.is_set() else None
                if engine is None:
                    return
                work = engine._next()
                if work is not None:
                    break
                engine = None  # not held while waiting: an engine nobody else holds is collected
                if stop.is_set() or engine_ref() is None:  # dropping it may have collected it, on this thread
                    return
                wake.wait(_IDLE_CHECK_SECONDS)
        engine._work(*work)
        engine = work = None


def _stop(wake: threading.Condition, stop: threading.Event) -> None:
    """Stop a worker whose engine was collected (it then finds no engine and exits)."""
    stop.set()
    with wake:
        wake.notify_all()
