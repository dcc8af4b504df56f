"""CPU thread plumbing, in one place: the library's hooks for threads that wait and threads that work behind
decoding. Both do nothing unless the decoding they serve runs on the CPU, so an accelerator's user pays nothing
(threadpoolctl, which finds the OpenMP runtime, is imported only on the CPU path, and is optional: without it the
hooks do nothing, and only the speed below is lost).

PyTorch's CPU build runs its parallel ops on GNU OpenMP, which gives every thread that runs one its own team of
worker threads, kept for the thread's life. Once the teams' threads outnumber the cores, libgomp stops spinning
between parallel regions (100 spins instead of 300,000) and the decoding thread's workers sleep after each op and
wake for the next. A draft step is hundreds of small ops: on a 2-core CPU, after the prefix writer had
serialised one prefix, a batch-1 bfloat16 draft step took 73-129 ms against 42-65 ms (float32 ones 65-92 against
61-79), for as long as the writer lived. `GOMP_SPINCOUNT=100` alone does the same.

So each of the library's background threads (the prefix writer, loader and reader, and the transfer engine's
worker) runs its torch ops on itself alone (`in_background`): its OpenMP setting is its own (a per-thread setting),
so the caller's threads and any other are untouched.

A thread that has run parallel ops and now only waits still holds its team. That is the common case of decoding in a
thread other than the one that loaded the model: the loading thread's idle team is enough to stop the spinning, and
a batch-4 draft step took 82-86 ms against 53-60 ms on the thread that loaded the model (2 cores, SmolLM2's shapes,
`benchmarks/thread_teams.py`). `release_workers` gives a waiting thread's team back (`waiting` is the hook); its
next parallel op starts a new one.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache
from typing import Any

import torch

#: `omp_pause_soft` of OpenMP 5.0's `omp_pause_resource_all`: libgomp then frees the calling thread's team.
_PAUSE_SOFT = 1
_local = threading.local()  # `alone`: this thread already runs its ops on itself


def waiting(device: Any = None) -> None:
    """Hook: the calling thread is about to wait while another decodes on `device` (None: the CPU). On the CPU its
    idle OpenMP team is given back (`release_workers`); elsewhere nothing happens."""
    if _on_cpu(device):
        release_workers()


def in_background(device: Any = None) -> None:
    """Hook: the calling thread works behind decoding on `device` (None: the CPU), as the library's background
    threads do; call it first thing there. On the CPU the thread runs torch's ops on itself alone; elsewhere nothing
    happens. Cheap to call again."""
    if _on_cpu(device) and not getattr(_local, "alone", False):
        run_ops_alone()
        _local.alone = True


def release_workers() -> None:
    """Give back the calling thread's idle OpenMP workers; call it in a thread about to wait while another decodes.
    Its next parallel op starts a new team (well under a millisecond), so the cost is one thread start a wait.
    Nothing else changes: not this thread's width, nor any other thread's team. Without threadpoolctl, or with an
    OpenMP runtime other than GNU's, it does nothing."""
    if torch.get_num_threads() <= 1:
        return
    pause = _pause_teams()
    if pause is not None:
        pause(_PAUSE_SOFT)


def run_ops_alone() -> None:
    """Make the calling thread run torch's CPU ops on itself, without an OpenMP team. Only this thread's OpenMP
    setting changes; without threadpoolctl it does nothing."""
    # torch sets a thread's OpenMP width on the thread's first parallel op, over anything set before: do that first
    torch.get_num_threads()
    libraries = _libraries()
    if libraries is not None:
        libraries.limit(limits=1, user_api="openmp")


def _on_cpu(device: Any) -> bool:
    return device is None or torch.device(device).type == "cpu"


@cache
def _libraries():
    """The loaded OpenMP (and BLAS) libraries, or None without threadpoolctl: finding them takes a few ms, so once
    per process."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return ThreadpoolController()


@cache
def _pause_teams():
    """libgomp's `omp_pause_resource_all`, or None where torch's OpenMP is another runtime (or none), or
    threadpoolctl is missing: LLVM's and Intel's keep their workers otherwise, and their pause acts on every thread,
    not the caller's alone."""
    libraries = _libraries()
    for library in libraries.lib_controllers if libraries is not None else ():
        if library.internal_api == "openmp" and "libgomp" in library.filepath:
            pause = getattr(ctypes.CDLL(library.filepath), "omp_pause_resource_all", None)
            if pause is not None:
                pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause
    return None
