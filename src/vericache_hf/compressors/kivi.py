"""KIVI-style quantized draft tier, in pure torch.

Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache". Keys are quantized per channel
over groups of `group_size` tokens, values per token; the most recent tokens stay at full precision. Drafted tokens
are never quantized: only committed tokens enter the quantized store (`quantized.QuantizedStore`), so a rollback is
exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.draft_tier import tensor_bytes
from .quantized import Codec, QuantizedCompressor, QuantizedStore, bits_for_ratio

SUPPORTED_BITS = (2, 4, 8)

__all__ = ["SUPPORTED_BITS", "KIVICodec", "KIVICompressor", "QuantizedStore", "bits_for_ratio"]


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


@dataclass
class KIVICodec(Codec):
    """Keys per channel over the block's tokens, values per token; codes packed 8/bits per byte."""

    bits: int

    def quantize(self, x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        codes, scale, low = quantize(x, self.bits, dim=-2 if kind == "key" else -1)
        return pack(codes, self.bits), scale, low

    def dequantize(self, block, like: torch.Tensor) -> torch.Tensor:
        codes, scale, low = block
        return unpack(codes, self.bits).to(like.dtype) * scale + low

    def nbytes(self, block) -> int:
        return tensor_bytes(*block)


@dataclass
class KIVICompressor(QuantizedCompressor):
    """Asymmetric low-bit quantization: keys per channel, values per token, recent tokens in full precision.

    Parameters:
        compression_ratio: mapped to bits relative to 16-bit storage (0.5 -> 8, 0.75 -> 4, 0.875 -> 2).
        bits: explicit bit width (2, 4 or 8); overrides the ratio.
        group_size: tokens per key-quantization group (committed tokens are quantized a group at a time).
        residual_length: most recent committed tokens kept at full precision.
    """

    def codec(self, head_dim: int) -> Codec:
        if head_dim % (8 // self.bits):
            raise ValueError(
                f"KIVI packs {8 // self.bits} codes per byte; head_dim {head_dim} does not divide."
            )
        return KIVICodec(self.bits)
