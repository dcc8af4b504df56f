"""optimum-quanto draft tier: committed tokens quantized to 2 or 4 bit integers with `optimum.quanto`.

The backend of transformers' `QuantizedCache(backend="quanto")`, used here only at commit points so rollback is
exact. Install with `pip install "vericache-hf[quanto]"`; quanto compiles a C++ extension on first use (about 35 s,
needs g++).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache.draft_tier import tensor_bytes
from .quantized import Codec, QuantizedCompressor, require


@dataclass
class QuantoCodec(Codec):
    """Affine integer quantization with one scale and zero point per token and head (a group of `head_dim`)."""

    bits: int

    def __post_init__(self) -> None:
        self.quanto = require("optimum.quanto", "quanto", "optimum-quanto")
        self.qtype = self.quanto.qint2 if self.bits == 2 else self.quanto.qint4

    def quantize(self, x: torch.Tensor, kind: str):
        rows = x.float().reshape(-1, x.shape[-1])  # (B*H*n, D): one group per token and head
        scale, shift = self.quanto.MaxOptimizer()(rows, self.qtype, 0, x.shape[-1])
        return self.quanto.quantize_weight(rows, self.qtype, 0, scale, shift, x.shape[-1]), x.shape

    def dequantize(self, block, like: torch.Tensor) -> torch.Tensor:
        qtensor, shape = block
        return qtensor.dequantize().reshape(shape).to(like.dtype)

    def nbytes(self, block) -> int:
        qtensor, _ = block
        return tensor_bytes(qtensor._data._data, qtensor._scale, qtensor._shift)


@dataclass
class QuantoCompressor(QuantizedCompressor):
    """optimum-quanto integer quantization of committed tokens: 2 or 4 bits (ratio 0.75 -> 4, 0.875 -> 2)."""

    supported_bits: ClassVar[tuple[int, ...]] = (2, 4)

    def codec(self, head_dim: int) -> Codec:
        return QuantoCodec(self.bits)
