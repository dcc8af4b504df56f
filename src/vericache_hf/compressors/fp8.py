"""fp8 draft tier: committed tokens stored as float8 (e4m3) with one scale per token and head, in pure torch.

Micikevicius et al., 2022, "FP8 Formats for Deep Learning". Unlike transformers' fp8 cache layer, which freezes a
per-tensor scale and cannot be cropped, quantization here happens only at commit points, so rollback is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache.draft_tier import tensor_bytes
from .quantized import Codec, QuantizedCompressor

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class FP8Codec(Codec):
    """Per-token absmax scale, then a cast to float8_e4m3fn."""

    def quantize(self, x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12).float()
        return (x.float() / scale).to(torch.float8_e4m3fn), scale

    def dequantize(self, block, like: torch.Tensor) -> torch.Tensor:
        codes, scale = block
        return (codes.float() * scale).to(like.dtype)

    def nbytes(self, block) -> int:
        return tensor_bytes(*block)


@dataclass
class FP8Compressor(QuantizedCompressor):
    """8-bit floating point (e4m3) with a per-token scale; compression_ratio must be 0.5 (8 of 16 bits)."""

    compression_ratio: float = 0.5
    supported_bits: ClassVar[tuple[int, ...]] = (8,)

    def codec(self, head_dim: int) -> Codec:
        return FP8Codec()
