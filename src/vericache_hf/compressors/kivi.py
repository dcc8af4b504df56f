"""KIVI-style quantized draft tier, in pure torch.

Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache". Keys are quantized per channel
over groups of `group_size` tokens, values per token; the most recent tokens stay at full precision. Drafted tokens
are never quantized: only committed tokens enter the quantized store, so a rollback is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.draft_tier import DraftStore, TokenStore, tensor_bytes
from .base import CompressionContext, Compressor, check_ratio

SUPPORTED_BITS = (2, 4, 8)


def bits_for_ratio(name: str, compression_ratio: float, supported: tuple[int, ...]) -> int:
    """Map a kvpress-style ratio to a bit width relative to 16-bit storage (0.75 -> 4, 0.875 -> 2)."""
    check_ratio(name, compression_ratio)
    bits = 16 * (1 - compression_ratio)
    for candidate in supported:
        if abs(bits - candidate) < 1e-6:
            return candidate
    ratios = ", ".join(f"{1 - b / 16:g} ({b}-bit)" for b in supported)
    raise ValueError(
        f"{name} cannot meet compression_ratio={compression_ratio}: it would need {bits:g}-bit storage. "
        f"Use one of {ratios}, or pass bits= explicitly."
    )


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization along `dim`; returns uint8 codes, scale and minimum."""
    low = x.amin(dim=dim, keepdim=True)
    high = x.amax(dim=dim, keepdim=True)
    scale = ((high - low) / (2**bits - 1)).clamp(min=1e-8)
    codes = ((x - low) / scale).round_().clamp_(0, 2**bits - 1).to(torch.uint8)
    return codes, scale, low


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack 8/bits codes per byte along the last dim (which must divide evenly)."""
    per_byte = 8 // bits
    grouped = codes.view(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    return (grouped << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    codes = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return codes.view(*packed.shape[:-1], -1)


class QuantizedStore(DraftStore):
    """Quantized groups of committed tokens followed by a full-precision `TokenStore` residual (which also holds
    this round's drafts)."""

    def __init__(self, compressor: KIVICompressor, keys, values, valid) -> None:
        self.bits, self.group, self.residual_length = compressor.bits, compressor.group_size, compressor.residual_length
        empty = keys[:, :, :0]
        self.residual = TokenStore(empty, values[:, :, :0], valid[:, :0])
        self.key_parts: list[tuple[torch.Tensor, ...]] = []
        self.value_parts: list[tuple[torch.Tensor, ...]] = []
        self.quantized_valid = valid[:, :0]
        self.dtype = keys.dtype
        self.commit(keys, values, valid)

    @property
    def num_drafted(self) -> int:
        return self.residual.num_drafted

    @property
    def num_quantized(self) -> int:
        return self.quantized_valid.shape[-1]

    @property
    def num_committed(self) -> int:
        return self.num_quantized + self.residual.length

    @property
    def valid(self) -> torch.Tensor:
        return torch.cat([self.quantized_valid, self.residual.valid], dim=-1)

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [(unpack(c, self.bits).to(self.dtype) * s + m) for c, s, m in self.key_parts]
        values = [(unpack(c, self.bits).to(self.dtype) * s + m) for c, s, m in self.value_parts]
        return torch.cat(keys, dim=-2), torch.cat(values, dim=-2)

    def extend_draft(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        recent_keys, recent_values = self.residual.extend_draft(keys, values)
        if not self.key_parts:
            return recent_keys, recent_values
        old_keys, old_values = self._dequantized()
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
        batch, heads, _, dim = old_keys.shape
        grouped = old_keys.reshape(batch, heads, ready // self.group, self.group, dim)
        codes, scale, low = quantize(grouped, self.bits, dim=-2)  # keys: per channel over a token group
        self.key_parts.append(
            (pack(codes, self.bits).reshape(batch, heads, ready, -1), *self._per_token(scale, low, self.group))
        )
        codes, scale, low = quantize(old_values, self.bits, dim=-1)  # values: per token
        self.value_parts.append((pack(codes, self.bits), scale, low))
        self.quantized_valid = torch.cat([self.quantized_valid, self.residual.valid[:, :ready]], dim=-1)
        self.residual.drop_slots(0, ready)

    @staticmethod
    def _per_token(scale: torch.Tensor, low: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Spread per-group key statistics over the group's tokens, so dequantization is one broadcast."""
        def spread(t: torch.Tensor) -> torch.Tensor:
            return t.expand(-1, -1, -1, group, -1).reshape(t.shape[0], t.shape[1], -1, t.shape[-1])

        return spread(scale), spread(low)

    def nbytes(self) -> int:
        key_bytes = sum(tensor_bytes(codes) + tensor_bytes(scale[:, :, :: self.group], low[:, :, :: self.group])
                        for codes, scale, low in self.key_parts)
        value_bytes = sum(tensor_bytes(*part) for part in self.value_parts)
        return key_bytes + value_bytes + self.residual.nbytes()


@dataclass
class KIVICompressor(Compressor):
    """Asymmetric low-bit quantization: keys per channel, values per token, recent tokens in full precision.

    Parameters:
        compression_ratio: mapped to bits relative to 16-bit storage (0.5 -> 8, 0.75 -> 4, 0.875 -> 2).
        bits: explicit bit width (2, 4 or 8); overrides the ratio.
        group_size: tokens per key-quantization group (committed tokens are quantized a group at a time).
        residual_length: most recent committed tokens kept at full precision.
    """

    compression_ratio: float = 0.75
    bits: int | None = None
    group_size: int = 32
    residual_length: int = 32

    def __post_init__(self) -> None:
        if self.bits is None:
            self.bits = bits_for_ratio(type(self).__name__, self.compression_ratio, SUPPORTED_BITS)
        elif self.bits not in SUPPORTED_BITS:
            raise ValueError(f"KIVICompressor.bits must be one of {SUPPORTED_BITS}, got {self.bits!r}.")
        else:
            self.compression_ratio = 1 - self.bits / 16
        for name in ("group_size", "residual_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "group_size" else 0):
                raise ValueError(f"KIVICompressor.{name} must be a {'positive' if name == 'group_size' else 'non-negative'} integer, got {value!r}.")

    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> DraftStore:
        if keys.shape[-1] % (8 // self.bits):
            raise ValueError(f"KIVI packs {8 // self.bits} codes per byte; head_dim {keys.shape[-1]} does not divide.")
        return QuantizedStore(self, keys, values, context.valid.to(keys.device))
