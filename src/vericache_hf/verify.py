"""Accept rules as pure functions on tensors: which drafted tokens the full-cache model agrees with."""

from __future__ import annotations

import torch


def accepted_lengths(drafts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Greedy rule. drafts (B, k), targets (B, k+1) from the verify pass: per row, the number of leading drafts
    equal to the verifier's own choice. The verifier's token after them is the bonus (or correction) token."""
    k = drafts.shape[-1]
    if k == 0:
        return torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device)
    mismatch = drafts != targets[:, :k]
    # cumprod of "still matching" counts the run of matches from the start
    return (~mismatch).long().cumprod(dim=-1).sum(dim=-1)
