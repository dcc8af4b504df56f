"""Compressors: each builds a draft tier from a layer's exact K/V. One method per file, one interface (`base.py`)."""

from __future__ import annotations

from typing import Any

from .base import CompressionContext, Compressor, ScorerCompressor
from .kivi import KIVICompressor
from .snapkv import SnapKVCompressor
from .streaming_llm import StreamingLLMCompressor

#: Names accepted by `VeriCacheConfig(compressor=...)`.
COMPRESSORS: dict[str, type[Compressor]] = {
    "streaming_llm": StreamingLLMCompressor,
    "snapkv": SnapKVCompressor,
    "kivi": KIVICompressor,
}


def available_compressors() -> list[str]:
    return sorted(COMPRESSORS)


def build_compressor(compressor: str | Compressor, compression_ratio: float, **kwargs: Any) -> Compressor:
    """A compressor instance from a name (with the config's ratio) or an instance (used as is)."""
    if isinstance(compressor, Compressor):
        if kwargs:
            raise ValueError("compressor_kwargs only apply to a compressor given by name; set them on the instance.")
        return compressor
    if isinstance(compressor, str):
        key = compressor.lower().replace("-", "_")
        if key not in COMPRESSORS:
            raise ValueError(
                f"Unknown compressor {compressor!r}. Choose one of {available_compressors()}, or pass a "
                f"vericache_hf.compressors.Compressor instance."
            )
        return COMPRESSORS[key](compression_ratio=compression_ratio, **kwargs)
    raise TypeError(
        f"compressor must be a name or a vericache_hf.compressors.Compressor, got {type(compressor).__name__}."
    )


__all__ = [
    "COMPRESSORS",
    "CompressionContext",
    "Compressor",
    "KIVICompressor",
    "ScorerCompressor",
    "SnapKVCompressor",
    "StreamingLLMCompressor",
    "available_compressors",
    "build_compressor",
]
