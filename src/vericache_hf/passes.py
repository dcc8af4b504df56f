"""What every pass of the loop shares: the rows' token buffers (`Sequences`), what `generate` prepared for the call
(`DecodeIO`), one forward pass on the tier of the cache's current phase (`forward`), the logits processors applied
to each row's own prefix (`process`), and a token emitted, reported and checked against the stopping criteria
(`emit`)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .cache.vericache import VeriCache
from .compat import cache_kwargs
from .drafting.proposers import Proposer
from .prefix.reuse import PrefixReuse
from .prefix.shared import SharedPrefixes
from .schedule.proposal_length import ProposalLength
from .timeline import Timeline


@dataclass
class Sequences:
    """Per-row token buffers: each row grows by its own accepted count. Rows start with the (left-padded) prompt,
    as stock `generate`'s `input_ids` do, so processors and stopping criteria see the same prefixes."""

    tokens: torch.Tensor  # (B, capacity)
    lengths: list[int]
    unfinished: list[bool]
    scores: list[list[torch.Tensor]] = field(default_factory=list)
    raw_logits: list[list[torch.Tensor]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # each row's first real token (after left padding)

    @classmethod
    def start(cls, input_ids: torch.Tensor, max_length: int, pad_token_id: int) -> Sequences:
        batch, prompt = input_ids.shape
        tokens = input_ids.new_full((batch, max(max_length, prompt)), pad_token_id)
        tokens[:, :prompt] = input_ids
        return cls(
            tokens, [prompt] * batch, [True] * batch, [[] for _ in range(batch)], [[] for _ in range(batch)]
        )

    def prefix(self, row: int) -> torch.Tensor:
        return self.tokens[row : row + 1, : self.lengths[row]]

    def text(self, row: int) -> torch.Tensor:
        """The row's tokens without its left padding (1-D), as a proposer should see them."""
        return self.tokens[row, self.starts[row] : self.lengths[row]]


@dataclass
class DecodeIO:
    """What `generate` prepared and the loop uses to choose, stop and report tokens."""

    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    max_length: int
    pad_token_id: int
    do_sample: bool = False
    streamer: object | None = None
    keep_scores: bool = False
    keep_logits: bool = False
    proposer: Proposer | None = None  # hierarchical drafting: proposals the draft tier checks
    proposal_length: ProposalLength | None = None  # how many a draft-tier pass checks
    plain_proposal_length: ProposalLength | None = None  # how many a plain round verifies on the full tier
    prefix: PrefixReuse | None = None  # a prefix store: reuse the prompt's prefix, or save it
    shared: SharedPrefixes | None = None  # an engine's kept prefixes: seed the prefill, keep this prompt's
    timeline: Timeline | None = None  # where prefill, draft and verify spans are recorded
    drafter: torch.nn.Module | None = None  # `draft_dtype`'s copy of the model, for draft-tier passes
    started: float = 0.0  # perf_counter() when decoding started
    failed: BaseException | None = None  # a row's request failed (a cohort's row): it emits nothing more
    prompt_inputs: dict = field(default_factory=dict)  # what the prefill alone reads: images and their masks
    # the model counts positions from its cache's length (`counts_positions_from_cache`), as stock `generate` then
    # does for every row, padding included: so rows accept uniformly (`accept_uniformly`, no row gets masked slots)
    # and a row's position counts its padding slots too
    positions_from_cache: bool = False

    def of(self, row: int) -> DecodeIO:
        """The io that reports and stops `row`: this one, or in a cohort the row's own request's
        (`cohort.CohortIO`)."""
        return self


def counts_positions_from_cache(model) -> bool:
    """Whether the model numbers a pass's tokens from its cache's length rather than from `position_ids`: its
    forward names none, so stock `generate` passes none (the BART family's causal decoders, which have no use for
    them, and wrappers that hand them on to a decoder that then counts from the cache). Each row's position is then
    the cache's length, its masked slots (left padding) included, so every row of a batch must grow by the same
    number of tokens."""
    return _counts_positions_from_cache(type(model))


@functools.cache
def _counts_positions_from_cache(model_class: type) -> bool:
    return "position_ids" not in inspect.signature(model_class.forward).parameters


def process(io: DecodeIO, seqs: Sequences, drafts: torch.Tensor | list[torch.Tensor], logits: torch.Tensor):
    """Apply the logits processors to (B, V) logits for the position after each row's prefix plus its `drafts`
    ((B, s), or one 1-D tensor per row when rows drafted different counts), exactly the input_ids stock `generate`
    would hold there.

    Processors may keep per-row state indexed by batch position (the repetition penalty's prompt lengths), so
    each call sees the whole batch: one call per distinct row length, keeping the rows of that length."""
    if not io.logits_processor:
        return logits
    rows = [row.to(seqs.tokens.device) for row in drafts]
    totals = [seqs.lengths[b] + row.shape[-1] for b, row in enumerate(rows)]
    scores = None
    for total in sorted(set(totals)):
        prefixes = seqs.tokens.new_full((len(rows), total), io.pad_token_id)
        for b, row in enumerate(rows):
            whole = torch.cat([seqs.tokens[b, : seqs.lengths[b]], row])[:total]
            prefixes[b, : whole.shape[-1]] = whole
        processed = io.logits_processor(prefixes, logits.clone())
        keep = (torch.tensor(totals, device=logits.device) == total)[:, None]
        scores = processed if scores is None else torch.where(keep, processed, scores)
    return scores


def forward(
    model, cache: VeriCache, tokens: torch.Tensor, positions: torch.Tensor, keep: int | None = None
) -> torch.Tensor:
    """One pass of (B, q) tokens at absolute (B,) start `positions`, on the tier of the cache's current phase;
    the logits of the last `keep` positions (all q by default)."""
    query = tokens.shape[-1]
    keep = keep or query
    outputs = model(
        input_ids=tokens,
        position_ids=positions[:, None] + torch.arange(query, device=positions.device),
        attention_mask=cache.attention_mask(query),
        **cache_kwargs(model, cache),
        use_cache=True,
        logits_to_keep=keep,
    )
    return outputs.logits[:, -keep:]


def emit(io: DecodeIO, seqs: Sequences, row: int, token: torch.Tensor, scores, raw) -> bool:
    """Append one token to a row, report it, and check the stopping criteria on the new prefix. True = row stops."""
    io = io.of(row)
    if io.failed is not None:  # a cohort's row whose request failed: it leaves after this round
        seqs.unfinished[row] = False
        return True
    at = seqs.lengths[row]
    seqs.tokens[row, at] = token
    seqs.lengths[row] = at + 1
    if io.keep_scores:
        seqs.scores[row].append(scores)
    if io.keep_logits:
        seqs.raw_logits[row].append(raw)
    if io.streamer is not None:
        io.streamer.put(token.reshape(1).cpu())
    stop = bool(io.stopping_criteria(seqs.prefix(row), scores[None]).any()) if io.stopping_criteria else False
    stop = stop or seqs.lengths[row] >= io.max_length
    if stop:
        seqs.unfinished[row] = False
    return stop
