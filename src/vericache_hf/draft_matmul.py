"""The draft tier's linear layers in whichever layout of the product runs fastest, measured (`draft_matmul`).

A draft step multiplies a few rows (one per sequence, or a proposal's few tokens) by every weight of the model.
PyTorch's CPU `linear` computes `x @ W.T`, and for a handful of rows its BLAS can take a slow path: on the 2-core
machine here SmolLM2's float32 linears take 46 ms for one row and 68-95 ms for 2-4 rows, while the same product
as `(W @ x.T).T` takes 19-27 ms for 2-4 rows, and 18 ms for one row padded to two. Which layout wins depends on the
BLAS, the float type (bfloat16 keeps `linear`), the shape and the row count, so each is timed, not assumed: the
first product of a shape and row count times every weight of that shape in each layout and keeps the fastest.

Only draft-tier passes use it; the verify pass and plain steps run the model's own `linear`, so the emitted tokens
never depend on the choice, only how many drafts agree can (by rounding).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

MOST_ROWS = 16  # beyond this many rows, `linear`'s GEMM is already efficient (within 5-15% here): left alone
MARGIN = 0.95  # another layout replaces `linear` only when it is at least 5% faster (timer noise)


def _linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(rows, weight)


def _weight_first(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, rows.t()).t()


def _weight_first_padded(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One extra row: a single row would make the product a matrix-vector one, the slow path again."""
    return torch.mm(weight, torch.cat([rows, rows[:1]]).t())[:, : rows.shape[0]].t()


LAYOUTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "linear": _linear,
    "weight_first": _weight_first,
    "weight_first_padded": _weight_first_padded,
}


def product(layout: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed in `layout`."""
    if layout == "linear":
        return F.linear(x, weight, bias)
    out = LAYOUTS[layout](x.reshape(-1, x.shape[-1]), weight).contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class LayoutTable:
    """The measured layout per weight shape and row count, for one drafting copy, shared by its threads."""

    def __init__(self) -> None:
        self.weights: dict[tuple, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.chosen: dict[tuple[tuple, int], str] = {}
        self._lock = threading.Lock()

    def add(self, layer: nn.Linear) -> tuple:
        """Register `layer`'s weights under its shape group; returns the group."""
        group = (*layer.weight.shape, layer.weight.dtype, layer.bias is not None)
        self.weights.setdefault(group, []).append((layer.weight, layer.bias))
        return group

    def layout(self, group: tuple, x: torch.Tensor) -> str:
        rows = x.numel() // x.shape[-1]
        if rows > MOST_ROWS:
            return "linear"
        key = (group, rows)
        chosen = self.chosen.get(key)
        if chosen is None:
            with self._lock:
                chosen = self.chosen.get(key) or self._measure(group, x.detach().reshape(rows, -1))
                self.chosen[key] = chosen
        return chosen

    def _measure(self, group: tuple, rows: torch.Tensor) -> str:
        """Time every weight of `group` in each layout, twice in opposite orders, and keep the best of each: the
        group's weights together stream from memory as a draft step reads them, where one alone would sit in cache."""
        best = dict.fromkeys(LAYOUTS, math.inf)
        with torch.no_grad():
            for order in (list(LAYOUTS), list(LAYOUTS)[::-1]):
                for layout in order:
                    started = time.perf_counter()
                    for weight, bias in self.weights[group]:
                        product(layout, rows, weight, bias)
                    best[layout] = min(best[layout], time.perf_counter() - started)
        fastest = min(best, key=best.get)
        return fastest if best[fastest] < MARGIN * best["linear"] else "linear"


class MeasuredLinear(nn.Linear):
    """An `nn.Linear` of a drafting copy whose product runs in its table's measured layout."""

    layouts: LayoutTable
    group: tuple

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(self.layouts.layout(self.group, x), x, self.weight, self.bias)


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
            module.group = table.add(module)
    return copy
