"""H2O: keep the heavy hitters, the tokens that received the most attention over the prompt, plus a recent window.

Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models". Every
prompt query's causal attention is accumulated per key (summed over the queries and the query heads sharing a KV
head), computed from the layer's own queries.

On a CPU the sums come from two passes of torch's blocked (flash) attention kernel, which returns each row's
log-sum-exp and never holds a T x T matrix: the first gives each query's normaliser lse_i, the second runs the keys
as queries over the queries, with the sequence reversed (so "later queries" is causal) and -lse_i added to each
column's logit (in an extra head dimension), so that its log-sum-exp is log sum_i exp(s q_i . k_j - lse_i), the
key's accumulated attention. Padding is a large negative logit on its columns. Elsewhere (no such kernel) the
attention matrix is built in query chunks, so memory stays O(chunk x T).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..checks import check_int
from .base import CompressionContext, ScorerCompressor
from .snapkv import received_attention, scored_keys, window_queries


@dataclass
class H2OCompressor(ScorerCompressor):
    """Accumulated attention over the prompt, top-k per KV head; the last `recent_size` tokens are always kept.

    Parameters:
        compression_ratio: fraction of the prompt's tokens removed.
        recent_size: final prompt tokens always kept (H2O's recent window).
        chunk_size: prompt queries scored at once (bounds the attention matrix held in memory).
    """

    scores_with_queries: ClassVar[bool] = True
    compression_ratio: float = 0.5
    recent_size: int = 32
    chunk_size: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("H2OCompressor.recent_size", self.recent_size, 0)
        check_int("H2OCompressor.chunk_size", self.chunk_size, 1)

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        # a layer attending inline handed over its attention, summed over its queries already
        scores = received_attention(context, keys)
        if scores is None:
            keys = scored_keys(keys, context)
            length = keys.shape[-2]
            queries = window_queries(context, length).float()  # (B, H_q, T, D)
            valid = context.valid.to(keys.device)
            accumulate = _accumulated_flash if keys.device.type == "cpu" else self._accumulated_chunked
            scores = accumulate(queries, keys.float(), valid, context.scaling)
        if self.recent_size:
            scores[..., -self.recent_size :] = scores.max() + 1
        return scores

    def _accumulated_chunked(self, queries, keys, valid, scaling: float) -> torch.Tensor:
        """(B, H_kv, T) accumulated attention, the attention matrix built `chunk_size` queries at a time."""
        batch, kv_heads, length, dim = keys.shape
        # the query heads that share a KV head go side by side, so one matmul per KV head serves them all
        queries = queries.view(batch, kv_heads, -1, length, dim)
        keys_t = keys.transpose(-1, -2)[:, :, None]  # (B, H_kv, 1, D, T)
        key_pos = torch.arange(length, device=keys.device)
        scores = keys.new_zeros((batch, kv_heads, length))
        for start in range(0, length, self.chunk_size):
            stop = min(start + self.chunk_size, length)  # causal: these queries see keys [0, stop) only
            # (B, H_kv, group, chunk, stop)
            logits = queries[..., start:stop, :] @ keys_t[..., :stop] * scaling
            causal = key_pos[None, :stop] <= torch.arange(start, stop, device=keys.device)[:, None]
            allowed = causal[None, None, None] & valid[:, None, None, None, :stop]
            # a real query always sees itself, so a finite fill never leaves it a row of nothing; padding queries'
            # rows are zeroed below
            weights = logits.masked_fill_(~allowed, torch.finfo(logits.dtype).min).softmax(-1)
            weights = weights * valid[:, None, None, start:stop, None]
            scores[..., :stop] += weights.sum((2, 3))
        return scores


_FAR = -1e9  # a logit whose exp is 0 in float32: padding, as keys and as queries


def _accumulated_flash(queries, keys, valid, scaling: float) -> torch.Tensor:
    """(B, H_kv, T) accumulated attention from two passes of the CPU flash kernel (see the module docstring)."""
    batch, heads, length, _ = queries.shape
    kv_heads = keys.shape[1]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # (B, H_q, T, D)
    ones = queries.new_ones(batch, heads, length, 1)

    def log_sum_exp(rows, columns, bias):  # log sum_c exp(s * rows . columns + bias_c), causal: (B, H_q, T)
        # the bias rides in an extra head dimension (rows 1, columns bias / s): a mask would be expanded to T x T
        rows, columns = torch.cat([rows, ones], -1), torch.cat([columns, bias[..., None] / scaling], -1)
        return _flash(rows, columns, columns, is_causal=True, scale=scaling)[1]

    padding = torch.where(valid, 0.0, _FAR)[:, None].expand(batch, heads, length)
    normaliser = log_sum_exp(queries, keys, padding)  # each query's lse over the keys it sees
    # the keys as rows over the queries, reversed so that "the queries at or after the key" is causal
    weights = torch.where(valid[:, None], -normaliser, _FAR)
    per_head = log_sum_exp(keys.flip(2), queries.flip(2), weights.flip(-1)).flip(-1).exp()
    return per_head.view(batch, kv_heads, -1, length).sum(2) * valid[:, None]


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
