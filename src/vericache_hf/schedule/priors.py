"""What cost-aware schedules measured on a model, carried from call to call: a short answer does not pay for
exploring, so the next call on the same model and settings decides its first rounds from measurements.

Each model owns its priors (`priors_for(model)`), which a user can read and `forget`; a model that is deleted
takes its priors with it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from typing import Any, Protocol


class Measured(Protocol):
    def estimates(self) -> dict[str, Any] | None:
        """A copy of what the schedule measured (None: nothing worth carrying)."""


class SchedulePriors:
    """One model's priors, per settings (compressor, batch size, context scale, ...). Thread-safe: calls on the
    model from several threads recall and remember at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_settings: dict[Hashable, dict[str, Any]] = {}

    def recall(self, settings: Hashable) -> dict[str, Any] | None:
        with self._lock:
            return self._by_settings.get(settings)

    def remember(self, settings: Hashable, schedule: Measured) -> None:
        estimates = schedule.estimates()
        if estimates is not None:
            with self._lock:
                self._by_settings[settings] = estimates

    def forget(self, settings: Hashable | None = None) -> None:
        """Drop what was measured under `settings` (under every settings when None)."""
        with self._lock:
            if settings is None:
                self._by_settings.clear()
            else:
                self._by_settings.pop(settings, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_settings)


_OWNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def priors_for(model) -> SchedulePriors:
    """The priors `model` owns (made on first use)."""
    with _LOCK:
        priors = _OWNED.get(model)
        if priors is None:
            priors = _OWNED[model] = SchedulePriors()
        return priors
