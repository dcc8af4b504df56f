"""`VeriCacheStats`: what one or more VeriCache runs measured."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import ClassVar

MIB = 1024 * 1024


@dataclass
class VeriCacheStats:
    """Counters of a VeriCache run. Pass one in `VeriCacheConfig(stats=...)` to accumulate over several calls.

    Tokens are counted per batch row: a round over 4 rows that accepts 3, 5, 0 and 7 drafts adds 15 to
    `accepted_tokens` and 4 to `row_rounds`.

    Transfers: `bytes_to_device` is the full tier staged for verification and `chunk_transfers` the number of
    copies that moved it (one per staged layer and verify pass; none where a layer on the CPU reads its full tier in
    place), `bytes_to_host` the exact K/V written to the full tier (the prompt, then only newly accepted tokens). `transfer_seconds` is the time the copies took,
    `transfer_wait_seconds` the time the verify pass waited on them; the rest was hidden behind drafting and
    compute (`transfer_hidden_share`). `peak_draft_tier_bytes` (sum of the draft stores) and `peak_staging_bytes`
    (the full tier's layer buffers) are device memory, and so is `recurrent_state_bytes` (a hybrid model's recurrent
    layers: one exact state per row, read by draft and verify passes alike) and `window_tier_bytes` (the sliding-window
    layers of a model with full-attention layers too: their window's exact K/V, read by both kinds of pass);
    `full_tier_bytes` is host memory. `compress_seconds` is the
    compressor's time: at prefill (a share of `prefill_seconds`), in refreshes and in builds.

    Drafting: `draft_forwards` counts draft-tier passes (one per drafted token without a proposer). With a proposer
    (hierarchical drafting), `proposed_tokens` were offered, per row: to the draft tier, which kept
    `proposal_kept_tokens`, or in plain rounds straight to the full tier, which accepted `proposals_verified_kept`.
    `draft_forwards_per_token` is draft-tier passes per drafted position. A model that counts positions from the
    cache's length has every row of a batch keep the fewest drafts any row kept; `drafts_given_up` counts the
    accepted drafts the other rows dropped for it (not in `accepted_tokens`). `ragged_rounds` counts the rounds whose
    rows accepted different counts: each leaves masked slots in the rows that accepted fewer, which the attention
    masks (sliding windows and chunks included) must count past.

    A K/V-only compressor on a layer that reads its full tier in place builds the draft tier when drafting first
    needs it, not at prefill, and plain rounds for a long while free it (`draft_tier_frees`); each build from the
    full tier counts in `draft_tier_builds`, its time in `compress_seconds`. A build the schedule priced from its
    first two layers and found dearer than drafting could ever save is declined (`draft_tier_builds_declined`;
    their time is in `compress_seconds` too) and the rounds stay plain. A `RefreshPolicy` rebuilt it
    `draft_tier_refreshes` times in `refresh_seconds`. `commit_seconds` is the time spent
    writing accepted tokens into the tiers, `plain_round_seconds` the part of draft and verify time spent in rounds
    that drafted nothing.

    Prefix store (`VeriCacheConfig(prefix_store=...)`): `prefix_tokens_reused` came from the store instead of a
    prefill, for which `prefix_compressed_bytes` (the draft tier, fetched first) and `prefix_full_bytes` (streamed in
    behind) were read; `prefix_wait_seconds` is the time decoding waited on the store. The full prefix's load ran for
    `prefix_load_seconds`, of which its thread was on a CPU `prefix_load_cpu_seconds` (replies, checksums, copies):
    near the whole load, it competed with drafting for the cores. `first_draft_seconds` and
    `first_token_seconds` run from the start of decoding to the first drafted token and to the first verified one.
    """

    rounds: int = 0
    plain_rounds: int = 0  # rounds that drafted nothing: one full-cache step through the verify pass
    row_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    bytes_to_device: int = 0
    bytes_to_host: int = 0
    draft_tier_bytes: int = 0
    full_tier_bytes: int = 0
    recurrent_state_bytes: int = 0
    window_tier_bytes: int = 0
    chunk_transfers: int = 0
    transfer_seconds: float = 0.0
    transfer_wait_seconds: float = 0.0
    peak_draft_tier_bytes: int = 0
    peak_staging_bytes: int = 0
    prefill_seconds: float = 0.0
    compress_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_forwards: int = 0
    proposed_tokens: int = 0
    proposal_kept_tokens: int = 0
    proposals_verified_kept: int = 0  # proposals the full tier accepted in plain rounds (verified directly)
    drafts_given_up: int = 0  # accepted drafts dropped so that every row grows alike (uniform acceptance)
    ragged_rounds: int = 0
    prefix_tokens_reused: int = 0
    prefix_compressed_bytes: int = 0
    prefix_full_bytes: int = 0
    prefix_wait_seconds: float = 0.0
    prefix_load_seconds: float = 0.0
    prefix_load_cpu_seconds: float = 0.0
    first_draft_seconds: float = 0.0
    first_token_seconds: float = 0.0
    draft_tier_frees: int = 0
    draft_tier_builds: int = 0
    draft_tier_builds_declined: int = 0
    draft_tier_refreshes: int = 0
    refresh_seconds: float = 0.0
    commit_seconds: float = 0.0
    plain_round_seconds: float = 0.0
    accepted_per_round: list[float] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    _merging: ClassVar[threading.Lock] = threading.Lock()  # calls on several threads may merge into one

    @property
    def mean_accepted_per_round(self) -> float:
        """Accepted draft tokens per row and round (the bonus token is not counted)."""
        return self.accepted_tokens / self.row_rounds if self.row_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def proposal_keep_rate(self) -> float:
        """Share of proposed tokens kept (by the draft tier, or by the full tier in plain rounds)."""
        kept = self.proposal_kept_tokens + self.proposals_verified_kept
        return kept / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def draft_forwards_per_token(self) -> float:
        """Draft-tier passes per drafted position (1.0 without a proposer; lower when proposals are kept)."""
        drafted = sum(self.draft_lengths)
        return self.draft_forwards / drafted if drafted else 0.0

    @property
    def transfer_hidden_share(self) -> float:
        """Share of the transfer time the verify pass did not wait for (1.0 = fully overlapped)."""
        if not self.transfer_seconds:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.transfer_wait_seconds / self.transfer_seconds))

    def __str__(self) -> str:
        """One line for a log or a notebook; `repr` keeps every counter."""
        text = (
            f"VeriCacheStats: {self.rounds} rounds ({self.plain_rounds} plain), "
            f"{self.mean_accepted_per_round:.1f} accepted/round, {self.emitted_tokens} tokens; "
            f"{self.bytes_to_device / MIB:.1f} MiB to device, {self.bytes_to_host / MIB:.1f} MiB to host"
        )
        if self.proposed_tokens:
            text += (
                f"; proposals {self.proposal_keep_rate:.0%} kept, "
                f"{self.draft_forwards_per_token:.2f} draft passes per drafted token"
            )
        if self.transfer_seconds:
            text += f"; {self.transfer_hidden_share:.0%} of transfer time hidden"
        return text

    def record_round(self, draft_length: int, accepted: list[int]) -> None:
        self.rounds += 1
        self.row_rounds += len(accepted)
        self.drafted_tokens += draft_length * len(accepted)
        self.accepted_tokens += sum(accepted)
        self.ragged_rounds += len(set(accepted)) > 1
        self.accepted_per_round.append(sum(accepted) / len(accepted) if accepted else 0.0)
        self.draft_lengths.append(draft_length)

    def merge(self, other: VeriCacheStats) -> None:
        """Add another run's counters into this one (tier sizes keep the larger value); safe from many threads."""
        with self._merging:
            self._merge(other)

    def _merge(self, other: VeriCacheStats) -> None:
        for item in fields(self):
            mine, theirs = getattr(self, item.name), getattr(other, item.name)
            if item.name.endswith("tier_bytes") or item.name.startswith("peak_"):
                setattr(self, item.name, max(mine, theirs))
            elif isinstance(mine, list):
                mine.extend(theirs)
            else:
                setattr(self, item.name, mine + theirs)
