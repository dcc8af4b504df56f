"""HQQ draft tier: committed tokens quantized with Half-Quadratic Quantization (the `hqq` package).

Badri & Shaji, 2023, "Half-Quadratic Quantization of Large Machine Learning Models". Calibration-free; 1 to 8 bits.
Install with `pip install "vericache-hf[hqq]"` (on a CPU machine, `DISABLE_CUDA=1`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache.draft_tier import tensor_bytes
from .quantized import Codec, QuantizedCompressor, require


@dataclass
class HQQCodec(Codec):
    """Groups of `head_dim` values along the channel axis, as transformers' HQQ cache layer does."""

    bits: int
    group: int

    def __post_init__(self) -> None:
        self.quantizer = require("hqq.core.quantize", "hqq", "hqq").Quantizer

    def quantize(self, x: torch.Tensor, kind: str):
        rows = x.float().reshape(-1, self.group)  # one group of head_dim values per token and head
        if self.bits == 3:  # hqq packs 3-bit codes ten to an int32, down the rows
            rows = torch.cat([rows, rows.new_zeros((-len(rows) % 10, self.group))])
        codes, meta = self.quantizer.quantize(
            rows,
            axis=1,
            device=str(x.device),
            compute_dtype=torch.float32,
            nbits=self.bits,
            group_size=self.group,
        )
        return codes, meta, x.shape

    def dequantize(self, block, like: torch.Tensor) -> torch.Tensor:
        codes, meta, shape = block
        flat = self.quantizer.dequantize(codes, meta).reshape(-1)[: shape.numel()]
        return flat.reshape(shape).to(like.dtype)

    def nbytes(self, block) -> int:
        codes, meta, _ = block
        return tensor_bytes(codes, meta["scale"], meta["zero"])


@dataclass
class HQQCompressor(QuantizedCompressor):
    """HQQ quantization of committed tokens: 1, 2, 3, 4 or 8 bits (ratio 0.5 -> 8, 0.75 -> 4, 0.875 -> 2)."""

    supported_bits: ClassVar[tuple[int, ...]] = (1, 2, 3, 4, 8)

    def codec(self, head_dim: int) -> Codec:
        return HQQCodec(self.bits, head_dim)
