"""bitsandbytes draft tier: committed tokens in NF4, FP4 or 8-bit blockwise codes (`bitsandbytes.functional`).

Dettmers et al., 2023, "QLoRA" (NF4) and 2022, "8-bit Optimizers via Block-wise Quantization". These functions run
on CPU tensors too. Install with `pip install "vericache-hf[bnb]"`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache.draft_tier import tensor_bytes
from ..checks import check_ratio
from .quantized import Codec, QuantizedCompressor, require

QUANT_TYPES = {"nf4": 4, "fp4": 4, "int8": 8}


@dataclass
class BitsAndBytesCodec(Codec):
    """Blockwise absmax codes over the flattened block (`blocksize` values share a scale)."""

    quant_type: str
    blocksize: int = 64

    def __post_init__(self) -> None:
        self.functional = require("bitsandbytes.functional", "bnb", "bitsandbytes")

    def quantize(self, x: torch.Tensor, kind: str):
        flat = x.float().contiguous()
        if self.quant_type == "int8":
            return self.functional.quantize_blockwise(flat, blocksize=self.blocksize)
        return self.functional.quantize_4bit(flat, blocksize=self.blocksize, quant_type=self.quant_type)

    def dequantize(self, block, like: torch.Tensor) -> torch.Tensor:
        codes, state = block
        if self.quant_type == "int8":
            return self.functional.dequantize_blockwise(codes, state).to(like.dtype)
        return self.functional.dequantize_4bit(codes, state).to(like.dtype)

    def nbytes(self, block) -> int:
        codes, state = block
        return tensor_bytes(codes, state.absmax)


@dataclass
class BitsAndBytesCompressor(QuantizedCompressor):
    """bitsandbytes blockwise quantization of committed tokens.

    Parameters:
        quant_type: "nf4", "fp4" (4-bit) or "int8" (8-bit blockwise). When None, the ratio picks it:
            0.75 -> nf4, 0.5 -> int8.
        blocksize: values sharing one absmax scale.
    """

    quant_type: str | None = None
    blocksize: int = 64
    supported_bits: ClassVar[tuple[int, ...]] = (4, 8)

    def __post_init__(self) -> None:
        check_ratio(f"{type(self).__name__}.compression_ratio", self.compression_ratio)
        if self.quant_type is None:
            super().__post_init__()
            self.quant_type = "nf4" if self.bits == 4 else "int8"
        elif self.quant_type not in QUANT_TYPES:
            raise ValueError(
                f"BitsAndBytesCompressor.quant_type must be one of {sorted(QUANT_TYPES)}, got {self.quant_type!r}."
            )
        else:
            self.bits = QUANT_TYPES[self.quant_type]
            super().__post_init__()

    def codec(self, head_dim: int) -> Codec:
        return BitsAndBytesCodec(self.quant_type, self.blocksize)
