"""One quantized draft tier for every quantization backend: committed groups quantized, a full-precision residual.

A backend supplies only a `Codec` (quantize a (B, H, n, D) block of keys or values, dequantize it back). The store
does the rest, the same way for all backends: committed tokens wait in a full-precision residual (which also holds
this round's drafted tokens) and are quantized a group at a time once more than `residual_length` are waiting.
Drafted tokens are never quantized, so a rollback is exact.

Attention here reads dequantized values (pure torch has no fused low-bit kernel), so a group is quantized once, when
it leaves the residual, and its slots are overwritten in place with the dequantized values: one preallocated
`TokenStore` holds [dequantized groups | residual | drafts], a draft step copies nothing, and no group is ever
dequantized twice. What the model reads is exactly what the quantized form decodes to; `nbytes` reports the
quantized form (codes and scales, plus the residual), which is what a fused low-bit kernel would read.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..cache.draft_tier import DraftStore, TokenStore, tensor_bytes
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
    """Dequantized groups of committed tokens, then a full-precision residual, then drafts, in one `TokenStore`."""

    def __init__(self, codec: Codec, group_size: int, residual_length: int, keys, values, valid) -> None:
        self.codec, self.group, self.residual_length = codec, group_size, residual_length
        self.tokens = TokenStore(keys, values, valid)
        self.quantized = 0  # slots [0, quantized) hold dequantized groups
        self.quantized_bytes = 0  # codes and scales of those groups
        self._quantize_ready()

    @property
    def num_drafted(self) -> int:
        return self.tokens.num_drafted

    @property
    def num_committed(self) -> int:
        return self.tokens.length

    @property
    def valid(self) -> torch.Tensor:
        return self.tokens.valid

    def extend_draft(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens.extend_draft(keys, values)

    def rollback_draft(self) -> None:
        self.tokens.rollback_draft()

    def commit(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        self.tokens.commit(keys, values, valid)
        self._quantize_ready()

    def _quantize_ready(self) -> None:
        """Quantize every whole group that has left the residual, and put its dequantized values in its slots."""
        store = self.tokens
        ready = (store.length - self.quantized - self.residual_length) // self.group * self.group
        if ready <= 0:
            return
        # every ready group in one codec call, one group per row (as `export` sends them): a prompt's groups cost
        # a few tensor ops per layer, not a few per group (KIVI at 2k tokens: 64 groups a layer)
        part = slice(self.quantized, self.quantized + ready)
        for kind, slots in (("key", store.keys), ("value", store.values)):
            block = self.codec.quantize(_grouped(slots[:, :, part], self.group), kind)
            self.quantized_bytes += self.codec.nbytes(block)
            slots[:, :, part] = self.codec.dequantize(block, slots).reshape(slots[:, :, part].shape)
        self.quantized += ready

    def export(self) -> dict[str, torch.Tensor]:
        """The committed slots and where the quantized groups end. When the codec's blocks are plain tensors
        (KIVI, fp8), the quantized groups go out as their codes, re-quantized from the slots (what makes a stored
        entry small), and only the full-precision residual as slots; otherwise every slot goes out dequantized."""
        state = self.tokens.export()
        rows = state["valid"].shape[0]
        counts = torch.tensor([[self.quantized, self.quantized_bytes]], dtype=torch.int64)
        state["quantized"] = counts.expand(rows, 2)
        if not self.quantized:
            return state
        for kind, name in (("key", "keys"), ("value", "values")):
            block = self.codec.quantize(_grouped(state[name][:, :, : self.quantized], self.group), kind)
            if not (isinstance(block, tuple) and all(isinstance(part, torch.Tensor) for part in block)):
                return state  # a library's own block type: keep the dequantized slots
            state |= {f"codes.{kind}.{i}": part for i, part in enumerate(block)}
            state[name] = state[name][:, :, self.quantized :].clone()
        return state

    @classmethod
    def restored(cls, codec: Codec, group_size: int, residual_length: int, state: dict[str, torch.Tensor]):
        """The store `export` described, without quantizing its groups again."""
        quantized, quantized_bytes = (int(n) for n in state["quantized"][0].tolist())
        keys, values = state["keys"], state["values"]
        if "codes.key.0" in state:  # the groups came as codes: dequantize them in front of the residual
            slots = []
            for kind, residual in (("key", keys), ("value", values)):
                block = tuple(state[f"codes.{kind}.{i}"] for i in range(_parts(state, kind)))
                grouped = codec.dequantize(block, residual)
                slots.append(
                    torch.cat([grouped.reshape(*residual.shape[:2], -1, residual.shape[-1]), residual], 2)
                )
            keys, values = slots
        store = cls(codec, group_size, residual_length + keys.shape[-2], keys, values, state["valid"])
        store.residual_length, store.quantized, store.quantized_bytes = (
            residual_length,
            quantized,
            quantized_bytes,
        )
        return store

    def nbytes(self) -> int:
        store = self.tokens
        residual = slice(self.quantized, store.length)
        return self.quantized_bytes + tensor_bytes(store.keys[:, :, residual], store.values[:, :, residual])


def _grouped(slots: torch.Tensor, group: int) -> torch.Tensor:
    """(B, H, n*group, D) slots as (B, H*n, group, D): one quantization group per row, as the codec saw them."""
    batch, heads, length, dim = slots.shape
    return slots.reshape(batch, heads * (length // group), group, dim)


def _parts(state: dict[str, torch.Tensor], kind: str) -> int:
    return sum(name.startswith(f"codes.{kind}.") for name in state)


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

    def restore(self, state: dict[str, torch.Tensor]) -> DraftStore:
        return QuantizedStore.restored(
            self.codec(state["keys"].shape[-1]), self.group_size, self.residual_length, state
        )
