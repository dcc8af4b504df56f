"""Compressors: each builds a draft tier from a layer's exact K/V. One method per file, one interface (`base.py`).

Token dropping: `streaming_llm`, `snapkv`, `knorm`, `h2o` (and any kvpress press, via `KVPressCompressor`).
Quantization (one store, several backends, `quantized.py`): `kivi`, `quanto`, `hqq`, `bnb`, `fp8`.
A list composes them: `[SnapKVCompressor(0.75), KIVICompressor(bits=4)]`.
"""

from __future__ import annotations

from typing import Any

from .base import CompressionContext, Compressor, ScorerCompressor
from .bitsandbytes import BitsAndBytesCompressor
from .composed import ComposedCompressor
from .fp8 import FP8Compressor
from .h2o import H2OCompressor
from .hqq import HQQCompressor
from .kivi import KIVICompressor
from .knorm import KnormCompressor
from .kvpress_adapter import KVPressCompressor, is_press
from .quantized import Codec, QuantizedCompressor, QuantizedStore
from .quanto import QuantoCompressor
from .snapkv import SnapKVCompressor
from .streaming_llm import StreamingLLMCompressor

#: Names accepted by `VeriCacheConfig(compressor=...)`.
COMPRESSORS: dict[str, type[Compressor]] = {
    "streaming_llm": StreamingLLMCompressor,
    "snapkv": SnapKVCompressor,
    "knorm": KnormCompressor,
    "h2o": H2OCompressor,
    "kivi": KIVICompressor,
    "quanto": QuantoCompressor,
    "hqq": HQQCompressor,
    "bnb": BitsAndBytesCompressor,
    "fp8": FP8Compressor,
}


def available_compressors() -> list[str]:
    return sorted(COMPRESSORS)


def build_compressor(
    compressor: Any, compression_ratio: float, budget: int | None = None, **kwargs: Any
) -> Compressor:
    """A compressor from a name (with the config's ratio and budget), an instance (used as is), a kvpress press
    (wrapped) or a list of any of these (composed, in order)."""
    if isinstance(compressor, (list, tuple)):
        if kwargs:
            raise ValueError(
                "compressor_kwargs do not apply to a list of compressors; configure each stage instead."
            )
        stages = [build_compressor(stage, compression_ratio, budget) for stage in compressor]
        return ComposedCompressor(stages=stages)
    if isinstance(compressor, Compressor):
        if kwargs:
            raise ValueError(
                "compressor_kwargs only apply to a compressor given by name; set them on the instance."
            )
        return compressor
    if is_press(compressor):
        if kwargs:
            raise ValueError("compressor_kwargs do not apply to a kvpress press; set them on the press.")
        return KVPressCompressor(press=compressor, budget=budget)
    if isinstance(compressor, str):
        key = compressor.lower().replace("-", "_")
        if key not in COMPRESSORS:
            raise ValueError(
                f"Unknown compressor {compressor!r}. Choose one of {available_compressors()}, or pass a "
                f"vericache_hf.compressors.Compressor instance, a kvpress press or a list of them."
            )
        cls = COMPRESSORS[key]
        if budget is not None:
            if not issubclass(cls, ScorerCompressor):
                raise ValueError(
                    f"compression_budget applies to token-dropping compressors; {compressor!r} quantizes. Use "
                    "compression_ratio (bits), or a list such as ['snapkv', 'kivi'] to drop to a budget then quantize."
                )
            kwargs = {"budget": budget, **kwargs}
        return cls(compression_ratio=compression_ratio, **kwargs)
    raise TypeError(
        f"compressor must be a name, a vericache_hf.compressors.Compressor, a kvpress press or a list of them, got "
        f"{type(compressor).__name__}."
    )


__all__ = [
    "COMPRESSORS",
    "BitsAndBytesCompressor",
    "Codec",
    "ComposedCompressor",
    "CompressionContext",
    "Compressor",
    "FP8Compressor",
    "H2OCompressor",
    "HQQCompressor",
    "KIVICompressor",
    "KVPressCompressor",
    "KnormCompressor",
    "QuantizedCompressor",
    "QuantizedStore",
    "QuantoCompressor",
    "ScorerCompressor",
    "SnapKVCompressor",
    "StreamingLLMCompressor",
    "available_compressors",
    "build_compressor",
]
