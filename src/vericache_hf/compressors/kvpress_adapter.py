"""kvpress adapter: any kvpress press that drops tokens builds the draft tier, called directly (no forward hooks).

On transformers 5.x kvpress's hooks fail (attention layers do not receive `cache_position`), so the adapter calls
the press itself at prefill: `press.score` for plain scorer presses (then a padding-aware top-k), else
`press.compress`, with the attention layer's own kwargs plus a `cache_position` made from `position_ids[0]`.
Presses that only mask keys (AdaKV, CriticalAdaKV, DMS, KVzip) save no memory and are rejected.

Per-layer budgets (PyramidKV, `PerLayerCompressionPress`): transformers builds one mask for all layers, so every
layer must hold the same number of slots, and a shared 2-D mask cannot mask a slot in one layer only. Layers
below the largest budget are therefore topped up with their most recent dropped tokens (real tokens, so no mask is
needed); the draft tier then holds the largest budget in every layer, and `nbytes` reports that.

Install: `pip install --no-deps kvpress` then `pip install "vericache-hf[kvpress]"` (kvpress pins transformers<5.3;
`--no-deps` keeps the newest transformers).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..cache.draft_tier import DraftStore, TokenStore
from ..checks import check_budget
from .base import CompressionContext, Compressor

#: Presses that mask keys instead of dropping them: the draft tier would be as large as the full cache.
MASKING_PRESSES = ("AdaKVPress", "CriticalAdaKVPress", "DMSPress", "KVzipPress", "FastKVzipPress")


def import_kvpress() -> Any:
    """Import kvpress without its global patch of transformers' attention functions (STYLE: no global patches).

    kvpress wraps every entry of `ALL_ATTENTION_FUNCTIONS` on import (for its key-masking presses, which VeriCache
    rejects anyway); the previous functions are put back so stock `generate` runs untouched code.
    """
    if importlib.util.find_spec("kvpress") is None:
        raise ImportError(
            'The kvpress adapter needs kvpress: `pip install --no-deps kvpress` and `pip install "vericache-hf[kvpress]"`.'
        )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415

    saved = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS}
    import kvpress  # noqa: PLC0415

    for name, function in saved.items():
        ALL_ATTENTION_FUNCTIONS[name] = function
    return kvpress


def is_press(obj: Any) -> bool:
    """True for a kvpress press instance (checked by module, so kvpress is not imported for other objects)."""
    return any(cls.__module__.startswith("kvpress.") for cls in type(obj).__mro__)


@dataclass
class LayerResult:
    """One layer's kept tokens, with the indices needed to top it up to the largest layer budget."""

    store: TokenStore
    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    indices: torch.Tensor | None  # (B, H, kept) original positions, None when the press transformed the keys
    # slots the press kept (a build from the full tier commits more to the store before the last layer's top-up)
    kept: int = field(init=False)

    def __post_init__(self) -> None:
        self.kept = self.store.length


@dataclass
class KVPressCompressor(Compressor):
    """Wrap a kvpress press as a VeriCache compressor: `VeriCacheConfig(compressor=SnapKVPress(0.75))`.

    Parameters:
        press: a kvpress press instance (its own compression_ratio is used).
        budget: tokens kept per layer, instead of the press's ratio (plain scorer presses only).
    """

    scores_with_queries: ClassVar[bool] = True
    reads_layer_inputs: ClassVar[bool] = True
    press: Any = None
    budget: int | None = None
    _layers: dict[int, LayerResult] = field(default_factory=dict, init=False, repr=False)
    _initialised_for: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        kvpress = import_kvpress()
        if not isinstance(self.press, kvpress.presses.base_press.BasePress):
            raise TypeError(
                f"KVPressCompressor.press must be a kvpress press, got {type(self.press).__name__}."
            )
        name = type(self.press).__name__
        if hasattr(self.press, "presses"):
            raise ValueError(
                f"{name} chains presses through kvpress's hooks, which VeriCache does not use. Pass a list instead: "
                "compressor=[press_a, press_b] (a query-aware press first)."
            )
        if name in MASKING_PRESSES:
            raise ValueError(
                f"{name} only masks keys, so its draft tier would be as large as the full cache and save nothing. "
                "Use a press that drops tokens (SnapKVPress, KnormPress, PyramidKVPress, ...)."
            )
        check_budget(type(self).__name__, self.budget)
        self._scorer = self._plain_scorer(kvpress)
        if self.budget is not None and self._scorer is None:
            raise ValueError(f"budget= works with plain scorer presses only; set {name}'s own ratio instead.")

    def _plain_scorer(self, kvpress) -> Any:
        """The press whose `score` can be used with our top-k, or None when the press does its own selection."""
        scorer = kvpress.presses.scorer_press.ScorerPress
        if isinstance(self.press, scorer) and type(self.press).compress is scorer.compress:
            return self.press
        return None

    # ------------------------------------------------------------------------------------------- one layer

    def _press_kwargs(self, context: CompressionContext) -> dict[str, Any]:
        kwargs = dict(context.attention_kwargs)
        positions = kwargs.get("position_ids")
        if positions is None:
            model = type(context.model).__name__ if context.model is not None else "this model"
            raise ValueError(
                f"kvpress {type(self.press).__name__} reads the token positions that attention is handed, but "
                f"{model}'s attention layers are handed none. Use a compressor of this library (snapkv, h2o, knorm, streaming_llm, kivi, ...) with this model."
            )
        kwargs["cache_position"] = positions[0]
        return kwargs

    def _prepare(self, context: CompressionContext) -> None:
        model = context.model
        if model is None:
            raise ValueError(
                "KVPressCompressor needs the model in its CompressionContext (run it through generate)."
            )
        if self._initialised_for != id(model):
            self.press.post_init_from_model(model)
            self._initialised_for = id(model)

    def _run(self, keys, values, context: CompressionContext):
        module, hidden, kwargs = context.module, context.hidden_states, self._press_kwargs(context)
        added = not hasattr(module, "rotary_emb")
        if added:  # ExpectedAttention and KeyRerotation read it, as kvpress's own context manager sets it
            rotary = getattr(getattr(context.model, "model", None), "rotary_emb", None)
            if rotary is None:
                raise ValueError(
                    f"kvpress {type(self.press).__name__} needs the model's rotary embedding at model.model.rotary_emb, "
                    f"which {type(context.model).__name__} does not have. Use a compressor of this library "
                    "(snapkv, h2o, knorm, streaming_llm, kivi, ...) with this model."
                )
            module.rotary_emb = rotary
        try:
            press = self.press
            ratios = getattr(press, "compression_ratios", None)
            if ratios is not None:  # PerLayerCompressionPress applies its ratios only in its hook
                press = press.press
                saved, press.compression_ratio = press.compression_ratio, ratios[context.layer_idx]
            try:
                if self._scorer is not None:
                    return self._scorer.score(module, hidden, keys, values, None, kwargs), None, None
                return None, *press.compress(module, hidden, keys, values, None, kwargs)
            finally:
                if ratios is not None:
                    press.compression_ratio = saved
        except (AssertionError, AttributeError, KeyError, TypeError, RuntimeError) as error:
            raise ValueError(
                f"kvpress {type(self.press).__name__} failed when called directly at prefill ({error!r}). Presses "
                "that need attention weights (eager attention) or other hook-time state are not supported."
            ) from error
        finally:
            if added:
                del module.rotary_emb
            if getattr(module, "masked_key_indices", None) is not None:
                del module.masked_key_indices
                raise ValueError(
                    f"{type(self.press).__name__} masks keys instead of dropping them; it saves nothing."
                )

    def _kept(self, length: int) -> int:
        if self.budget is not None:
            return min(length, self.budget)
        return max(1, int(length * (1 - self.press.compression_ratio)))  # kvpress's compute_n_kept

    def check_layer(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> None:
        """kvpress re-derives what it scores with from the layer's modules, which not every family has: run the
        press on the first layer at the prefill, so that a family it cannot score is refused before any token."""
        self.compress(keys, values, context)

    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> DraftStore:
        return self._finish(self._layer(keys, values, context), context)

    def select(self, keys, values, context: CompressionContext):
        """Kept keys/values and validity, for use as a stage of a `ComposedCompressor` (equal budgets only)."""
        result = self._layer(keys, values, context)
        return (
            result.store.keys[:, :, : result.store.length],
            result.store.values[:, :, : result.store.length],
            result.store.valid,
        )

    def _layer(self, keys, values, context: CompressionContext) -> LayerResult:
        self._prepare(context)
        valid = context.valid.to(keys.device)
        scores, kept_keys, kept_values = self._run(keys, values, context)
        if scores is not None:
            scores = scores.float().masked_fill(~valid[:, None, :], float("-inf"))
            indices = scores.topk(self._kept(keys.shape[-2]), dim=-1).indices.sort(dim=-1).values
            kept_keys, kept_values = gather(keys, indices), gather(values, indices)
        else:
            indices = match_indices(keys, kept_keys)
            if indices is not None:
                indices, order = indices.sort(dim=-1)
                kept_keys, kept_values = gather(kept_keys, order), gather(kept_values, order)
            elif not bool(valid.all()):
                raise ValueError(
                    f"{type(self.press).__name__} changes the kept keys, so padded slots cannot be tracked; "
                    "run it with unpadded prompts (batch 1 or equal lengths)."
                )
        kept_valid = (
            valid.gather(1, indices[:, 0]) if indices is not None else valid[:, : kept_keys.shape[-2]]
        )
        store = TokenStore(kept_keys, kept_values, kept_valid)
        return LayerResult(store, keys, values, valid, indices)

    # ----------------------------------------------------------------------------------- equal slot counts

    def _finish(self, result: LayerResult, context: CompressionContext) -> DraftStore:
        """Record the layer; at the last layer, top every layer up to the largest slot count."""
        if context.layer_idx == 0:
            self._layers.clear()
        self._layers[context.layer_idx] = result
        if context.layer_idx == context.model.config.num_hidden_layers - 1:
            layers, self._layers = self._layers, {}
            target = max(r.kept for r in layers.values())
            for r in layers.values():
                if r.kept < target:
                    top_up(r, target)
        return result.store


def gather(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x.gather(2, indices.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))


def match_indices(keys: torch.Tensor, kept: torch.Tensor) -> torch.Tensor | None:
    """Original positions (B, H, kept) of gathered keys; None when a kept key is not an exact copy of an original
    one (the press transformed it). Candidates come from a random projection, then the full vectors must match."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    direction = torch.randn(keys.shape[-1], generator=generator, dtype=torch.float64).to(keys.device)
    original = (keys.double() * direction).sum(-1)  # (B, H, T)
    probe = (kept.double() * direction).sum(-1)  # (B, H, k)
    sorted_original, order = original.sort(dim=-1)
    right = torch.searchsorted(sorted_original, probe).clamp(max=original.shape[-1] - 1)
    left = (right - 1).clamp(min=0)
    nearer_left = (sorted_original.gather(-1, left) - probe).abs() < (
        sorted_original.gather(-1, right) - probe
    ).abs()
    indices = order.gather(-1, torch.where(nearer_left, left, right))
    if not torch.equal(gather(keys, indices), kept):
        return None
    return indices


def top_up(result: LayerResult, target: int) -> None:
    """Add the layer's most recent dropped tokens until its kept slots number `target` (all rows and heads alike).
    Slots its store took after the compression (a build from the full tier commits the tokens decoded since the
    prompt layer by layer, before the last layer is compressed) stay after the kept ones."""
    if result.indices is None:
        raise ValueError(
            "This press keeps a different number of tokens per layer and changes the kept keys, so layers cannot be "
            "topped up to equal slot counts. Use a press that gathers tokens unchanged."
        )
    batch, heads, length = result.keys.shape[:3]
    dropped = torch.ones((batch, heads, length), dtype=torch.bool, device=result.keys.device)
    dropped.scatter_(-1, result.indices, False)
    recency = torch.arange(length, device=dropped.device).expand_as(dropped).masked_fill(~dropped, -1)
    extra = recency.topk(target - result.indices.shape[-1], dim=-1).indices
    indices = torch.cat([result.indices, extra], dim=-1).sort(dim=-1).values
    fresh = TokenStore(
        gather(result.keys, indices), gather(result.values, indices), result.valid.gather(1, indices[:, 0])
    )
    store, later = result.store, slice(result.kept, result.store.length)
    if later.start < later.stop:
        fresh.commit(store.keys[:, :, later], store.values[:, :, later], store.valid_slots[:, later])
    store.__dict__.update(fresh.__dict__)
