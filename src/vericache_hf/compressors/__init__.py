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
from .naming import spec_from_json, spec_to_json
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


def _normalized_name(name: str) -> str:
    return name.lower().replace("-", "_")


def _check_one(compressor: Any, budget: int | None, kwargs: dict[str, Any], index: int | None = None) -> None:
    """The rules for one compressor: the whole spec, or (with `index`) one entry of a list."""
    if isinstance(compressor, Compressor):
        if kwargs:
            raise ValueError(
                "compressor_kwargs only apply to a compressor given by name; set them on the instance."
            )
        return
    if is_press(compressor):
        if kwargs:
            raise ValueError("compressor_kwargs do not apply to a kvpress press; set them on the press.")
        return
    if isinstance(compressor, str):
        key = _normalized_name(compressor)
        if key not in COMPRESSORS:
            raise ValueError(
                f"Unknown compressor {compressor!r}{'' if index is None else f' (list entry {index})'}. Choose one "
                f"of {available_compressors()}, or pass a vericache_hf.compressors.Compressor instance, a kvpress "
                "press or a list of them."
            )
        if budget is not None and index is None and not issubclass(COMPRESSORS[key], ScorerCompressor):
            raise ValueError(
                f"compression_budget applies to token-dropping compressors; {compressor!r} quantizes. Use "
                "compression_ratio (bits), or a list such as ['snapkv', 'kivi'] to drop to a budget then quantize."
            )
        return
    raise TypeError(
        f"compressor must be a name, a vericache_hf.compressors.Compressor, a kvpress press or a list of them, got "
        f"{type(compressor).__name__}."
    )


def check_compressor_spec(
    compressor: Any, budget: int | None = None, kwargs: dict[str, Any] | None = None
) -> None:
    """Refuse a compressor spec that `build_compressor` could not build, without building anything.

    Checked: names (against `available_compressors()`), the kind of each list entry (a name, a `Compressor` or a
    kvpress press; a bad entry is named by its index), lists of fewer than two entries, `compressor_kwargs` given
    with anything but a single name, and a `compression_budget` for a quantizer given by name. A compressor's own
    parameters are checked when it is built.
    """
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise TypeError(f"compressor_kwargs must be a dict, got {type(kwargs).__name__}.")
    if isinstance(compressor, (list, tuple)):
        if kwargs:
            raise ValueError(
                "compressor_kwargs do not apply to a list of compressors; configure each stage instead."
            )
        if len(compressor) < 2:
            raise ValueError(
                f"A list of compressors composes two or more stages, got {len(compressor)}; pass a single "
                "compressor on its own."
            )
        for index, stage in enumerate(compressor):
            if not isinstance(stage, (str, Compressor)) and not is_press(stage):
                raise TypeError(
                    f"compressor list entry {index} must be a name, a vericache_hf.compressors.Compressor or a "
                    f"kvpress press, got {type(stage).__name__}."
                )
            _check_one(stage, budget, {}, index)
        return
    _check_one(compressor, budget, kwargs)


def build_compressor(
    compressor: Any, compression_ratio: float, budget: int | None = None, **kwargs: Any
) -> Compressor:
    """A compressor from a name (with the config's ratio and budget), an instance (used as is), a kvpress press
    (wrapped) or a list of any of these (composed, in order; a budget goes to the token-dropping stages given by
    name, so `["snapkv", "kivi"]` drops to the budget, then quantizes at the ratio's bit width).

    A dict names a compressor or press by its settings (`naming.py`). The spec is checked by
    `check_compressor_spec`, the rules `VeriCacheConfig` applies when it is made."""
    compressor = spec_from_json(compressor)
    check_compressor_spec(compressor, budget, kwargs)
    if isinstance(compressor, (list, tuple)):
        return ComposedCompressor(
            stages=[_build_one(stage, compression_ratio, budget, {}) for stage in compressor]
        )
    return _build_one(compressor, compression_ratio, budget, kwargs)


def _build_one(
    compressor: Any, compression_ratio: float, budget: int | None, kwargs: dict[str, Any]
) -> Compressor:
    """Build one checked spec (not a list)."""
    if isinstance(compressor, Compressor):
        return compressor
    if is_press(compressor):
        return KVPressCompressor(press=compressor, budget=budget)
    cls = COMPRESSORS[_normalized_name(compressor)]
    if budget is not None and issubclass(cls, ScorerCompressor):
        kwargs = {"budget": budget, **kwargs}
    return cls(compression_ratio=compression_ratio, **kwargs)


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
    "check_compressor_spec",
    "spec_from_json",
    "spec_to_json",
]
