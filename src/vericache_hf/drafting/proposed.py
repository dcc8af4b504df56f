"""Hierarchical drafting: a proposer (prompt lookup, an assistant model) offers tokens, the draft tier checks them in
one multi-token pass and keeps, per row, those that agree with its own choices (`draft_with_proposals`); or a plain
round verifies them directly on the full tier (`propose_to_full_tier`), as classic speculative decoding does. Either
way the full tier's verify pass decides what is emitted, so the output is stock `generate`'s."""

from __future__ import annotations

import time

import torch

from ..accept import proposal_accept
from ..cache.vericache import VeriCache
from ..passes import DecodeIO, Sequences, forward, process
from ..schedule.proposal_length import bounding_rows, call_run


def draft_with_proposals(model, cache: VeriCache, pending, positions, k: int, io: DecodeIO, seqs: Sequences):
    """Hierarchical drafting: each draft-tier pass checks a proposer's tokens for every row at once and keeps, per
    row, the proposals that agree with the draft tier's own choice plus that choice (`verify.proposal_accept`),
    until every row has k drafts. Rejected slots are masked (`cache.keep_drafted`) and rolled back with the rest
    when drafting ends. Returns what `draft` returns; the drafted tokens are distributed as plain drafting's."""
    batch, stats, schedule = pending.shape[0], cache.stats, io.proposal_length
    rows = [pending.new_empty(0) for _ in range(batch)]
    probs: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    token, position = pending.clone(), positions.clone()
    # a row drafts no more than it can emit: stopped rows nothing, rows near max_length what fits
    wanted = [min(k, io.max_length - seqs.lengths[b] - 1) if seqs.unfinished[b] else 0 for b in range(batch)]
    while max(need := [wanted[b] - row.shape[-1] for b, row in enumerate(rows)]) > 0:
        started = time.perf_counter()
        left = {b: n for b, n in enumerate(need) if n > 0}  # passes go on until every row has k
        bound = bounding_rows(left)
        proposed = widen_for(
            [
                io.proposer.propose(
                    b, torch.cat([seqs.text(b), rows[b].to(seqs.tokens.device)]), min(limit, n - 1)
                )
                if (limit := schedule.current) and n > 1
                else pending.new_empty(0)
                for b, n in enumerate(need)
            ],
            bound,
        )
        offered = [p.shape[-1] for p in proposed]
        inputs = [torch.cat([token[b : b + 1], p.to(token.device)]) for b, p in enumerate(proposed)]
        block = pad_rows(inputs, 1 + max(offered), io.pad_token_id, pending)
        logits = forward(model, cache, block, position).float()  # (B, w, V)
        scores = torch.stack(
            [
                process(
                    io, seqs, [torch.cat([rows[b], block[b, 1 : 1 + s]]) for b in range(batch)], logits[:, s]
                )
                for s in range(block.shape[-1])
            ],
            dim=1,
        )
        kept, own = proposal_accept(block[:, 1:], torch.tensor(offered), scores, io.do_sample)
        kept = kept.tolist()
        live = [n > 0 for n in need]
        slots = torch.arange(block.shape[-1])[None, :] <= torch.tensor(kept)[:, None]
        cache.keep_drafted(slots & torch.tensor(live)[:, None])
        for b in (b for b in range(batch) if live[b]):
            rows[b] = torch.cat([rows[b], block[b, 1 : 1 + kept[b]], own[b : b + 1].to(block.device)])[:k]
            if io.do_sample:
                probs[b].extend(torch.softmax(scores[b, : kept[b] + 1], dim=-1).unbind(0))
            token[b] = own[b]
            position[b] += kept[b] + 1
        offered_live = [o for o, alive in zip(offered, live, strict=True) if alive]
        kept_live = [n for n, alive in zip(kept, live, strict=True) if alive]
        stats.draft_forwards += 1
        stats.proposed_tokens += sum(offered_live)
        stats.proposal_kept_tokens += sum(kept_live)
        seconds = time.perf_counter() - started
        run = call_run(left, {b: offered[b] for b in left}, {b: kept[b] for b in left})
        schedule.observe(block.shape[-1], seconds, [run[0]], [run[1]])
    if not k:
        return pending.new_empty((batch, 0)), None
    # rows that stopped or are near max_length drafted fewer: padding, verified with the rest and never emitted
    drafts = pad_rows(rows, k, io.pad_token_id, pending)
    if not io.do_sample:
        return drafts, None
    vocab = scores.shape[-1]
    return drafts, torch.stack(
        [torch.stack(row[:k] + [scores.new_zeros(vocab)] * (k - len(row[:k]))) for row in probs]
    )


def propose_to_full_tier(
    io: DecodeIO, seqs: Sequences, pending, bound: list[int]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The proposer's tokens for a round that drafts nothing on the draft tier, to verify directly (classic
    speculative decoding): (B, m) proposals after each row's pending token, padded, and (B,) real counts, or None
    when `plain_proposal_length` says they do not pay or no `bound` row has any (`widen_for`). A row gets no more
    than it can emit; stopped rows none."""
    limit = io.plain_proposal_length.current
    if not limit:
        return None
    rows = []
    for b in range(len(seqs.lengths)):
        room = io.max_length - seqs.lengths[b] - 1
        wanted = min(limit, room) if seqs.unfinished[b] else 0  # the text ends in `pending`
        rows.append(io.proposer.propose(b, seqs.text(b), wanted) if wanted > 0 else pending.new_empty(0))
    rows = widen_for(rows, bound)
    counts = torch.tensor([row.shape[-1] for row in rows])
    if not int(counts.max()):
        return None
    return pad_rows(rows, int(counts.max()), io.pad_token_id, pending), counts


def widen_for(proposed: list[torch.Tensor], bound: list[int]) -> list[torch.Tensor]:
    """Each row's proposals cut to the longest of the `bound` rows' (`bounding_rows`): a pass widens only for
    the rows the call waits for, the others' ride along in its width for free. On the embedded model at batch 4
    and 2k tokens, an 11-token pass costs 2-3x a one-token one, and a row ahead gains the call nothing."""
    width = max((proposed[b].shape[-1] for b in bound), default=0)
    return [p[:width] for p in proposed]


def pad_rows(rows: list[torch.Tensor], width: int, pad_token_id: int, like: torch.Tensor) -> torch.Tensor:
    """(B, width) tokens on `like`'s device from 1-D rows of at most `width` tokens, padded on the right."""
    block = like.new_full((len(rows), width), pad_token_id)
    for b, row in enumerate(rows):
        block[b, : row.shape[-1]] = row.to(block.device)
    return block
