"""Accept rules as pure functions on tensors: which drafted tokens the full-cache model agrees with.

Both rules return `(accepted, tokens)`: `accepted` (B,) counts each row's leading drafts kept, and `tokens` (B, k+1)
holds what the row emits, `tokens[b, :accepted[b] + 1]` (the kept drafts, then a bonus or correction token).
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
        keep = torch.rand_like(p) * q < p  # u < p / q without dividing by q
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
