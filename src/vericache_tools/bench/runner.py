"""Run every method on every prompt batch, side by side in one process, with interleaved repeats.

Each repeat runs all methods on the same batch, in an order rotated by one each time, so slow drifts of a shared
machine (other jobs, heat) fall on every method alike; the report takes medians over repeats. Every run also
times its own prefill (its first forward pass), so decode throughput can be told apart from prefill.

A repeat of a batch is the unit of work that is kept: `on_repeat` hands over a batch's samples after each of its
repeats (`Sample.to_dict` makes them JSON), and `measured` gives back such samples, whose repeats are then not run
again. So a run of many hours can stop and go on later, losing at most the repeat it was in (at 8k tokens and
batch 4 one repeat of the grid's methods is most of an hour).

With `paired=True`, each method instead runs side by side with a full-cache call, the two taking turns in slices
of half a second (`turns.run_side_by_side`), and its ratios are to that call: machine drift then falls on both
alike within seconds, not across calls.

Between runs, untimed, the heap's free memory goes back to the OS, and each run records its peak resident memory:
see `release_free_memory` and `PeakMemory`.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

import torch
from tqdm.auto import tqdm

from vericache_hf import VeriCacheStats
from vericache_hf.pass_model import pass_model

from .methods import Method
from .quality import trim
from .turns import run_side_by_side
from .workloads import Workload


@dataclass
class Sample:
    """One method on one prompt batch, over all repeats."""

    method: Method
    workload: str
    batch_index: int
    batch_size: int
    seconds: list[float] = field(default_factory=list)
    rows: list[list[int]] = field(default_factory=list)  # new tokens per row, up to EOS (first repeat)
    finished: list[bool] = field(default_factory=list)  # per row: ended at EOS, not cut by the limit
    computed_tokens: int = 0  # tokens the method produced, pad after EOS excluded
    stats: VeriCacheStats | None = None  # first repeat
    kv_bytes: int = 0  # full-cache method: bytes of its KV cache at the end
    prefill_seconds: list[float] = field(default_factory=list)  # each run's first forward pass
    peak_rss_bytes: list[int] = field(default_factory=list)  # each run's peak resident memory (Linux only)
    skipped: str | None = None  # why the method does not apply (n/a)
    # paired runs: the full-cache call that ran side by side with each run, its whole time and time to first token
    reference_seconds: list[float] = field(default_factory=list)
    reference_prefill_seconds: list[float] = field(default_factory=list)

    @property
    def median_seconds(self) -> float:
        return median(self.seconds) if self.seconds else float("nan")

    @property
    def decode_seconds(self) -> float:
        """The median run's time after its first forward pass (the prefill)."""
        return median(t - p for t, p in zip(self.seconds, self.prefill_seconds, strict=True))

    @property
    def reference_decode_seconds(self) -> float:
        """The same for the full-cache calls that ran beside it (paired runs)."""
        return median(
            t - p for t, p in zip(self.reference_seconds, self.reference_prefill_seconds, strict=True)
        )

    def to_dict(self) -> dict:
        """Everything measured, as JSON-ready values."""
        return asdict(self)  # the method and the stats become dicts too

    @classmethod
    def from_dict(cls, data: dict) -> Sample:
        stats = data.get("stats")
        return cls(
            **{
                **data,
                "method": Method(**data["method"]),
                "stats": VeriCacheStats(**stats) if stats is not None else None,
            }
        )


class FirstForwardTimer:
    """Wall time from entering the block to the end of the model's first forward pass (the prefill), whether the
    call runs the model itself or VeriCache's pass model of it."""

    def __init__(self, model) -> None:
        self.model, self.seconds, self.handles, self.started = model, None, [], 0.0

    def _hook(self, module, args, output) -> None:
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.started

    def __enter__(self) -> FirstForwardTimer:
        self.handles = [m.register_forward_hook(self._hook) for m in (self.model, pass_model(self.model))]
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


class PeakMemory:
    """The process's peak resident memory over a block, in bytes (`bytes` stays None where Linux's
    `/proc/self/clear_refs` cannot reset the peak). Recorded per run, so a grid that outgrows the machine's
    memory shows which method and which run grew it."""

    CLEAR_REFS, STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")

    def __init__(self) -> None:
        self.bytes: int | None = None
        self._armed = False

    def __enter__(self) -> PeakMemory:
        try:
            self.CLEAR_REFS.write_text("5")  # 5: reset the peak (VmHWM) to the current resident size
            self._armed = True
        except OSError:
            self._armed = False
        return self

    def __exit__(self, *exc) -> None:
        if self._armed:
            self.bytes = _status_kib(self.STATUS, "VmHWM") * 1024


def _status_kib(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise OSError(f"{key} missing from {path}")


def resident_bytes() -> int | None:
    """The process's resident memory now, in bytes (None off Linux)."""
    try:
        return _status_kib(PeakMemory.STATUS, "VmRSS") * 1024
    except OSError:
        return None


def release_free_memory() -> None:
    """Return the heap's free memory to the OS between runs (glibc's `malloc_trim`; nothing elsewhere).

    The bench's malloc settings keep freed memory mapped within a run, which saves the verify pass page faults.
    Across the many runs of a long-context, batch-4 workload, that kept memory piles up (past 24 GB over an 8k
    batch-4 grid). Trimming between runs bounds it without touching what is timed."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc():
    """The C library this process runs on, once: glibc has `malloc_trim`, others (musl, macOS) do not."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded into the process, the C library's among them
    except (OSError, TypeError):  # Windows has no such handle
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V for one token across all layers, in the model's dtype."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element = torch.finfo(model.dtype).bits // 8
    return 2 * config.num_hidden_layers * heads * head_dim * element


def _run_once(model, method: Method, batch, sample: Sample, max_new_tokens: int, eos: set[int], first: bool):
    release_free_memory()
    # not inference_mode: see the transfer engine
    with torch.no_grad(), PeakMemory() as peak, FirstForwardTimer(model) as timer:
        started = time.perf_counter()
        generation = method.generate(model, batch, max_new_tokens)
        seconds = time.perf_counter() - started
    _record(model, sample, batch, generation, seconds, timer.seconds, peak.bytes, eos, first)


def _run_paired(
    model, reference: Sample, sample: Sample, batch, max_new_tokens: int, eos: set[int], repeat: int
):
    """`sample`'s method side by side with a full-cache call, taking turns; which of the two goes first alternates
    with the repeat. The full-cache call is kept in `sample.reference_*`, and in `reference` too on its first pair."""
    release_free_memory()
    pair = [reference, sample] if repeat % 2 == 0 else [sample, reference]
    results = run_side_by_side(model, [s.method for s in pair], batch, max_new_tokens)
    for run, result in zip(pair, results, strict=True):
        if run is reference:
            sample.reference_seconds.append(result.seconds)
            sample.reference_prefill_seconds.append(result.first_token_seconds)
            if len(reference.seconds) > repeat:
                continue  # measured with an earlier pair of this repeat
        _record(
            model,
            run,
            batch,
            result.generation,
            result.seconds,
            result.first_token_seconds,
            None,
            eos,
            repeat == 0,
        )


def _record(
    model, sample: Sample, batch, generation, seconds: float, prefill, peak, eos: set[int], first: bool
) -> None:
    """One run's times (and peak memory, when measured); on the first repeat, what it produced."""
    sample.seconds.append(seconds)
    sample.prefill_seconds.append(prefill)
    if peak is not None:
        sample.peak_rss_bytes.append(peak)
    if not first:
        return
    sample.rows = [trim(row, eos) for row in generation.new_tokens]
    sample.finished = [bool(row) and row[-1] in eos for row in sample.rows]
    # Compressed-only decoding runs every row to max_new_tokens; the others stop each row at its EOS.
    lengths = (
        [generation.new_tokens.shape[-1]] * batch.batch_size if sample.method.family == "lossy" else None
    )
    sample.computed_tokens = sum(lengths) if lengths else sum(len(row) for row in sample.rows)
    sample.stats = generation.stats
    if sample.method.family == "full":
        slots = int(batch.attention_mask.sum()) + sample.computed_tokens
        sample.kv_bytes = slots * kv_bytes_per_token(model)


def run_bench(
    model,
    workloads: list[Workload],
    methods: list[Method],
    max_new_tokens: int,
    repeats: int = 2,
    eos_token_ids: set[int] | None = None,
    progress: bool = True,
    on_workload: Callable[[Workload, list[Sample]], None] | None = None,
    on_repeat: Callable[[Workload, list[Sample]], None] | None = None,
    measured: Iterable[Sample] = (),
    paired: bool = False,
) -> list[Sample]:
    """Every method on every batch of every workload, `repeats` times each, interleaved.

    `on_repeat(workload, samples)` is called after each repeat of a batch, with the samples of that batch so far,
    and `on_workload(workload, samples)` as each workload ends, with all of its samples, so a long run can save what
    it has. A batch with a sample of every method in `measured` (same workload name and batch index) goes on from
    the repeats those samples hold: with all of them, it is not run again. `paired`: each method runs side by side
    with a full-cache call, taking turns (see the module's docstring); methods that are not HF `generate` (the
    compressed-only baselines) cannot."""
    if not methods or methods[0].family != "full":
        raise ValueError(
            "methods must start with the full-cache method (Method('full')): it is the reference."
        )
    if repeats < 1 or max_new_tokens < 1:
        raise ValueError(f"repeats and max_new_tokens must be positive, got {repeats} and {max_new_tokens}.")
    if paired and (lossy := [m.name for m in methods if m.family == "lossy"]):
        raise ValueError(
            f"Paired runs take turns through generate's streamer, which {lossy} lack: leave them out."
        )
    eos = set(eos_token_ids) if eos_token_ids is not None else _eos_ids(model)
    kept = _measured_batches(measured, methods)
    runs = sum(
        (repeats - _repeats_done(kept.get((w.name, index), [])))
        * (sum(m.supports(w.batch_size) for m in methods) - (1 if paired else 0))
        for w in workloads
        for index in range(len(w.batches))
    )
    bar = tqdm(
        total=runs,
        desc="bench",
        disable=not progress,
        bar_format="{desc:<60}{bar:20}| {n}/{total} [{elapsed}<{remaining}{postfix}]",
    )
    samples: list[Sample] = []
    for workload in workloads:
        start = len(samples)
        for index, batch in enumerate(workload.batches):
            group = kept.get((workload.name, index)) or [
                Sample(m, workload.name, index, batch.batch_size) for m in methods
            ]
            for sample in group:
                if not sample.method.supports(batch.batch_size):
                    sample.skipped = f"batch-1 only (batch {batch.batch_size})"
            for repeat in range(_repeats_done(group), repeats):
                order = group[1:] if paired else group
                shift = repeat % len(order)
                for sample in order[shift:] + order[:shift]:
                    if sample.skipped:
                        continue
                    bar.set_description(f"{workload.name} #{index} r{repeat + 1}: {sample.method.name}")
                    if paired:
                        _run_paired(model, group[0], sample, batch, max_new_tokens, eos, repeat)
                    else:
                        _run_once(model, sample.method, batch, sample, max_new_tokens, eos, first=repeat == 0)
                    bar.update()
                    rss = resident_bytes()
                    if rss is not None:
                        bar.set_postfix_str(f"RSS {rss / 2**30:.1f} GB", refresh=False)
                if on_repeat is not None:
                    on_repeat(workload, group)
            samples.extend(group)
        if on_workload is not None:
            on_workload(workload, samples[start:])
    bar.close()
    return samples


def _repeats_done(group: list[Sample]) -> int:
    """How many repeats every method of a batch has (0 for a batch not measured yet)."""
    return min((len(s.seconds) for s in group if not s.skipped), default=0)


def _measured_batches(
    measured: Iterable[Sample], methods: list[Method]
) -> dict[tuple[str, int], list[Sample]]:
    """The batches of `measured` that have a sample of every method, each in the order of `methods`."""
    by_batch: dict[tuple[str, int], dict[Method, Sample]] = {}
    for sample in measured:
        by_batch.setdefault((sample.workload, sample.batch_index), {})[sample.method] = sample
    return {
        key: [group[m] for m in methods]
        for key, group in by_batch.items()
        if all(m in group for m in methods)
    }


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
