"""The hand-off from a call's own prefill to passes shared with other calls: what a call hands over (`Member`) and
what it hands it to (`Cohorts`).

The decoding front knows only this protocol, so the core imports nothing from `serving/`: the serving engine's
`CohortPool` implements `Cohorts`, and a call given one decodes its prompt there after prefilling alone.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from .cache.vericache import VeriCache
from .config import VeriCacheConfig
from .loop import Decoding
from .passes import DecodeIO, Sequences


@dataclass
class Member:
    """A request handed over after its prefill: its one-row cache and state, and its own io."""

    cache: VeriCache
    state: Decoding
    io: DecodeIO
    config: VeriCacheConfig
    key: Hashable  # what rows sharing passes must share: sampling or not, and the compressor and its settings
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self.error = self.error or error or self.io.failed
        self.done.set()


class Cohorts(Protocol):
    """Where members decode in shared passes."""

    def prefilling(self) -> AbstractContextManager[None]:
        """Held around a call's own prefill (a pool may pace prefills against the rounds it runs)."""

    def decode(self, member: Member) -> Sequences:
        """Decode `member`'s rows to the end and return its sequences (it takes over `member.cache`)."""
