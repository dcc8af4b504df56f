"""Accept rules as pure functions on tensors: which drafted tokens the full-cache model agrees with.

Both rules return `(accepted, tokens)`: `accepted` (B,) counts each row's leading drafts kept, and `tokens` (B, k+1)
holds what the row emits, `tokens[b, :accepted[b] + 1]` (the kept drafts, then a bonus or correction token).
`accept_uniformly` then cuts every row to the batch's fewest, for models whose rows must grow alike.
"""

from __future__ import annotations

import torch


def choose(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """One token per row from processed (B, V) scores, as stock `generate` picks it (argmax, or a multinomial draw
    from their softmax)."""
    if not do_sample:
        return scores.argmax(dim=-1)
    return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)[:, 0]


def accepted_lengths(drafts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Greedy rule. drafts (B, k), targets (B, k+1) from the verify pass: per row, the number of leading drafts
    equal to the verifier's own choice. The verifier's token after them is the bonus (or correction) token."""
    k = drafts.shape[-1]
    if k == 0:
        return torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device)
    mismatch = drafts != targets[:, :k]
    # cumprod of "still matching" counts the run of matches from the start
    return (~mismatch).long().cumprod(dim=-1).sum(dim=-1)


def greedy_accept(drafts: torch.Tensor, target_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: keep drafts while they equal the verifier's argmax; emit the verifier's own tokens."""
    targets = target_scores.argmax(dim=-1)  # (B, k+1)
    return accepted_lengths(drafts, targets), targets


def speculative_accept(
    drafts: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al., 2023, Alg. 1), batched: emitted tokens are distributed exactly as
    samples from the verifier's distribution `target_probs`, whatever the draft distribution was.

    drafts (B, k) were sampled from draft_probs (B, k, V); target_probs (B, k+1, V). Draft i is kept with
    probability min(1, p_i(x) / q_i(x)); the first rejected position draws from the residual norm(max(p - q, 0)),
    and a row that kept every draft draws its bonus token from p_k.
    """
    batch, k = drafts.shape
    rows = torch.arange(batch, device=drafts.device)
    if k:
        p = target_probs[:, :k].gather(-1, drafts[..., None])[..., 0]
        q = draft_probs.gather(-1, drafts[..., None])[..., 0]
        # u < p / q without dividing by q; a draft its q gives no mass was not drawn from q (a row's padding
        # past what it may emit) and is never kept, so that position draws from p itself
        keep = (torch.rand_like(p) * q < p) & (q > 0)
        accepted = keep.long().cumprod(dim=-1).sum(dim=-1)
    else:
        accepted = torch.zeros(batch, dtype=torch.long, device=drafts.device)
    # q is zero after the last draft, so the residual there is p itself: the bonus token needs no special case
    q_padded = torch.zeros_like(target_probs)
    if k:
        q_padded[:, :k] = draft_probs
    p_next, q_next = target_probs[rows, accepted], q_padded[rows, accepted]
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q leaves no residual, but then no draft can be rejected; guard only against rounding
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p_next)
    last = torch.multinomial(residual, num_samples=1)[:, 0]
    tokens = torch.cat([drafts, last[:, None]], dim=-1)
    tokens[rows, accepted] = last
    return accepted, tokens


def accept_uniformly(
    accepted: torch.Tensor, tokens: torch.Tensor, rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rule's `(accepted, tokens)` with every row cut to m drafts, the fewest that any of `rows` (the rows still
    generating) kept: the rule for a model that numbers a pass's tokens from its cache's length, where rows that grew
    by different counts would sit at other positions than stock `generate` gives them. Rows not in `rows` are cut
    too; they emit nothing.

    The tokens stay as the rule chose them. A row that kept more than m drafts emits its first m, then its own draft
    m, which the rule accepted: under greedy that is the verifier's argmax, and under sampling it is what speculative
    sampling emits at m. A row that kept exactly m emits its bonus or correction token. Sampling stays exact because
    whether a row's token at position j is emitted depends on its drafts before j and on the other rows, never on
    that token. A fresh draw from the verifier at m would not be exact: the accepted draft carries the share
    min(p, q) of the verifier's distribution that the residual leaves out.
    """
    if not rows:
        return accepted, tokens
    return accepted.clamp(max=int(accepted[rows].min())), tokens


def proposal_accept(
    proposals: torch.Tensor, offered: torch.Tensor, scores: torch.Tensor, do_sample: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft tier's check of a proposer's tokens (hierarchical drafting), one row each.

    proposals (B, m) were offered after each row's input token, `offered` (B,) of them real (the rest padding);
    scores (B, m+1, V) are the draft tier's processed scores at the input token and at each proposal. Returns
    `kept` (B,), the leading proposals kept, and `own` (B,), the draft tier's token after them.

    Greedy keeps a proposal while it equals the draft tier's argmax, so the drafted tokens are the ones plain drafting
    would choose. Sampling treats the proposer as deterministic (its proposals are a function of the prefix) and runs
    speculative sampling against that point mass: keep x with probability p(x), else draw from p with x removed;
    after the last offered proposal draw from p. Either way each drafted token is distributed as the draft tier's p,
    which the full tier's speculative check then uses as the draft distribution, so the output stays exact.
    """
    batch, m = proposals.shape
    rows = torch.arange(batch, device=scores.device)
    offered, proposals = offered.to(scores.device), proposals.to(scores.device)
    if not do_sample:
        own_all = scores.argmax(dim=-1)  # (B, m+1)
        kept = torch.minimum(accepted_lengths(proposals, own_all), offered)  # padding is never kept
        return kept, own_all[rows, kept]
    in_range = torch.arange(m, device=scores.device)[None, :] < offered[:, None]
    probs = torch.softmax(scores, dim=-1)
    p_offered = probs[:, :m].gather(-1, proposals[..., None])[..., 0]
    agree = (torch.rand_like(p_offered) < p_offered) & in_range
    kept = agree.long().cumprod(dim=-1).sum(dim=-1)
    residual = probs[rows, kept].clone()
    rejected = kept < offered
    rejected_token = proposals[rows, kept.clamp(max=max(m - 1, 0))] if m else kept
    residual[rows[rejected], rejected_token[rejected]] = 0  # a rejected proposal is not drawn again
    residual = residual / residual.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(residual.dtype).tiny)
    return kept, torch.multinomial(residual, num_samples=1)[:, 0]
