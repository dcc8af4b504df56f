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

import torch
import torch.nn.functional as F
from torch import nn

MOST_ROWS = 64  # beyond this many rows (a verify pass's), `linear`'s GEMM is efficient: left alone
SAMPLES = 3  # timed products per layout before the fastest (by median) is kept
MARGIN = 0.95  # another layout replaces `linear` only when it is at least 5% faster (timer noise)


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


class LayoutTable:
    """The layout per weight shape and row count, for one drafting copy, shared by its threads.

    It is measured on the products the draft passes run anyway: until each layout has `SAMPLES` timed products of a
    shape and row count, the next product runs in the least-timed one, and then the fastest by median is kept. So
    nothing is computed only to time it, and the times are a draft pass's own, with weights streaming from memory
    layer after layer (one weight timed alone would sit in cache). The layers of one shape share their samples: 30
    layers decide within a pass, the single output head within `2 * SAMPLES` passes."""

    def __init__(self) -> None:
        self.chosen: dict[tuple[tuple, int], str] = {}
        self._times: dict[tuple[tuple, int], dict[str, list[float]]] = {}
        self._lock = threading.Lock()

    def product(self, group: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """`F.linear(x, weight, bias)` for a weight of `group`, in its chosen layout or the next to time."""
        rows = x.numel() // x.shape[-1]
        if rows > MOST_ROWS:
            return F.linear(x, weight, bias)
        key = (group, rows)
        layout = self.chosen.get(key)
        if layout is not None:
            return product(layout, x, weight, bias)
        with self._lock:
            times = self._times.setdefault(key, {name: [] for name in LAYOUTS})
            layout = min(times, key=lambda name: len(times[name]))
        started = time.perf_counter()
        out = product(layout, x, weight, bias)
        elapsed = time.perf_counter() - started
        with self._lock:
            times[layout].append(elapsed)
            if key not in self.chosen and all(len(seconds) >= SAMPLES for seconds in times.values()):
                self.chosen[key] = fastest(times)
                self._times.pop(key, None)
        return out


def fastest(times: dict[str, list[float]]) -> str:
    """The layout with the least median time, `linear` unless another is at least 5% faster."""
    medians = {layout: statistics.median(seconds) for layout, seconds in times.items()}
    best = min(medians, key=medians.get)
    return best if medians[best] < MARGIN * medians["linear"] else "linear"


class MeasuredLinear(nn.Linear):
    """An `nn.Linear` of a drafting copy whose product runs in its table's measured layout."""

    layouts: LayoutTable
    group: tuple

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layouts.product(self.group, x, self.weight, self.bias)


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
    table = LayoutTable()
    for module in copy.modules():
        if type(module) is nn.Linear:
            module.__class__ = MeasuredLinear
            module.layouts = table
            module.group = (*module.weight.shape, module.weight.dtype, module.bias is not None)
    return copy
