"""Compressor specs as JSON, so that a `VeriCacheConfig` can be saved in a generation config and read back.

A spec written as JSON is a name (`"snapkv"`), a list of specs (composed, in order), a compressor of the library by
name and settings (`{"compressor": "kivi", "bits": 2}`), or a kvpress press by class name and
settings (`{"kvpress": "SnapKVPress", "compression_ratio": 0.5, "window_size": 32}`; a press holding another press nests
it the same way). `spec_from_json` turns the dicts back into the objects they name, and `spec_to_json` writes
objects as dicts, refusing one that its settings would not rebuild equal to itself: a compressor class of one's
own, or a field that is not plain JSON. A spec a user writes may take any of these forms.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import Compressor
from .composed import ComposedCompressor
from .kvpress_adapter import KVPressCompressor, import_kvpress, is_press

NAME_KEY = "compressor"
PRESS_KEY = "kvpress"
_PLAIN = (str, int, float, bool, type(None))


class UnnamedCompressorError(ValueError):
    """A compressor spec holds an object that JSON cannot name, so the config cannot be saved."""


def is_plain(value: Any) -> bool:
    """True for a value JSON writes and reads back unchanged: None, bools, numbers, strings, lists, str-keyed dicts."""
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")  # JSON has no NaN or infinity
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, list):
        return all(is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and is_plain(item) for key, item in value.items())
    return False


def spec_from_json(spec: Any) -> Any:
    """The spec with every `{"compressor": ...}` and `{"kvpress": ...}` dict (list entries and nested presses included)
    turned into the compressor or press it names; anything else is returned as it is."""
    if isinstance(spec, list | tuple):
        return [spec_from_json(entry) for entry in spec]
    if not isinstance(spec, dict):
        return spec
    if (NAME_KEY in spec) == (PRESS_KEY in spec):
        raise ValueError(
            f"A compressor given as a dict names a library compressor ({{'{NAME_KEY}': 'kivi', 'bits': 2}}) or a "
            f"kvpress press ({{'{PRESS_KEY}': 'SnapKVPress', 'compression_ratio': 0.5}}): exactly one of "
            f"'{NAME_KEY}' and '{PRESS_KEY}', got keys {sorted(spec)}."
        )
    settings = {
        key: _setting_from_json(value) for key, value in spec.items() if key not in (NAME_KEY, PRESS_KEY)
    }
    if NAME_KEY in spec:
        return _named_class(spec[NAME_KEY])(**settings)
    return _press_class(spec[PRESS_KEY])(**settings)


def _setting_from_json(value: Any) -> Any:
    """A setting as written: a press inside a press is a `{"kvpress": ...}` dict; any other value is plain."""
    return spec_from_json(value) if isinstance(value, dict) and PRESS_KEY in value else value


def spec_to_json(spec: Any) -> Any:
    """The spec as JSON (see the module's docstring); raises `UnnamedCompressorError` for an object it cannot name."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, list | tuple):
        return [spec_to_json(entry) for entry in spec]
    if isinstance(spec, ComposedCompressor) and type(spec) is ComposedCompressor:
        return [spec_to_json(stage) for stage in spec.stages]
    if isinstance(spec, KVPressCompressor) and type(spec) is KVPressCompressor and spec.budget is None:
        return spec_to_json(spec.press)
    written = _write(spec)
    if not _rebuilds(written, spec):
        raise UnnamedCompressorError(_unnamed(spec, "its settings do not rebuild it"))
    return written


def _write(spec: Any) -> dict[str, Any]:
    """One compressor or press as a dict of its class name and settings, unchecked."""
    if is_press(spec):
        return {PRESS_KEY: type(spec).__name__, **_settings(spec, _write)}
    name = _registered_name(spec) if isinstance(spec, Compressor) else None
    if name is None:
        raise UnnamedCompressorError(
            _unnamed(spec, "it is not a compressor of the library or a kvpress press")
        )
    return {NAME_KEY: name, **_settings(spec, None)}


def _settings(obj: Any, nested) -> dict[str, Any]:
    """The init fields of a dataclass compressor or press, each plain JSON (a press inside a press written by
    `nested`)."""
    if not dataclasses.is_dataclass(obj):
        raise UnnamedCompressorError(_unnamed(obj, "it is not a dataclass, so its settings are unknown"))
    settings = {}
    for item in dataclasses.fields(obj):
        if not item.init:
            continue
        value = getattr(obj, item.name)
        if nested is not None and is_press(value):
            value = nested(value)
        elif isinstance(value, tuple):
            value = list(value)
        if not is_plain(value):
            raise UnnamedCompressorError(
                _unnamed(
                    obj, f"its field {item.name}={value!r} is not plain JSON (a number, string, list, ...)"
                )
            )
        settings[item.name] = value
    return settings


def _rebuilds(written: dict[str, Any], spec: Any) -> bool:
    """Whether the written settings build an object of the same class that writes the same settings (state a
    compressor or press makes for itself once in use, outside its init fields, is not compared)."""
    try:
        rebuilt = spec_from_json(written)
        return type(rebuilt) is type(spec) and _write(rebuilt) == written
    except Exception:  # noqa: BLE001 - any failure to rebuild means the object cannot be named
        return False


def _unnamed(spec: Any, why: str) -> str:
    return (
        f"The compressor {type(spec).__name__} cannot be saved in a generation config: {why}. A saved config names "
        "its compressor: give it by name (compressor='snapkv', compressor_kwargs={...}, see "
        "vericache_hf.compressors.available_compressors()), as a library compressor or kvpress press with plain "
        "settings, or a list of these; or keep the object and pass vericache_config= to each generate call."
    )


def _registered_name(compressor: Compressor) -> str | None:
    from . import COMPRESSORS

    return next((name for name, cls in COMPRESSORS.items() if type(compressor) is cls), None)


def _named_class(name: Any) -> type[Compressor]:
    from . import COMPRESSORS, available_compressors

    if not isinstance(name, str) or name not in COMPRESSORS:
        raise ValueError(
            f"Unknown compressor name {name!r} in a compressor dict; choose one of {available_compressors()}."
        )
    return COMPRESSORS[name]


def _press_class(name: Any) -> type:
    kvpress = import_kvpress()
    cls = getattr(kvpress, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, kvpress.presses.base_press.BasePress)):
        raise ValueError(
            f"Unknown kvpress press {name!r} in a compressor dict; give the class name of a press kvpress exports, "
            "such as 'SnapKVPress' or 'KnormPress'."
        )
    return cls
