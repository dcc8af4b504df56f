"""Rows joining and leaving a `VeriCache` between rounds: what lets requests share forward passes (a cohort, see
`cohort.py`) while each joins after its own prefill and leaves when it stops.

Both operations build a new cache from the old ones' committed state; neither runs a forward pass. Rows are aligned
on the right, as left padding aligns a batch: a shorter row gets masked slots in front (its positions are explicit,
so padding never shifts its rotary phase). The full tier is copied row by row; slots that no row holds any more are
trimmed. The draft tier of a compressor that works from K/V alone is left to be rebuilt from the new full tier
(`build_draft_tier`, the next time drafting needs it); a query-aware compressor's token-dropped tier is carried over
through its `export`/`restore`, since it cannot be rebuilt. Call them between rounds only: no pass in flight, no
drafts, no pending tokens.
"""

from __future__ import annotations

import torch

from ..stats import VeriCacheStats
from .draft_tier import DraftStore, TokenStore
from .vericache import VeriCache

#: What a token-dropped tier's `export` holds: its slots and their validity, laid out like the full tier's.
TOKEN_STATE = {"keys", "values", "valid"}


def can_share_rows(cache: VeriCache) -> bool:
    """Whether rows of this cache can join or leave others: its draft tier can be rebuilt from the full tier, or
    is a plain token-dropped store that `restore` reads back (SnapKV, H2O). kvpress presses and query-aware
    compositions that quantize cannot."""
    if cache.draft_tier_rebuildable:
        return True
    return cache.compressor.restorable and all(type(layer.draft) is TokenStore for layer in cache.layers)


def stack(caches: list[VeriCache], stats: VeriCacheStats | None = None) -> VeriCache:
    """One cache holding every row of `caches`, in order, counting into `stats` (by default the first's; its
    settings and transfer queue too)."""
    for cache in caches:
        _check_between_rounds(cache)
    first = caches[0]
    length = max(cache.full_valid.shape[-1] for cache in caches)
    valid = torch.cat([_pad_left(cache.full_valid, length, 1, False) for cache in caches])
    full = [
        tuple(
            torch.cat([_pad_left(kv, length, 2, 0) for kv in side])
            for side in zip(*(cache.layers[i].full.view() for cache in caches), strict=True)
        )
        for i in range(len(first.layers))
    ]
    drafts = None
    if not first.draft_tier_rebuildable:
        drafts = [
            first.compressor.restore(_stacked_state([cache.layers[i].draft for cache in caches]))
            for i in range(len(first.layers))
        ]
    return _rebuilt(first, full, valid, drafts, stats or first.stats)


def select(cache: VeriCache, rows: list[int]) -> VeriCache:
    """A cache holding only `rows` of `cache`, in that order, without the slots none of them holds."""
    _check_between_rounds(cache)
    index = torch.tensor(rows, dtype=torch.long)
    valid = cache.full_valid[index]
    first = int(valid.any(dim=0).long().argmax())  # leading slots no kept row holds
    full = [tuple(kv[index][:, :, first:] for kv in layer.full.view()) for layer in cache.layers]
    drafts = None
    if not cache.draft_tier_rebuildable:
        drafts = [cache.compressor.restore(_selected_state(layer.draft, index)) for layer in cache.layers]
    return _rebuilt(cache, full, valid[:, first:], drafts, cache.stats)


def _check_between_rounds(cache: VeriCache) -> None:
    if cache.phase != "idle" or cache.full_tier_loading or any(layer.pending for layer in cache.layers):
        raise RuntimeError("rows join or leave a VeriCache between rounds only (no pass or load in flight).")
    if not can_share_rows(cache):
        raise ValueError(
            f"{type(cache.compressor).__name__}'s draft tier can neither be rebuilt from the full tier nor carried "
            "over row by row, so its requests cannot share a cohort; serve them alone (cohort_size=1)."
        )


def _pad_left(tensor: torch.Tensor, length: int, dim: int, fill) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_full(shape, fill), tensor], dim=dim)


def _stacked_state(stores: list[DraftStore]) -> dict[str, torch.Tensor]:
    states = [store.export() for store in stores]
    length = max(state["valid"].shape[-1] for state in states)
    return {
        "keys": torch.cat([_pad_left(state["keys"], length, 2, 0) for state in states]),
        "values": torch.cat([_pad_left(state["values"], length, 2, 0) for state in states]),
        "valid": torch.cat([_pad_left(state["valid"], length, 1, False) for state in states]),
    }


def _selected_state(store: DraftStore, index: torch.Tensor) -> dict[str, torch.Tensor]:
    state = store.export()
    valid = state["valid"][index.to(state["valid"].device)]
    first = int(valid.any(dim=0).long().argmax())
    rows = index.to(state["keys"].device)
    return {
        "keys": state["keys"][rows][:, :, first:],
        "values": state["values"][rows][:, :, first:],
        "valid": valid[:, first:],
    }


def _rebuilt(
    template: VeriCache,
    full: list[tuple[torch.Tensor, torch.Tensor]],
    valid: torch.Tensor,
    drafts: list[DraftStore] | None,
    stats: VeriCacheStats,
) -> VeriCache:
    """A cache with `template`'s settings, stats and transfer queue, holding the given full tier (each layer's
    (B, H, T, D) keys and values, `valid` (B, T)) and draft tier (None: rebuilt when drafting next needs it)."""
    cache = VeriCache(
        len(template.layers),
        template.compressor,
        stats=stats,
        chunk_tokens=template.chunk_tokens,
        transfers=template.transfers,
        refresh_policy=template.refresh_policy,
        stage_on_cpu=template.stage_on_cpu,
    )
    for i, (layer, old) in enumerate(zip(cache.layers, template.layers, strict=True)):
        like = torch.empty(0, dtype=old.dtype, device=old.device)
        layer.lazy_initialization(like, like)
        layer.full.append(*full[i])
        layer.draft = drafts[i] if drafts is not None else None
    cache.adopt_rows(valid)
    return cache
