"""`draft_dtype`: draft steps on a copy of the weights in a narrower float type, the verify pass on the model's own.
Greedy output equals stock `generate` of the float64 model (alone, composed with a proposer, through the engine);
sampling keeps stock's distribution; the copy is made once per model, shared by threads, and the model is untouched.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from vericache_hf import VeriCacheConfig, generate_batch
from vericache_hf.attention import wrapped_name
from vericache_hf.drafting.draft_model import draft_model
from vericache_hf.prefix import DiskStore

from .conftest import random_prompt, tiny_model
from .test_generate_parity import left_padded_batch
from .test_prefix_reuse import CHUNK, request, stock, vericache
from .test_proposers import generate_both, repeat_tail
from .test_sampling import PROMPT, assert_same_distribution, sample_both
from .test_threads import model_state, run_threads


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=3, num_hidden_layers=3)


@contextmanager
def counted(module):
    """Count `module`'s forwards while the block runs (the narrow copy's: proof that it drafted)."""
    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


@pytest.mark.parametrize("compressor", ["snapkv", "streaming_llm", "kivi"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_narrow_drafts_on_a_padded_batch_match_stock(llama, compressor, dtype):
    ids, mask = left_padded_batch()
    config = VeriCacheConfig(compressor=compressor, draft_dtype=dtype, draft_schedule="fixed", draft_length=5)
    with counted(draft_model(llama, getattr(torch, dtype))) as calls:
        stock, ours = generate_both(llama, ids, config, attention_mask=mask, max_new_tokens=30)
    assert torch.equal(ours.sequences, stock), (compressor, dtype)
    stats = ours.vericache_stats
    # every draft step ran on the narrow copy, and some of its drafts were kept
    assert len(calls) == stats.draft_forwards > 0 and stats.acceptance_rate > 0


@pytest.mark.parametrize("proposer", ["lookup", "assistant"])
def test_narrow_drafts_composed_with_a_proposer_match_stock(llama, proposer):
    ids, mask = repeat_tail(*left_padded_batch())
    kwargs = (
        {"prompt_lookup_num_tokens": 5}
        if proposer == "lookup"
        else {"assistant_model": tiny_model("llama", seed=5, num_hidden_layers=1)}
    )
    config = VeriCacheConfig(
        compressor="snapkv", draft_dtype="bfloat16", draft_schedule="fixed", draft_length=6
    )
    stock, ours = generate_both(llama, ids, config, attention_mask=mask, max_new_tokens=30, **kwargs)
    assert torch.equal(ours.sequences, stock)
    assert ours.vericache_stats.proposed_tokens > 0


def test_sampled_tokens_with_narrow_drafts_are_distributed_as_stock(small):
    ids = random_prompt(PROMPT, seed=11)
    config = VeriCacheConfig(
        compressor="streaming_llm",
        compression_ratio=0.9,
        draft_length=3,
        draft_schedule="fixed",
        draft_dtype="bfloat16",
    )
    out, stock = sample_both(small, ids, config)
    assert 0.2 < out.vericache_stats.acceptance_rate < 0.95, "the test needs accepted and rejected drafts"
    assert_same_distribution(out.sequences, stock, PROMPT)


def test_the_engine_drafts_with_the_narrow_copy_and_stays_exact(llama):
    prompts = [random_prompt(30 + 7 * i, seed=40 + i)[0].tolist() for i in range(4)]
    config = VeriCacheConfig(
        compressor="streaming_llm", draft_dtype="bfloat16", draft_length=4, draft_schedule="fixed"
    )
    with counted(draft_model(llama, torch.bfloat16)) as calls:
        results = generate_batch(llama, prompts, max_new_tokens=16, vericache_config=config, do_sample=False)
    assert calls
    for out, prompt in zip(results.values(), prompts, strict=True):
        stock = llama.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)
        assert out.error is None and out.generated_tokens == stock[0, len(prompt) :].tolist()


def test_one_copy_per_model_and_type_shared_by_threads_and_the_model_untouched(llama):
    before = model_state(llama), {n: (p.dtype, p.data_ptr()) for n, p in llama.named_parameters()}
    copies = []
    errors = run_threads([lambda: copies.append(draft_model(llama, torch.bfloat16)) for _ in range(4)])
    assert not errors and len({id(c) for c in copies}) == 1
    narrow = copies[0]
    assert narrow is not llama and {p.dtype for p in narrow.parameters()} == {torch.bfloat16}
    # on the CPU the copy attends eagerly (sdpa is slow there for one half-precision query); the model does not
    assert narrow.config is not llama.config and narrow.config._attn_implementation == wrapped_name("eager")
    # the rotary frequencies stay in the model's precision: bfloat16 ones would turn long positions far off
    assert narrow.model.rotary_emb.inv_freq.dtype == llama.model.rotary_emb.inv_freq.dtype == torch.float64
    tied = llama.lm_head.weight is llama.model.embed_tokens.weight
    assert (narrow.lm_head.weight is narrow.model.embed_tokens.weight) == tied  # tied weights stay tied
    assert draft_model(llama, None, "stock") is None and draft_model(llama, torch.float64, "stock") is None
    assert (model_state(llama), {n: (p.dtype, p.data_ptr()) for n, p in llama.named_parameters()}) == before


def test_bad_draft_dtypes_are_refused_with_the_choices(llama):
    for bad in ("int8", "float8_e4m3fn", "half-ish", 3):
        with pytest.raises(ValueError, match="draft_dtype must be None or a float type"):
            VeriCacheConfig(draft_dtype=bad)
    config = VeriCacheConfig(draft_dtype=torch.bfloat16)
    assert config.draft_dtype == "bfloat16" and config.to_dict()["draft_dtype"] == "bfloat16"
    split = tiny_model("llama", seed=3, num_hidden_layers=3)
    split.hf_device_map = {"model.layers.0": "cpu", "model.layers.1": "meta"}
    with pytest.raises(ValueError, match="needs the model on one device"):
        draft_model(split, torch.bfloat16)


def test_a_stored_prefix_serves_calls_with_and_without_narrow_drafts(llama, tmp_path):
    """A draft tier exported after bfloat16 drafts is restored by a call drafting in the model's type, and back."""
    store = DiskStore(tmp_path)
    for question, dtype in enumerate(("bfloat16", None, "bfloat16")):
        ids = request(question)
        out, stats = vericache(llama, ids, store, draft_dtype=dtype)
        assert torch.equal(out, stock(llama, ids)), (question, dtype)
        assert stats.prefix_tokens_reused == (0 if question == 0 else 3 * CHUNK)
