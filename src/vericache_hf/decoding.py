"""`generate`: the VeriCache decoding method, in the form transformers calls a `custom_generate` callable.

`model.generate(..., custom_generate=vericache_hf.generate, vericache_config=...)` runs all of stock generate's
preparation (config merge, masks, positions, processors, stopping criteria) and then this function.
`generation_mode="vericache"` (see `registration.py`) arrives here the same way.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache.rows import build_carried_tier, can_share_rows
from .cache.vericache import VeriCache
from .compat import CACHE_OUTPUT_FIELD
from .compressors import build_compressor
from .config import VeriCacheConfig
from .drafting.draft_model import draft_model
from .drafting.proposers import build_proposer
from .handoff import Cohorts, Member
from .layer_plan import cache_layout, check_compressor, text_config
from .loop import begin, decode, prefill_prefix, run_round
from .pass_model import pass_model
from .passes import DecodeIO, Sequences, counts_positions_from_cache
from .prefix.reuse import PrefixReuse
from .prefix.writer import flush
from .schedule.draft_length import draft_length_schedule
from .schedule.priors import priors_for
from .schedule.proposal_length import ProposalLength
from .stats import VeriCacheStats
from .validation import check_generation, check_model, check_prompt_inputs, check_shared_state


@dataclass
class VeriCacheGenerateOutput(GenerateDecoderOnlyOutput):
    """Stock `GenerateDecoderOnlyOutput` plus what the VeriCache run measured."""

    vericache_stats: VeriCacheStats | None = None


def resolve_config(vericache_config: Any, generation_config: GenerationConfig | None) -> VeriCacheConfig:
    """The call's `vericache_config`, else one saved in `generation_config.vericache_config`, else defaults."""
    if vericache_config is None and generation_config is not None:
        vericache_config = getattr(generation_config, "vericache_config", None)
    return VeriCacheConfig.from_any(vericache_config)


def _stack_steps(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Per-row lists of (V,) tensors -> one (B, V) tensor per step, rows that stopped earlier padded with zeros."""
    steps = max(len(row) for row in per_row)
    template = next(t for row in per_row for t in row)
    return tuple(
        torch.stack([row[step] if step < len(row) else torch.zeros_like(template) for row in per_row])
        for step in range(steps)
    )


def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generation_config: GenerationConfig | None = None,
    synced_gpus: bool = False,
    streamer=None,
    vericache_config: VeriCacheConfig | dict | None = None,
    vericache_streamer=None,
    vericache_assistant=None,
    vericache_transfers=None,
    vericache_cohorts: Cohorts | None = None,
    vericache_prefixes=None,
    **model_kwargs,
) -> torch.LongTensor | VeriCacheGenerateOutput:
    """Draft on a compressed KV cache, verify against the full one: greedy output equals stock `generate`'s, and
    sampled output is distributed as stock sampling's (speculative sampling).

    `vericache_streamer` is the streamer under a name that survives transformers' `custom_generate` path (which
    drops `streamer`); `registration.vericache_generate` passes it, after stock generate streamed the prompt.
    `vericache_assistant` is `assistant_model` under such a name (stock generate keeps `assistant_model` for itself).
    `vericache_transfers` is a `TransferEngine` shared with other calls (the serving engine's one queue), and
    `vericache_cohorts` a `CohortPool` whose cohorts decode this call's prompt, after its prefill, in passes shared
    with other calls (the serving engine's cohorts), and `vericache_prefixes` the `SharedPrefixes` whose K/V seed
    this call's prefill and that keep its prompt's (the serving engine's prefix cache)."""
    generation_config = generation_config or model.generation_config
    config = resolve_config(vericache_config, generation_config)
    check_model(model)
    check_generation(model, input_ids, generation_config, model_kwargs)
    prompt_inputs = check_prompt_inputs(model, model_kwargs, config, vericache_cohorts)
    check_shared_state(model, config, vericache_cohorts, vericache_prefixes)
    streamer = vericache_streamer if vericache_streamer is not None else streamer
    runner = pass_model(
        model
    )  # the passes run on it: the model's weights, VeriCache's attention (pass_model.py)

    stats = VeriCacheStats()
    compressor, cache = _build_cache(model, config, stats, vericache_transfers)
    pad = generation_config._pad_token_tensor
    proposer = build_proposer(config.proposer, config.proposal_length, generation_config, vericache_assistant)
    io = DecodeIO(
        logits_processor=logits_processor or LogitsProcessorList(),
        stopping_criteria=stopping_criteria or StoppingCriteriaList(),
        max_length=generation_config.max_length,
        pad_token_id=int(pad) if pad is not None else 0,
        do_sample=bool(generation_config.do_sample),
        streamer=streamer,
        keep_scores=bool(generation_config.return_dict_in_generate and generation_config.output_scores),
        keep_logits=bool(generation_config.return_dict_in_generate and generation_config.output_logits),
        proposer=proposer,
        proposal_length=(
            ProposalLength(proposer.max_tokens, fixed=config.draft_schedule == "fixed") if proposer else None
        ),
        plain_proposal_length=ProposalLength(proposer.max_tokens) if proposer else None,
        prefix=_prefix_reuse(runner, config, compressor, stats) if config.prefix_store is not None else None,
        shared=vericache_prefixes if config.prefix_store is None else None,
        timeline=config.timeline,
        prompt_inputs=prompt_inputs,
        drafter=draft_model(model, config.draft_dtype, config.draft_matmul),
        positions_from_cache=counts_positions_from_cache(model),
    )
    priors, settings = priors_for(model), _schedule_key(config, input_ids, proposer)
    schedule = draft_length_schedule(
        config, io.do_sample, priors.recall(settings), io.plain_proposal_length, io.proposal_length
    )
    cohorts = vericache_cohorts if _joins_cohorts(input_ids, io, generation_config) else None
    try:
        with cohorts.prefilling() if cohorts is not None else nullcontext():
            state = begin(
                runner,
                cache,
                input_ids,
                model_kwargs.get("attention_mask"),
                model_kwargs.get("position_ids"),
                io,
            )
            if cohorts is not None and state.pending.dim() == 2:  # a stored prefix: the suffix's round
                run_round(runner, cache, state, io, schedule)  # (its first token, and the full prefix in)
        shares = cohorts is not None and any(state.seqs.unfinished)
        if shares:
            build_carried_tier(cache)  # a query-aware tier is carried into the cohort, not rebuilt there
        if shares and can_share_rows(cache):
            member = Member(cache, state, io, config, (io.do_sample, repr(config)))
            cache = None  # the cohort owns it now: it joins the cohort's, or becomes it
            seqs = cohorts.decode(member)
        else:
            seqs = decode(runner, cache, state, io, schedule)
            priors.remember(settings, schedule)
    finally:
        if io.prefix is not None:
            io.prefix.close()
        if cache is not None:
            cache.close()
    if streamer is not None:
        streamer.end()
    if config.stats is not None:
        config.stats.merge(stats)
    return _outputs(seqs, generation_config, cache, stats)


def _joins_cohorts(input_ids: torch.Tensor, io: DecodeIO, generation_config: GenerationConfig) -> bool:
    """Whether a call handed a cohort pool decodes in a cohort: one prompt, no proposer, and only tokens to return
    (rows in a cohort share their passes, and the rest is per call). A prompt whose prefix came from a store joins
    after its suffix's round, which prefills the suffix and waits for the full prefix."""
    return input_ids.shape[0] == 1 and io.proposer is None and not generation_config.return_dict_in_generate


def _schedule_key(config: VeriCacheConfig, input_ids: torch.Tensor, proposer) -> tuple:
    """What a cost-aware schedule's measurements depend on besides the model: the compressor and its settings,
    the proposer, the draft tier's float type, the bounds on the length, the batch size and the context's scale
    (a power of two)."""
    spec = config.compressor
    parts = spec if isinstance(spec, (list, tuple)) else [spec]
    return (
        tuple(part if isinstance(part, str) else type(part).__name__ for part in parts),
        config.compression_ratio,
        config.compression_budget,
        repr(sorted(config.compressor_kwargs.items())),
        type(proposer).__name__ if proposer is not None else None,
        config.draft_dtype,
        config.draft_matmul,
        config.min_draft_length,
        config.max_draft_length,
        input_ids.shape[0],
        input_ids.shape[-1].bit_length(),
    )


def _build_cache(model, config: VeriCacheConfig, stats: VeriCacheStats, transfers=None) -> tuple:
    compressor = build_compressor(
        config.compressor, config.compression_ratio, config.compression_budget, **config.compressor_kwargs
    )
    check_compressor(model, compressor)
    cache = VeriCache(
        text_config(model).num_hidden_layers,
        compressor,
        stats=stats,
        chunk_tokens=config.chunk_tokens,
        staging_buffers=config.staging_buffers,
        staging_chunk_tokens=config.staging_chunk_tokens,
        verify_attention=config.verify_attention,
        transfer_timeout=config.transfer_timeout,
        refresh_policy=config.refresh,
        stage_on_cpu=config.stage_on_cpu,
        transfers=transfers,
        link_bytes_per_s=config.emulated_link_bytes_per_s,
        timeline=config.timeline,
        **cache_layout(model)._asdict(),
    )
    return compressor, cache


def _prefix_reuse(model, config: VeriCacheConfig, compressor, stats: VeriCacheStats) -> PrefixReuse:
    return PrefixReuse(
        config.prefix_store, model, compressor, stats, config.prefix_chunk_tokens, config.transfer_timeout
    )


@torch.inference_mode()
def warm_prefix(model, input_ids: torch.LongTensor, vericache_config: VeriCacheConfig | dict) -> int:
    """Store a prompt's whole chunks in `vericache_config.prefix_store` (exact KV and the compressed draft tier)
    without generating, and wait for the write. Later prompts that start with them reuse them. Returns the number
    of tokens stored (0 when the prompt is shorter than one chunk)."""
    config = resolve_config(vericache_config, None)
    if config.prefix_store is None:
        raise ValueError("warm_prefix stores into vericache_config.prefix_store; set one (e.g. DiskStore()).")
    check_model(model)
    check_shared_state(model, config)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"warm_prefix takes one prompt, shaped (1, T); got {tuple(input_ids.shape)}.")
    stats = VeriCacheStats()
    compressor, cache = _build_cache(model, config, stats)
    runner = pass_model(model)
    reuse = _prefix_reuse(runner, config, compressor, stats)
    length = input_ids.shape[-1] // config.prefix_chunk_tokens * config.prefix_chunk_tokens
    if not length:
        return 0
    prefix = input_ids[:, :length].to(model.get_input_embeddings().weight.device)
    try:
        prefill_prefix(runner, cache, prefix)
        reuse.save(cache, prefix)
    finally:
        cache.close()
    flush(config.prefix_store)
    return length


def _outputs(seqs: Sequences, generation_config: GenerationConfig, cache: VeriCache, stats: VeriCacheStats):
    sequences = seqs.tokens[:, : max(seqs.lengths)]
    if not generation_config.return_dict_in_generate:
        return sequences
    return VeriCacheGenerateOutput(
        sequences=sequences,
        scores=_stack_steps(seqs.scores) if generation_config.output_scores else None,
        logits=_stack_steps(seqs.raw_logits) if generation_config.output_logits else None,
        vericache_stats=stats,
        **{CACHE_OUTPUT_FIELD: cache},
    )
