"""How many tokens to draft next round: fixed, or adapted to how far recent drafts ran."""

from __future__ import annotations

import math

from .config import VeriCacheConfig


class DraftLengthSchedule:
    """Adaptive: double the draft while rounds are fully accepted; after a rejection, aim a little past the accepted
    run (1.5x + 1). A same-model draft often runs tens of tokens, so the schedule climbs there in a few rounds."""

    def __init__(self, config: VeriCacheConfig) -> None:
        self.adaptive = config.draft_schedule == "adaptive"
        self.low, self.high = config.min_draft_length, config.max_draft_length
        self.current = config.draft_length

    def update(self, drafted: int, mean_accepted: float) -> None:
        if not self.adaptive or drafted < self.current:
            return  # a draft cut short by the length budget says nothing about acceptance
        proposal = 2 * drafted if mean_accepted >= drafted else math.ceil(1.5 * mean_accepted) + 1
        self.current = min(self.high, max(self.low, proposal))
