"""Admission by device memory: what one request holds on the device, and the budget that admits requests by it.

A VeriCache request keeps its draft tier on the device and its full tier in host memory; only `staging_buffers`
pieces of the full tier visit the device at once (none where layers read it in place, on the CPU), each a chunk of
`staging_chunk_tokens` at most, or a whole layer when chunks are off. So a budget
that would hold a few requests with the full KV on the device holds many more VeriCache requests, which is where
serving throughput comes from. The counts here are physical: a quantizing compressor's draft tier is held
dequantized, so it counts at full size (only token dropping shrinks what the device holds).
"""

from __future__ import annotations

import math
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from ..cache.staging import buffer_tokens
from ..cache.window import held_slots
from ..compressors import build_compressor
from ..config import VeriCacheConfig
from ..layer_plan import RECURRENT_KINDS, layer_plan, window_layers
from .layer_bytes import layer_bytes

__all__ = ["Footprint", "MemoryBudget", "footprint", "parse_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | str) -> int:
    """Bytes from an int or a string such as "40GiB", "512 MiB" or "1.5GB"."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"a memory budget must be a positive number of bytes or a string such as '40GiB' or '512MB', "
            f"got {value!r}"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Footprint:
    """A request's device bytes under VeriCache (draft tier, staging buffers, recurrent states, window layers' one
    tier) and with stock's cache on the device (`full_kv_bytes`), each also by layer kind (`config.layer_types`
    values; staging apart)."""

    device_bytes: int
    full_kv_bytes: int
    draft_bytes: int = 0
    staging_bytes: int = 0
    recurrent_bytes: int = 0
    window_bytes: int = 0
    device_by_kind: dict[str, int] = field(default_factory=dict, compare=False)
    full_kv_by_kind: dict[str, int] = field(default_factory=dict, compare=False)


def _kept_tokens(compressor, tokens: int) -> int:
    """Prompt tokens the draft tier physically keeps: token-dropping stages shrink it, quantizers do not."""
    for stage in getattr(compressor, "stages", [compressor]):
        if hasattr(stage, "kept_tokens"):
            tokens = stage.kept_tokens(tokens)
    return tokens


def staging_tokens(config: VeriCacheConfig, tokens: int) -> int:
    """Tokens one staging buffer holds for a layer of `tokens` (its full tier and a verify pass's block): a
    quarter more than the layer, as the buffers grow (`cache/staging.py`), up to a chunk's fixed size
    (`staging_chunk_tokens`; without one, whole layers however long)."""
    chunk = config.staging_chunk_tokens
    return buffer_tokens(tokens) if chunk is None else min(chunk, buffer_tokens(tokens))


def footprint(
    model, config: VeriCacheConfig, prompt_tokens: int, max_new_tokens: int, on_device: bool | None = None
) -> Footprint:
    """What one request of `prompt_tokens` that may generate `max_new_tokens` holds at most, layer by layer
    (`layer_bytes.py`). `on_device`: whether the full tier is staged to the device (default: the model is not on
    the CPU, or `stage_on_cpu`).

    Stock holds every token in a full-attention layer, at most its window in a sliding or chunked one, a
    recurrent layer's state, and nothing for a layer without attention. VeriCache holds the draft tier of every
    two-tier attention layer, the staging buffers (for the widest of those layers), the window of each window layer
    (`cache/window.py`: sliding or chunked layers of a model with full-attention layers too, with a trim's slack),
    and each recurrent layer's state with the copies its roll-back keeps during a round."""
    if on_device is None:
        on_device = model.device.type != "cpu" or config.stage_on_cpu
    compressor = build_compressor(
        config.compressor, config.compression_ratio, config.compression_budget, **config.compressor_kwargs
    )
    grown = max_new_tokens + config.max_draft_length  # committed tokens, and one round's drafts
    drafted, total = _kept_tokens(compressor, prompt_tokens) + grown, prompt_tokens + max_new_tokens
    block = config.max_draft_length + 1  # a verify pass's tokens
    device, full = defaultdict(int), defaultdict(int)
    widest = 0  # the largest token of any staged layer: a staging buffer holds one layer's chunk at a time
    windows, window = window_layers(layer_plan(model, strict=False)), 0
    for layer in layer_bytes(model):
        if layer.token:
            stock_tokens = total if layer.window is None else min(total, layer.window)
            full[layer.kind] += layer.token * stock_tokens
            if layer.index in windows:
                held = layer.token * held_slots(stock_tokens, block)
                device[layer.kind] += held
                window += held
                continue
            device[layer.kind] += layer.token * drafted
            widest = max(widest, layer.token)
        elif layer.kind in RECURRENT_KINDS:
            # the live state, the copy taken before drafting, and a verify pass's recording: the recurrent state
            # after each of its tokens, and the convolution's whole input
            device[layer.kind] += 2 * layer.state + block * (layer.recurrent + layer.conv_column)
            full[layer.kind] += layer.state
    staging = (
        config.staging_buffers * widest * staging_tokens(config, prompt_tokens + grown + 1)
        if on_device
        else 0
    )
    recurrent = sum(device[kind] for kind in RECURRENT_KINDS)
    draft = sum(device.values()) - recurrent - window
    return Footprint(
        draft + staging + recurrent + window,
        sum(full.values()),
        draft,
        staging,
        recurrent,
        window,
        dict(device),
        dict(full),
    )


@dataclass
class MemoryBudget:
    """Device bytes shared by running requests: `admit` waits until a request fits (one always runs alone)."""

    total: int
    in_use: int = 0
    running: int = 0
    peak_in_use: int = 0
    peak_running: int = 0
    admitted: int = 0
    admitted_device_bytes: int = 0  # sums over admitted requests, for their mean size
    admitted_full_kv_bytes: int = 0
    _changed: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def check(self, need: Footprint) -> None:
        if need.device_bytes > self.total:
            raise ValueError(
                f"this request needs {need.device_bytes / 2**20:.1f} MiB of device memory (draft tier and staging "
                f"buffers) but the engine's device_memory_budget is {self.total / 2**20:.1f} MiB: raise the budget, "
                "or lower max_new_tokens or the compressor's kept share."
            )

    def admit(self, need: Footprint, cancelled: threading.Event) -> bool:
        """Wait until `need` fits beside the running requests; False if `cancelled` first."""
        with self._changed:
            while self.running and self.in_use + need.device_bytes > self.total:
                if cancelled.is_set():
                    return False
                self._changed.wait(0.05)
            self.in_use += need.device_bytes
            self.running += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            self.peak_running = max(self.peak_running, self.running)
            self.admitted += 1
            self.admitted_device_bytes += need.device_bytes
            self.admitted_full_kv_bytes += need.full_kv_bytes
            return True

    def release(self, need: Footprint) -> None:
        with self._changed:
            self.in_use -= need.device_bytes
            self.running -= 1
            self._changed.notify_all()

    def stats(self) -> dict[str, float]:
        """The budget, its peaks, and how many requests of the admitted ones' mean size it holds under VeriCache
        and would hold with each request's full KV on the device."""
        with self._changed:
            count = max(self.admitted, 1)
            device = max(self.admitted_device_bytes, 1) / count
            full = max(self.admitted_full_kv_bytes, 1) / count
            return {
                "budget_bytes": self.total,
                "peak_in_use_bytes": self.peak_in_use,
                "peak_running": self.peak_running,
                "vericache_capacity": math.floor(self.total / device),
                "full_kv_capacity": math.floor(self.total / full),
            }
