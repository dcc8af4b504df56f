"""Several threads on one model: VeriCache calls beside each other and beside plain `generate` all produce stock
output, and no call, returning or raising, leaves the model changed (config, attention registry, hooks)."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from vericache_hf import VeriCacheConfig

from .conftest import no_worker_left, random_prompt, tiny_model

CALLS = 20
NEW_TOKENS = 16


def model_state(model) -> tuple:
    """What a call must leave as it found it: the attention choice, the registry and every module's hooks."""
    hooks = tuple(
        (name, len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()
    )
    return model.config._attn_implementation, tuple(sorted(ALL_ATTENTION_FUNCTIONS.keys())), hooks


def run_threads(workers: list) -> list[BaseException]:
    """Start every worker at once (a barrier), join them with a timeout, and return what they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(workers))

    def wrap(work):
        try:
            barrier.wait(30)
            work()
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors.append(error)

    threads = [threading.Thread(target=wrap, args=(work,)) for work in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
        assert not thread.is_alive(), "a thread hung"
    return errors


@pytest.fixture(scope="module")
def shared_model():
    return tiny_model("llama", num_hidden_layers=3)


def test_two_vericache_threads_and_a_plain_one_all_match_stock(shared_model):
    model = shared_model
    prompts = [random_prompt(40 + 7 * i, seed=100 + i) for i in range(4)]
    expected = [model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False) for ids in prompts]
    before = model_state(model)
    configs = {
        # SnapKV captures each layer's input at prefill (hooks); staging runs the transfer thread.
        "snapkv": VeriCacheConfig(compressor="snapkv", compression_ratio=0.75, draft_length=4),
        "staged": VeriCacheConfig(compressor="streaming_llm", draft_length=6, stage_on_cpu=True),
    }
    mismatches: list[str] = []

    def vericache_calls(name: str):
        def work():
            for call in range(CALLS):
                i = call % len(prompts)
                got = model.generate(
                    prompts[i],
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    generation_mode="vericache",
                    vericache_config=configs[name],
                )
                if not torch.equal(got, expected[i]):
                    mismatches.append(f"{name} call {call}")

        return work

    def plain_calls():
        for call in range(CALLS):
            i = call % len(prompts)
            if not torch.equal(
                model.generate(prompts[i], max_new_tokens=NEW_TOKENS, do_sample=False), expected[i]
            ):
                mismatches.append(f"plain call {call}")

    errors = run_threads([vericache_calls("snapkv"), vericache_calls("staged"), plain_calls])
    assert not errors, errors
    assert not mismatches, mismatches
    assert model_state(model) == before
    assert no_worker_left()


class RaiseAfter(StoppingCriteria):
    """A stopping criterion that raises on its n-th call: an error in the middle of decoding."""

    def __init__(self, calls: int) -> None:
        self.left = calls

    def __call__(self, input_ids, scores, **kwargs):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("criterion failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_calls_that_raise_leave_the_model_as_it_was_while_others_run(shared_model):
    model = shared_model
    ids = random_prompt(50, seed=7)
    expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    before = model_state(model)
    config = VeriCacheConfig(compressor="snapkv", compression_ratio=0.75, draft_length=4, stage_on_cpu=True)
    raised, mismatches = [], []

    def failing_calls():
        for call in range(CALLS):
            with pytest.raises(RuntimeError, match="criterion failed"):
                model.generate(
                    ids,
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    generation_mode="vericache",
                    vericache_config=config,
                    stopping_criteria=StoppingCriteriaList([RaiseAfter(call % 7)]),
                )
            raised.append(call)

    def healthy_calls():
        for call in range(CALLS):
            got = model.generate(
                ids,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                generation_mode="vericache",
                vericache_config=config,
            )
            if not torch.equal(got, expected):
                mismatches.append(call)

    errors = run_threads([failing_calls, healthy_calls])
    assert not errors, errors
    assert len(raised) == CALLS and not mismatches
    assert model_state(model) == before
    assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
    assert no_worker_left()
