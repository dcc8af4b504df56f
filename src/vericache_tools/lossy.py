"""Compressed-only decoding: greedy decoding that reads nothing but the draft tier, with no verification.

This is what a lossy method alone would produce. Benchmarks and demos compare it with full-cache output (where does
it first diverge?) to show what VeriCache's verification buys. Each generated token's K/V, computed on the
compressed context, is committed to the draft tier at once, so windowing and quantization act on it as they would in
a lossy-only system.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from vericache_hf.attention import CAPTURE_KWARG
from vericache_hf.cache import DraftStore
from vericache_hf.cache.capture import QueryCapture
from vericache_hf.cache.compressor import CompressionContext
from vericache_hf.compat import cache_kwargs
from vericache_hf.compressors import Compressor, build_compressor
from vericache_hf.pass_model import pass_model

__all__ = ["LossyCache", "compressed_only_generate", "first_divergence"]


class LossyLayer(CacheLayerMixin):
    """One layer of a draft tier used on its own: the prompt is compressed, each new token committed at once."""

    is_sliding = False

    def __init__(self, layer_idx: int, owner: LossyCache) -> None:
        super().__init__()
        self.layer_idx, self.owner = layer_idx, owner
        self.draft: DraftStore | None = None
        self.prompt_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.owner.mode == "prefill":
            if (
                self.owner.capture is not None
            ):  # compressed when the layer's queries arrive (`prompt_queries`)
                self.prompt_kv = key_states, value_states
            else:
                context = CompressionContext(layer_idx=self.layer_idx, valid=self.owner.prompt_valid)
                self.draft = self.owner.compressor.compress(key_states, value_states, context)
            return key_states, value_states
        valid = key_states.new_ones(key_states.shape[:1] + key_states.shape[2:3], dtype=torch.bool)
        self.draft.commit(key_states, value_states, valid)
        return self.draft.extend_draft(key_states[:, :, :0], value_states[:, :, :0])

    def get_seq_length(self) -> int:
        return self.draft.num_committed if self.draft is not None else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class LossyCache(Cache):
    """A `Cache` made only of draft-tier stores (no full tier). `mode` is `prefill`, then `decode`. During a
    prefill whose compressor scores with the layers' queries, `capture` hands them over (see `prompt_queries`)."""

    def __init__(self, num_layers: int, compressor: Compressor) -> None:
        self.compressor = compressor
        self.mode = "prefill"
        self.prompt_valid: torch.Tensor | None = None
        self.capture: QueryCapture | None = None
        super().__init__(layers=[LossyLayer(i, self) for i in range(num_layers)])

    def pass_kwargs(self) -> dict:
        return {CAPTURE_KWARG: self.capture} if self.capture is not None else {}

    def prompt_queries(self, context: CompressionContext) -> None:
        """A prefill layer's queries arrived: compress its prompt K/V with them."""
        layer = self.layers[context.layer_idx]
        keys, values = layer.prompt_kv
        layer.prompt_kv = None
        layer.draft = self.compressor.compress(keys, values, context)

    def attention_mask(self, query_length: int) -> torch.Tensor:
        committed = self.layers[0].draft.valid
        fresh = committed.new_ones((committed.shape[0], query_length))
        return torch.cat([committed, fresh], dim=-1).long()

    def draft_tier_bytes(self) -> int:
        return sum(layer.draft.nbytes() for layer in self.layers if layer.draft is not None)


@torch.no_grad()
def compressed_only_generate(
    model,
    input_ids: torch.Tensor,
    compressor: str | Compressor | list,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    compression_ratio: float = 0.75,
    compression_budget: int | None = None,
    streamer=None,
) -> torch.Tensor:
    """Greedy decoding on the compressed (draft-tier) cache alone; returns (B, prompt + max_new_tokens) token ids.

    `compressor` is anything `VeriCacheConfig(compressor=...)` takes (a name, an instance, a kvpress press or a
    list to compose); a name uses `compression_ratio` (or `compression_budget` tokens). `attention_mask` marks left padding. No EOS handling: every
    row runs `max_new_tokens` steps, so outputs line up with `generate(..., min_new_tokens=max_new_tokens)`.
    `streamer` (a transformers streamer: `put`, `end`) gets the prompt, then each new token, as `generate` does.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    compressor = build_compressor(compressor, compression_ratio, compression_budget)
    cache = LossyCache(model.config.num_hidden_layers, compressor)
    valid = (
        attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    )
    cache.prompt_valid = valid
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    model = pass_model(model)  # query-aware compressors (SnapKV) get each layer's queries from its attention
    if compressor.scores_with_queries:
        cache.capture = QueryCapture(
            valid,
            model,
            last=compressor.queries_read,
            inputs=compressor.reads_layer_inputs,
            on_layer=cache.prompt_queries,
        )
    logits = model(
        input_ids=input_ids,
        attention_mask=valid.long(),
        position_ids=positions,
        **cache_kwargs(model, cache),
        use_cache=True,
        logits_to_keep=1,
    ).logits
    cache.mode, cache.capture = "decode", None
    token = logits[:, -1].argmax(dim=-1)
    tokens = [token]
    if streamer is not None:
        streamer.put(token.cpu())
    next_position = positions[:, -1] + 1
    for _ in range(max_new_tokens - 1):
        logits = model(
            input_ids=token[:, None],
            position_ids=next_position[:, None],
            attention_mask=cache.attention_mask(1),
            **cache_kwargs(model, cache),
            use_cache=True,
        ).logits
        token = logits[:, -1].argmax(dim=-1)
        tokens.append(token)
        if streamer is not None:
            streamer.put(token.cpu())
        next_position = next_position + 1
    if streamer is not None:
        streamer.end()
    return torch.cat([input_ids, torch.stack(tokens, dim=-1)], dim=-1)


def first_divergence(reference: torch.Tensor, candidate: torch.Tensor, prompt_length: int) -> int:
    """Index (among generated tokens) of the first token where `candidate` differs from `reference` in row 0;
    the number of compared tokens when they agree throughout."""
    ref, cand = reference[0, prompt_length:], candidate[0, prompt_length:]
    length = min(ref.shape[-1], cand.shape[-1])
    mismatch = (ref[:length] != cand[:length]).nonzero()
    return int(mismatch[0, 0]) if len(mismatch) else length
