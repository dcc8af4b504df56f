"""Cohorts: requests of one engine decoded in shared forward passes, each joining after its own prefill and leaving
when it stops. Every request's output is checked against stock `generate` of its prompt alone (float64), with that
request's own settings; rows that fail, fail alone; a fault in a shared pass sends the rows to decode alone."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from vericache_hf import RequestStatus, Timeline, VeriCacheConfig, VeriCacheEngine, VeriCacheStats
from vericache_hf.cache import rows
from vericache_hf.cache.transfer import TransferEngine
from vericache_hf.decoding import _build_cache
from vericache_hf.loop import begin
from vericache_hf.pass_model import pass_model
from vericache_hf.passes import DecodeIO
from vericache_hf.serving.cohort import plan

from .conftest import random_prompt, tiny_model
from .test_engine import no_engine_thread_left, prompts, staged_config, stock


@pytest.fixture(scope="module")
def served():
    return tiny_model("llama", num_hidden_layers=3)


def serve(model, inputs, config, new_tokens, per_request=None, **engine_kwargs):
    """Every prompt through one engine (per-request kwargs from `per_request[i]`); returns outputs and the
    engine's cohort stats."""
    per_request = per_request or [{}] * len(inputs)
    engine_kwargs.setdefault("max_concurrent", len(inputs))
    with VeriCacheEngine(model, config, do_sample=False, **engine_kwargs) as engine:
        ids = [
            engine.add_request(prompt, max_new_tokens=new_tokens[i], **per_request[i])
            for i, prompt in enumerate(inputs)
        ]
        outs = [engine.get_result(request_id, timeout=120) for request_id in ids]
        shared = engine.cohort_stats()
    assert no_engine_thread_left()
    return outs, shared


@pytest.mark.parametrize(
    "compressor",
    ["snapkv", "streaming_llm", "kivi", ["knorm", "kivi"]],
    ids=["snapkv-carried", "streaming_llm-rebuilt", "kivi-rebuilt", "knorm+kivi"],
)
def test_requests_share_passes_join_and_leave_and_stay_exact(served, compressor):
    """Prompts of different lengths and answers of different lengths: rows join a running cohort after their
    prefill and leave when they stop (their slots trimmed), and every output equals stock's."""
    inputs = prompts(6, seed=100)
    new_tokens = [30, 12, 24, 6, 18, 30]
    config = VeriCacheConfig(compressor=compressor, compression_ratio=0.75, draft_length=4)
    outs, shared = serve(served, inputs, config, new_tokens)
    for out, prompt, count in zip(outs, inputs, new_tokens, strict=True):
        assert out.status == RequestStatus.FINISHED, out.error
        assert out.generated_tokens == stock(served, prompt, count)
    assert shared["most_rows_per_round"] >= 3 and shared["mean_rows_per_round"] > 1.5


class StopAfter(StoppingCriteria):
    """Stops a row once it holds `total` tokens (a per-request criterion that must see only its own row)."""

    def __init__(self, total: int) -> None:
        self.total = total

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[-1] >= self.total, dtype=torch.bool)


def test_each_row_keeps_its_own_processors_and_criteria(served):
    """Requests with their own logits processors (one that depends on the prompt's length) and stopping criteria
    share a cohort; each equals stock `generate` called with the same settings."""
    inputs = prompts(4, seed=120)
    settings = [
        {"repetition_penalty": 1.5},
        {"min_new_tokens": 10, "suppress_tokens": [7, 8, 9]},
        {"bad_words_ids": [[11], [12]]},
        {"stopping_criteria": [StopAfter(len(inputs[3]) + 9)]},
    ]
    config = VeriCacheConfig(compressor="snapkv", compression_ratio=0.75, draft_length=4)
    outs, shared = serve(served, inputs, config, [20] * 4, per_request=settings)
    for out, prompt, kwargs in zip(outs, inputs, settings, strict=True):
        expected = served.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, **kwargs)
        assert out.generated_tokens == expected[0, len(prompt) :].tolist(), kwargs
    assert len(outs[3].generated_tokens) == 9
    assert shared["most_rows_per_round"] >= 2


class ExplodeLater(StoppingCriteria):
    """Raises once its row has `after` new tokens: the row is in a cohort by then."""

    def __init__(self, prompt_length: int, after: int) -> None:
        self.limit = prompt_length + after

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[-1] >= self.limit:
            raise RuntimeError("criterion exploded")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_row_that_fails_in_a_cohort_fails_alone(served):
    inputs = prompts(4, seed=140)
    settings = [{}, {"stopping_criteria": [ExplodeLater(len(inputs[1]), 5)]}, {}, {}]
    config = VeriCacheConfig(compressor="streaming_llm", compression_ratio=0.75, draft_length=4)
    outs, shared = serve(served, inputs, config, [24] * 4, per_request=settings)
    assert outs[1].status == RequestStatus.FAILED and "criterion exploded" in outs[1].error
    for i in (0, 2, 3):
        assert outs[i].status == RequestStatus.FINISHED
        assert outs[i].generated_tokens == stock(served, inputs[i], 24)
    assert shared["most_rows_per_round"] >= 2


def test_a_fault_in_a_shared_pass_sends_the_rows_to_decode_alone(served, monkeypatch):
    """A copy that fails whenever it carries several requests' rows (staged over the CPU): the cohort's round
    fails before anything is emitted, each row decodes alone, and every output is still exact."""
    copy = TransferEngine._copy

    def copy_one_row_only(self, transfer, freed):
        if transfer.snapshot.keys.shape[0] > 1:
            raise RuntimeError("injected fault in a shared copy")
        return copy(self, transfer, freed)

    monkeypatch.setattr(TransferEngine, "_copy", copy_one_row_only)
    inputs = prompts(3, seed=160)
    config = staged_config(emulated_link_bytes_per_s=None, transfer_timeout=10)
    outs, _ = serve(served, inputs, config, [16] * 3, cohorts=1, cohort_size=3)
    for out, prompt in zip(outs, inputs, strict=True):
        assert out.status == RequestStatus.FINISHED, out.error
        assert out.generated_tokens == stock(served, prompt, 16)


def test_a_timeline_records_each_cohorts_spans_on_its_own_track(served, copies_begin_before_drafts_end):
    """Prefills on the requests' tracks; drafts, copies and verify passes on the cohorts' tracks. Staged full
    tiers are planned into two cohorts (nothing measured yet), so one's copies run beside the other's drafting."""
    timeline = Timeline()
    inputs = prompts(4, seed=180)
    config = staged_config(draft_schedule="fixed", timeline=timeline)
    outs, shared = serve(served, inputs, config, [16] * 4)
    for out, prompt in zip(outs, inputs, strict=True):
        assert out.status == RequestStatus.FINISHED, out.error
        assert out.generated_tokens == stock(served, prompt, 16)
    spans = timeline.to_dicts()
    prefills = {span["track"] for span in spans if span["kind"] == "prefill"}
    assert prefills == {out.request_id for out in outs}
    cohorts = {span["track"] for span in spans if span["kind"] in ("draft", "verify", "transfer")}
    assert cohorts and all(track.startswith("cohort_") for track in cohorts)
    assert shared["most_rows_per_round"] >= 2
    assert timeline.overlap_seconds("transfer", "draft") > 0


def test_the_plan_hides_each_cohorts_copy_behind_the_others_compute():
    assert plan(8, copy_seconds=0.0, compute_seconds=1.0) == (1, 8)  # nothing to copy: one shared batch
    assert plan(8, copy_seconds=0.5, compute_seconds=1.0) == (2, 4)
    assert plan(8, copy_seconds=1.5, compute_seconds=1.0) == (3, 3)
    assert plan(8, copy_seconds=9.0, compute_seconds=1.0, most=4) == (4, 2)
    assert plan(1, copy_seconds=9.0, compute_seconds=1.0) == (1, 1)


def test_rows_stack_and_select_back_to_what_each_cache_held(served):
    """Two requests' caches (different lengths) join a third's, which then leaves: each row copied back out holds
    the full tier, validity and carried draft tier (SnapKV's kept tokens) that its own cache held."""
    config = VeriCacheConfig(compressor="snapkv", compression_ratio=0.75, draft_length=4)
    caches = []
    for length in (20, 33):
        cache = _build_cache(served, config, VeriCacheStats())[1]
        io = DecodeIO(LogitsProcessorList(), StoppingCriteriaList(), max_length=64, pad_token_id=0)
        begin(pass_model(served), cache, random_prompt(length, seed=length), None, None, io)  # as a request's
        caches.append(cache)
    both = _build_cache(served, config, VeriCacheStats())[1]
    io = DecodeIO(LogitsProcessorList(), StoppingCriteriaList(), max_length=64, pad_token_id=0)
    begin(pass_model(served), both, random_prompt(27, seed=27), None, None, io)
    rows.join(both, caches)  # rows 1 and 2 are the caches' rows
    assert both.full_valid.shape == (3, max(c.full_valid.shape[-1] for c in caches))
    rows.keep(both, [1, 2])
    for row, cache in enumerate(caches):
        alone = rows.copy_row(both, row)
        assert torch.equal(alone.full_valid, cache.full_valid)
        for mine, theirs in zip(alone.layers, cache.layers, strict=True):
            for got, want in zip(mine.full.view(), theirs.full.view(), strict=True):
                assert torch.equal(got, want)
            for name, value in theirs.draft.export().items():
                assert torch.equal(mine.draft.export()[name], value), name


def test_bad_cohort_settings_get_clear_errors(served):
    with pytest.raises(ValueError, match="cohorts must be a positive int or 'auto'"):
        VeriCacheEngine(served, cohorts=0)
    with pytest.raises(ValueError, match="cohort_size must be a positive int or 'auto'"):
        VeriCacheEngine(served, cohort_size="big")
