"""Background threads that copy, load and save without slowing the thread that decodes.

PyTorch's CPU build runs its parallel ops on GNU OpenMP, which gives every thread that runs one its own team of
worker threads, kept for the thread's life. Once the teams' threads outnumber the cores, libgomp stops spinning
between parallel regions (100 spins instead of 300,000) and the decoding thread's workers sleep after each op and
wake for the next. A draft step is hundreds of small ops: on the 2-core CPU here, after the prefix writer had
serialised one prefix, a batch-1 bfloat16 draft step took 73-129 ms against 42-65 ms (float32 ones 65-92 against
61-79), for as long as the writer lived (docs/results.md). `GOMP_SPINCOUNT=100` alone does the same.

So each of the library's background threads (the prefix writer, loader and reader, and the transfer engine's
worker) runs its torch ops on itself alone: its OpenMP setting is its own (a per-thread setting), so the caller's
threads and any other are untouched.
"""

from __future__ import annotations

from functools import cache

import torch
from threadpoolctl import ThreadpoolController


@cache
def _libraries() -> ThreadpoolController:
    """The loaded OpenMP (and BLAS) libraries: finding them takes a few ms, so once per process."""
    return ThreadpoolController()


def run_ops_alone() -> None:
    """Make the calling thread run torch's CPU ops on itself, without an OpenMP team; call it first thing in a
    background thread. Only this thread's OpenMP setting changes."""
    # torch sets a thread's OpenMP width on the thread's first parallel op, over anything set before: do that first
    torch.get_num_threads()
    _libraries().limit(limits=1, user_api="openmp")
