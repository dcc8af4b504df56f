"""One quantized draft tier for every quantization backend: committed groups quantized, a full-precision residual.

A backend supplies only a `Codec` (quantize a (B, H, n, D) block of keys or values, dequantize it back). The store
does the rest, the same way for all backends: committed tokens wait in a full-precision residual (which also holds
this round's drafted tokens) and are quantized a group at a time once more than `residual_length` are waiting.
Drafted tokens are never quantized, so a rollback is exact.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..cache.draft_tier import DraftStore, TokenStore
from ..checks import check_int, check_ratio
from .base import CompressionContext, Compressor


class Codec(ABC):
    """Quantize a (B, H, n, D) block of committed keys or values; the returned object is opaque to the store."""

    @abstractmethod
    def quantize(self, x: torch.Tensor, kind: str) -> Any:
        """`kind` is "key" or "value" (backends may quantize them along different axes)."""

    @abstractmethod
    def dequantize(self, block: Any, like: torch.Tensor) -> torch.Tensor:
        """The (B, H, n, D) tensor back, in `like`'s dtype and device."""

    @abstractmethod
    def nbytes(self, block: Any) -> int:
        """Bytes the quantized block holds (codes plus scales)."""


def require(module: str, extra: str, package: str) -> Any:
    """Import an optional backend, or say which extra installs it."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise ImportError(
            f"This quantization backend needs the package {package}: install it with "
            f'`pip install "vericache-hf[{extra}]"`.'
        )
    return importlib.import_module(module)


def bits_for_ratio(name: str, compression_ratio: float, supported: tuple[int, ...]) -> int:
    """Map a kvpress-style ratio to a bit width relative to 16-bit storage (0.75 -> 4, 0.875 -> 2)."""
    check_ratio(f"{name}.compression_ratio", compression_ratio)
    bits = 16 * (1 - compression_ratio)
    for candidate in supported:
        if abs(bits - candidate) < 1e-6:
            return candidate
    ratios = ", ".join(f"{1 - b / 16:g} ({b}-bit)" for b in supported)
    raise ValueError(
        f"{name} cannot meet compression_ratio={compression_ratio}: it would need {bits:g}-bit storage. "
        f"Use one of {ratios}, or pass bits= explicitly."
    )


class QuantizedStore(DraftStore):
    """Quantized groups of committed tokens followed by a full-precision `TokenStore` residual."""

    def __init__(self, codec: Codec, group_size: int, residual_length: int, keys, values, valid) -> None:
        self.codec, self.group, self.residual_length = codec, group_size, residual_length
        self.residual = TokenStore(keys[:, :, :0], values[:, :, :0], valid[:, :0])
        self.blocks: list[tuple[Any, Any]] = []
        self.quantized_valid = valid[:, :0]
        self.like = keys[:, :, :0]
        self.dequantized: tuple[torch.Tensor, torch.Tensor] | None = None
        self.commit(keys, values, valid)

    @property
    def num_drafted(self) -> int:
        return self.residual.num_drafted

    @property
    def num_committed(self) -> int:
        return self.quantized_valid.shape[-1] + self.residual.length

    @property
    def valid(self) -> torch.Tensor:
        return torch.cat([self.quantized_valid, self.residual.valid], dim=-1)

    def _old(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantized tokens, dequantized once per change of the quantized part (not once per draft step)."""
        if self.dequantized is None:
            keys = [self.codec.dequantize(k, self.like) for k, _ in self.blocks]
            values = [self.codec.dequantize(v, self.like) for _, v in self.blocks]
            self.dequantized = torch.cat(keys, dim=-2), torch.cat(values, dim=-2)
        return self.dequantized

    def extend_draft(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        recent_keys, recent_values = self.residual.extend_draft(keys, values)
        if not self.blocks:
            return recent_keys, recent_values
        old_keys, old_values = self._old()
        return torch.cat([old_keys, recent_keys], dim=-2), torch.cat([old_values, recent_values], dim=-2)

    def rollback_draft(self) -> None:
        self.residual.rollback_draft()

    def commit(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        self.residual.commit(keys, values, valid)
        ready = (self.residual.length - self.residual_length) // self.group * self.group
        if ready <= 0:
            return
        old_keys = self.residual.keys[:, :, :ready]
        old_values = self.residual.values[:, :, :ready]
        for start in range(0, ready, self.group):
            part = slice(start, start + self.group)
            self.blocks.append(
                (
                    self.codec.quantize(old_keys[:, :, part], "key"),
                    self.codec.quantize(old_values[:, :, part], "value"),
                )
            )
        self.quantized_valid = torch.cat([self.quantized_valid, self.residual.valid[:, :ready]], dim=-1)
        self.residual.drop_slots(0, ready)
        self.dequantized = None

    def nbytes(self) -> int:
        quantized = sum(self.codec.nbytes(k) + self.codec.nbytes(v) for k, v in self.blocks)
        return quantized + self.residual.nbytes()


@dataclass
class QuantizedCompressor(Compressor):
    """Base of the quantization backends: a bit width (from `bits` or the ratio), grouping and residual.

    Parameters:
        compression_ratio: mapped to bits relative to 16-bit storage (0.5 -> 8, 0.75 -> 4, 0.875 -> 2).
        bits: explicit bit width; overrides the ratio.
        group_size: tokens quantized together (committed tokens are quantized a group at a time).
        residual_length: most recent committed tokens kept at full precision.
    """

    compression_ratio: float = 0.75
    bits: int | None = None
    group_size: int = 32
    residual_length: int = 32

    supported_bits: ClassVar[tuple[int, ...]] = (2, 4, 8)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.bits is None:
            self.bits = bits_for_ratio(name, self.compression_ratio, self.supported_bits)
        elif self.bits not in self.supported_bits:
            raise ValueError(f"{name}.bits must be one of {self.supported_bits}, got {self.bits!r}.")
        else:
            self.compression_ratio = 1 - self.bits / 16
        check_int(f"{name}.group_size", self.group_size, 1)
        check_int(f"{name}.residual_length", self.residual_length, 0)

    def codec(self, head_dim: int) -> Codec:
        raise NotImplementedError

    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> DraftStore:
        codec = self.codec(keys.shape[-1])
        return QuantizedStore(
            codec, self.group_size, self.residual_length, keys, values, context.valid.to(keys.device)
        )
