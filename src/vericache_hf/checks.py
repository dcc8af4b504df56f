"""Argument checks shared by configs, compressors and the cache, so that every bad setting is refused with an
error that names it."""

from __future__ import annotations

import math
import threading
from typing import Any


def check_int(name: str, value: Any, low: int = 1, why: str = "") -> None:
    """Refuse `name` unless it is an integer >= `low` (a bool is not an integer here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{why}, got {value!r}.")


def check_seconds(name: str, value: Any) -> None:
    """Refuse `name` unless it is a positive, finite number of seconds (inf overflows a thread wait and nan never
    compares, so neither can bound a wait)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not math.isfinite(value))
        or value <= 0
    ):
        raise ValueError(
            f"{name} must be a positive number of seconds; pass a finite number of seconds (not inf or nan), "
            f"got {value!r}."
        )
    if value > threading.TIMEOUT_MAX:
        raise ValueError(
            f"{name} must be at most threading.TIMEOUT_MAX ({threading.TIMEOUT_MAX:.0f}) seconds, got {value!r}."
        )


def check_budget(name: str, budget: Any) -> None:
    """Refuse a token budget that is neither None nor a positive integer."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"{name} must be a positive number of tokens to keep (or None), got {budget!r}.")


def check_ratio(name: str, value: Any) -> None:
    """Refuse a compression ratio outside [0, 1): the share of the KV cache to remove."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(
            f"{name} must be a number in [0, 1): the fraction of the KV cache to remove (0.75 keeps a quarter). "
            f"Got {value!r}."
        )
