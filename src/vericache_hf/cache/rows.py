"""Rows joining and leaving a `VeriCache` between rounds: what lets requests share forward passes (a cohort, see
`serving/cohort.py`) while each joins after its own prefill and leaves when it stops.

Neither runs a forward pass. The full tier changes in place (`HostKVStore.add_rows` and `keep_rows`): a joining row
is written after the stored ones, each padded with masked slots to the longer length (positions are explicit, so a
masked slot never shifts a row's rotary phase), and rows that stay are moved up over the ones that leave. The draft
tier of a compressor that works from K/V alone is left to be rebuilt from the new full tier
(`DraftTierLifecycle.build`, the next time drafting needs it); a query-aware compressor's token-dropped tier is
carried over through its `export`/`restore`, since it cannot be rebuilt (a deferred one is built first,
`build_carried_tier`). A window layer (`window.py`) holds the tail of the full tier's layout: its rows move with the
full tier's, each with the count of real tokens it dropped, and it reaches back far enough in the new layout for
every row's window.
Call them between rounds only: no pass in flight, no drafts, no pending tokens.
"""

from __future__ import annotations

import torch

from .draft_tier import DraftStore, TokenStore
from .vericache import VeriCache
from .window import WindowLayer


def can_share_rows(cache: VeriCache) -> bool:
    """Whether rows of this cache can join or leave others: its draft tier can be rebuilt from the full tier, or
    is a plain token-dropped store that `restore` reads back (SnapKV, H2O). kvpress presses and query-aware
    compositions that quantize cannot."""
    if cache.draft_tier.rebuildable:
        return True
    return cache.compressor.restorable and all(type(layer.draft) is TokenStore for layer in cache.tiered)


def build_carried_tier(cache: VeriCache) -> None:
    """Build a query-aware compressor's deferred draft tier now (`DraftTierLifecycle.defers_compression`): rows
    carry it over through `restore` and could not build it once they move. Call before a cache's rows join a
    cohort."""
    if not cache.draft_tier.rebuildable and not cache.draft_tier.held and cache.draft_tier.buildable:
        cache.draft_tier.build()


def join(cache: VeriCache, others: list[VeriCache]) -> None:
    """Add every row of `others` after `cache`'s own, in place (its stats, settings and transfer queue stay)."""
    for each in (cache, *others):
        _check_between_rounds(each)
    valid = cache.full_valid
    for other in others:
        length = max(valid.shape[-1], other.full_valid.shape[-1])
        valid = torch.cat(
            [_pad(valid, length, 1, False, left=False), _pad(other.full_valid, length, 1, False)]
        )
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, WindowLayer):
            _join_windows(cache, i, others)
            continue
        for other in others:
            layer.full.add_rows(*other.layers[i].full.view())
        if cache.draft_tier.rebuildable:
            layer.draft = None  # rebuilt from the joined full tier when drafting next needs it
        else:
            stores = [layer.draft, *(other.layers[i].draft for other in others)]
            layer.draft = cache.compressor.restore(_stacked_state(stores))
    cache.rows_changed(valid)


def keep(cache: VeriCache, rows: list[int]) -> None:
    """Keep only `rows` (ascending) of `cache`, in place. Slots that no kept row holds are dropped once they are
    at least half the tier (moving the rest costs a copy of the tier, so not at every row that leaves)."""
    _check_between_rounds(cache)
    valid = cache.full_valid[rows]
    dead = _leading_dead(valid)
    drop = dead if 2 * dead >= valid.shape[-1] else 0
    for layer in cache.layers:
        if isinstance(layer, WindowLayer):
            index = torch.tensor(rows, device=layer.store.keys.device)
            cut = max(0, drop - (cache.full_valid.shape[-1] - layer.length))  # the dropped slots it holds
            layer.hold(*layer.rows(index, cut))
            continue
        layer.full.keep_rows(rows, drop)
        if cache.draft_tier.rebuildable:
            layer.draft = None
        else:
            layer.draft = cache.compressor.restore(_selected_state(layer.draft, torch.tensor(rows)))
    cache.rows_changed(valid[:, drop:])


def copy_row(cache: VeriCache, row: int) -> VeriCache:
    """A new one-row cache holding a copy of `row` of `cache` (its stats, settings and transfer queue too)."""
    _check_between_rounds(cache)
    index = torch.tensor([row])
    valid = cache.full_valid[index]
    held = valid[0].nonzero()[:, 0]
    first, end = int(held[0]), int(held[-1]) + 1  # the row's masked slots in front and behind are left out
    full = []
    for layer in cache.layers:
        if isinstance(layer, WindowLayer):  # its slots from `first` on, up to `end`
            start = cache.full_valid.shape[-1] - layer.length
            full.append(layer.rows(index, max(first - start, 0), end - start))
        else:
            full.append(tuple(kv[index][:, :, first:end] for kv in layer.full.view()))
    drafts = None
    if not cache.draft_tier.rebuildable:
        drafts = [
            cache.compressor.restore(_selected_state(layer.draft, index)) if layer in cache.tiered else None
            for layer in cache.layers
        ]
    return _rebuilt(cache, full, valid[:, first:end], drafts)


def _join_windows(cache: VeriCache, index: int, others: list[VeriCache]) -> None:
    """Stack the window layer `index` of the joining caches under `cache`'s, as `HostKVStore.add_rows` stacks full
    tiers: one cache at a time, the stored rows padded behind to the longer layout, the joining rows in front. A
    window is its layout's tail, so only the padding behind it moves it; the stack reaches back as far as the
    farthest-reaching window."""
    keys, values, valid, dropped = cache.layers[index].view()
    length = cache.full_valid.shape[-1]
    for other in others:
        other_keys, other_values, other_valid, other_dropped = other.layers[index].view()
        dropped = torch.cat([dropped, other_dropped.to(dropped.device)])
        joined = max(length, other.full_valid.shape[-1])
        size = valid.shape[-1] + joined - length
        span = max(size, other_valid.shape[-1])
        keys = torch.cat([_pad(_pad(keys, size, 2, 0, left=False), span, 2, 0), _pad(other_keys, span, 2, 0)])
        values = torch.cat(
            [_pad(_pad(values, size, 2, 0, left=False), span, 2, 0), _pad(other_values, span, 2, 0)]
        )
        valid = torch.cat(
            [_pad(_pad(valid, size, 1, False, left=False), span, 1, False), _pad(other_valid, span, 1, False)]
        )
        length = joined
    cache.layers[index].hold(keys, values, valid, dropped)


def _check_between_rounds(cache: VeriCache) -> None:
    if cache.phase != "idle" or cache.prefix_load.loading or any(layer.pending for layer in cache.layers):
        raise RuntimeError("rows join or leave a VeriCache between rounds only (no pass or load in flight).")
    build_carried_tier(cache)
    if not can_share_rows(cache):
        raise ValueError(
            f"{type(cache.compressor).__name__}'s draft tier can neither be rebuilt from the full tier nor carried "
            "over row by row, so its requests cannot share a cohort; serve them alone (cohort_size=1)."
        )


def _pad(tensor: torch.Tensor, length: int, dim: int, fill, left: bool = True) -> torch.Tensor:
    """`tensor` padded along `dim` to `length` with `fill`, in front (left) or behind."""
    missing = length - tensor.shape[dim]
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    padding = tensor.new_full(shape, fill)
    return torch.cat([padding, tensor] if left else [tensor, padding], dim=dim)


def _leading_dead(valid: torch.Tensor) -> int:
    """How many leading slots of (B, T) `valid` no row holds."""
    return int(valid.any(dim=0).long().argmax())


def _stacked_state(stores: list[DraftStore]) -> dict[str, torch.Tensor]:
    states = [store.export() for store in stores]
    length = max(state["valid"].shape[-1] for state in states)
    return {
        "keys": torch.cat([_pad(state["keys"], length, 2, 0) for state in states]),
        "values": torch.cat([_pad(state["values"], length, 2, 0) for state in states]),
        "valid": torch.cat([_pad(state["valid"], length, 1, False) for state in states]),
    }


def _selected_state(store: DraftStore, index: torch.Tensor) -> dict[str, torch.Tensor]:
    state = store.export()
    valid = state["valid"][index.to(state["valid"].device)]
    first = _leading_dead(valid)
    rows = index.to(state["keys"].device)
    return {
        "keys": state["keys"][rows][:, :, first:],
        "values": state["values"][rows][:, :, first:],
        "valid": valid[:, first:],
    }


def _rebuilt(
    template: VeriCache,
    full: list[tuple[torch.Tensor, ...]],
    valid: torch.Tensor,
    drafts: list[DraftStore] | None,
) -> VeriCache:
    """A cache with `template`'s settings, stats and transfer queue, holding the given full tier (each layer's
    (B, H, T, D) keys and values, `valid` (B, T); a window layer's keys, values, validity and dropped tokens of its
    own) and draft tier (None: rebuilt when drafting next needs it)."""
    cache = VeriCache(
        len(template.layers),
        template.compressor,
        stats=template.stats,
        chunk_tokens=template.chunk_tokens,
        staging_chunk_tokens=template.stream.staging_chunk_tokens,
        verify_attention=template.verify_attention,
        transfers=template.stream.transfers,
        refresh_policy=template.draft_tier.refresh_policy,
        stage_on_cpu=template.stage_on_cpu,
        windowed={layer.layer_idx: layer.window for layer in template.windowed},
        chunked=template.chunked,
        verify_window=template.verify_window,
    )
    for i, (layer, old) in enumerate(zip(cache.layers, template.layers, strict=True)):
        if isinstance(layer, WindowLayer):
            layer.hold(*full[i])
            continue
        like = torch.empty(0, dtype=old.dtype, device=old.device)
        layer.lazy_initialization(like, like)
        layer.full.append(*full[i])
        layer.draft = drafts[i] if drafts is not None else None
    # the rows' count towards a refresh goes on
    cache.draft_tier.refresh_clock = template.draft_tier.refresh_clock
    cache.rows_changed(valid)
    return cache
