"""The draft tier's linear layers in whichever layout of the product runs fastest, measured (`draft_matmul`).

A draft step multiplies a few rows (one per sequence, or a proposal's few tokens) by every weight of the model.
PyTorch's CPU `linear` computes `x @ W.T`, and for a handful of rows its BLAS can take a slow path: on the 2-core
machine here SmolLM2's float32 linears take 46 ms for one row and 68-95 ms for 2-4 rows, while the same product
as `(W @ x.T).T` takes 19-27 ms for 2-4 rows, and 21 ms for one row padded to two (padding more rows never
paid). Which layout wins depends on the BLAS, the float type (bfloat16 keeps `linear`), the shape and the row
count, so each is timed, not assumed, on the draft passes' own products (`LayoutTable`).

Only draft-tier passes use it; the verify pass and plain steps run the model's own `linear`, so the emitted tokens
never depend on the choice, only how many drafts agree can (by rounding).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

MOST_ROWS = 64  # beyond this many rows (a verify pass's), `linear`'s GEMM is efficient: left alone
PAIRS = 6  # paired timings (one weight, each layout once) per shape and row count before the choice
MARGIN = 0.95  # weight_first replaces `linear` only when its median time ratio is under this (timer noise)


LAYOUTS = ("linear", "weight_first")


def product(layout: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed in `layout`: `linear` itself, or `weight_first`, `(W @ x.T).T`, with a
    single row padded to two (alone it would make the product a matrix-vector one, the slow path again)."""
    if layout == "linear":
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:
        out = torch.mm(weight, torch.cat([rows, rows]).t())[:, :1].t().contiguous()
    else:
        out = torch.mm(weight, rows.t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def turn(member: int, count: int) -> str:
    """The layout of a weight's `count`-th timed product. Each weight alternates, so every pair of its products
    times both layouts on the same weight, and the order within a pair flips from pair to pair and from one member
    of a shape to the next (ABBA, BAAB): a pass that runs slow as a whole (the first after a prefill) weighs on both
    layouts alike."""
    return LAYOUTS[(member + count + count // 2) % 2]


@dataclass
class Trial:
    """The timings of one shape and row count so far: each member's products timed, its half-finished pair, and the
    time ratios (weight_first over linear) of its finished pairs."""

    counts: dict[int, int] = field(default_factory=dict)
    halves: dict[int, tuple[str, float]] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)

    def next_layout(self, member: int) -> str:
        return turn(member, self.counts.get(member, 0))

    def add(self, member: int, layout: str, seconds: float) -> None:
        self.counts[member] = self.counts.get(member, 0) + 1
        half = self.halves.pop(member, None)
        if half is None or half[0] == layout:  # a pair's first (or threads raced to one layout: start anew)
            self.halves[member] = layout, seconds
            return
        times = dict([half, (layout, seconds)])
        self.ratios.append(times["weight_first"] / max(times["linear"], 1e-9))


class LayoutTable:
    """The layout per weight shape and row count, for one drafting copy, shared by its threads.

    It is measured on the products the draft passes run anyway, so nothing is computed only to time it, and the
    times are a draft pass's own, with weights streaming from memory layer after layer (one weight timed alone
    would sit in cache). Each weight of a shape runs its products in the two layouts in turn (`turn`), and each
    pair gives a time ratio on that one weight; after `PAIRS` pairs of a shape and row count the layout is chosen
    from their median (`fastest`). Pairs rather than each layout's own times: comparing the query projection in
    one layout with the output projection in the other, as a table that simply took turns did, chose `linear` for
    SmolLM2's attention projections at 8k tokens in two calls of three, 2.2-2.6x slower there. The 60 projections
    of one shape decide early in the second pass; the single output head within `2 * PAIRS` passes."""

    def __init__(self) -> None:
        self.chosen: dict[tuple[tuple, int], str] = {}
        self._trials: dict[tuple[tuple, int], Trial] = {}
        self._lock = threading.Lock()

    def product(
        self, group: tuple, member: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ):
        """`F.linear(x, weight, bias)` for weight `member` of `group`, in its chosen layout or the next to time."""
        rows = x.numel() // x.shape[-1]
        if rows > MOST_ROWS:
            return F.linear(x, weight, bias)
        key = (group, rows)
        layout = self.chosen.get(key)
        if layout is not None:
            return product(layout, x, weight, bias)
        with self._lock:
            trial = self._trials.setdefault(key, Trial())
            layout = trial.next_layout(member)
        started = time.perf_counter()
        out = product(layout, x, weight, bias)
        elapsed = time.perf_counter() - started
        with self._lock:
            trial.add(member, layout, elapsed)
            if key not in self.chosen and len(trial.ratios) >= PAIRS:
                self.chosen[key] = fastest(trial.ratios)
                self._trials.pop(key, None)
        return out


def fastest(ratios: list[float]) -> str:
    """`weight_first` when its median time ratio to `linear` on the same weights is under `MARGIN`, else `linear`."""
    return "weight_first" if statistics.median(ratios) < MARGIN else "linear"


class MeasuredLinear(nn.Linear):
    """An `nn.Linear` of a drafting copy whose product runs in its table's measured layout."""

    layouts: LayoutTable
    group: tuple
    member: int  # its rank among the copy's linears of its group, in module order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layouts.product(self.group, self.member, x, self.weight, self.bias)


def measurable(model: nn.Module) -> bool:
    """Whether `model` has linear layers this can time: plain `nn.Linear`s with float weights, all on the CPU
    (an accelerator's BLAS has no such slow path, and timing it would need a synchronisation per product)."""
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    return bool(layers) and all(
        m.weight.device.type == "cpu" and m.weight.dtype.is_floating_point for m in layers
    )


def measure_layouts(copy: nn.Module) -> nn.Module:
    """Turn the plain `nn.Linear`s of `copy` (a copy of a model, never the model itself) into `MeasuredLinear`s
    sharing one `LayoutTable`; the weights stay the same tensors."""
    table, members = LayoutTable(), {}
    for module in copy.modules():
        if type(module) is nn.Linear:
            module.__class__ = MeasuredLinear
            module.layouts = table
            module.group = (*module.weight.shape, module.weight.dtype, module.bias is not None)
            module.member = members[module.group] = members.get(module.group, -1) + 1
    return copy
