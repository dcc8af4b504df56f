"""Background threads that copy, load and save without slowing the thread that decodes.

PyTorch's CPU build runs its parallel ops on GNU OpenMP, which gives every thread that runs one its own team of
worker threads, kept for the thread's life. Once the teams' threads outnumber the cores, libgomp stops spinning
between parallel regions (100 spins instead of 300,000) and the decoding thread's workers sleep after each op and
wake for the next. A draft step is hundreds of small ops: on a 2-core CPU, after the prefix writer had
serialised one prefix, a batch-1 bfloat16 draft step took 73-129 ms against 42-65 ms (float32 ones 65-92 against
61-79), for as long as the writer lived. `GOMP_SPINCOUNT=100` alone does the same.

So each of the library's background threads (the prefix writer, loader and reader, and the transfer engine's
worker) runs its torch ops on itself alone: its OpenMP setting is its own (a per-thread setting), so the caller's
threads and any other are untouched.

A thread that has run parallel ops and now only waits still holds its team. That is the common case of decoding in a
thread other than the one that loaded the model: the loading thread's idle team is enough to stop the spinning, and
a batch-4 draft step took 82-86 ms against 53-60 ms on the thread that loaded the model (2 cores, SmolLM2's shapes,
`benchmarks/thread_teams.py`). `release_workers` gives a waiting thread's team back; its next parallel op starts a
new one.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from threadpoolctl import ThreadpoolController


@cache
def _libraries() -> ThreadpoolController:
    """The loaded OpenMP (and BLAS) libraries: finding them takes a few ms, so once per process."""
    return ThreadpoolController()


#: `omp_pause_soft` of OpenMP 5.0's `omp_pause_resource_all`: libgomp then frees the calling thread's team.
_PAUSE_SOFT = 1


@cache
def _pause_teams():
    """libgomp's `omp_pause_resource_all`, or None where torch's OpenMP is another runtime (or none): LLVM's and
    Intel's keep their workers otherwise, and their pause acts on every thread, not the caller's alone."""
    for library in _libraries().lib_controllers:
        if library.internal_api == "openmp" and "libgomp" in library.filepath:
            pause = getattr(ctypes.CDLL(library.filepath), "omp_pause_resource_all", None)
            if pause is not None:
                pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause
    return None


def release_workers() -> None:
    """Give back the calling thread's idle OpenMP workers; call it in a thread about to wait while another decodes.
    Its next parallel op starts a new team (well under a millisecond), so the cost is one thread start a wait.
    Nothing else changes: not this thread's width, nor any other thread's team."""
    pause = _pause_teams()
    if pause is not None and torch.get_num_threads() > 1:
        pause(_PAUSE_SOFT)


def run_ops_alone() -> None:
    """Make the calling thread run torch's CPU ops on itself, without an OpenMP team; call it first thing in a
    background thread. Only this thread's OpenMP setting changes."""
    # torch sets a thread's OpenMP width on the thread's first parallel op, over anything set before: do that first
    torch.get_num_threads()
    _libraries().limit(limits=1, user_api="openmp")
