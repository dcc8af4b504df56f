"""What VeriCache cannot serve losslessly fails with a clear error, never a silent fallback."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

from .conftest import random_prompt


@pytest.fixture(scope="module")
def ids():
    return random_prompt(12, seed=31)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_beams=2), "num_beams=2"),
        (dict(use_cache=False), "use_cache=True"),
        (dict(assistant_early_exit=1), "assistant_early_exit"),
        (dict(penalty_alpha=0.6, top_k=4), "greedy search and sampling only"),
        (dict(return_dict_in_generate=True, output_attentions=True), "output_attentions"),
        (dict(return_dict_in_generate=True, output_hidden_states=True), "output_hidden_states"),
    ],
)
def test_settings_that_cannot_be_served_raise(llama, ids, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llama.generate(ids, max_new_tokens=4, generation_mode="vericache", **kwargs)


def test_two_proposers_are_refused(llama, ids):
    from vericache_hf import VeriCacheConfig

    with pytest.raises(ValueError, match="assistant_model and prompt_lookup_num_tokens"):
        llama.generate(
            ids,
            max_new_tokens=4,
            generation_mode="vericache",
            assistant_model=llama,
            prompt_lookup_num_tokens=3,
        )
    config = VeriCacheConfig(proposer="prompt_lookup")
    with pytest.raises(ValueError, match="assistant_model and VeriCacheConfig.proposer"):
        llama.generate(
            ids, max_new_tokens=4, generation_mode="vericache", vericache_config=config, assistant_model=llama
        )
    with pytest.raises(ValueError, match="proposer must be None, 'prompt_lookup' or an assistant model"):
        VeriCacheConfig(proposer="ngram")
    with pytest.raises(ValueError, match="pass assistant_model= to generate"):
        VeriCacheConfig(proposer=llama).to_dict()


def test_a_cache_passed_in_is_refused(llama, ids):
    static = StaticCache(config=llama.config, max_cache_len=64)
    with pytest.raises(ValueError, match="StaticCache"):
        llama.generate(ids, max_new_tokens=4, generation_mode="vericache", past_key_values=static)
    filled = DynamicCache(config=llama.config)
    llama(ids, past_key_values=filled, use_cache=True)
    with pytest.raises(ValueError, match="past_key_values"):
        llama.generate(ids, max_new_tokens=4, generation_mode="vericache", past_key_values=filled)


def test_unknown_mode_and_bad_config_are_named(llama, ids):
    with pytest.raises(ValueError, match="Unknown generation_mode='fast'"):
        llama.generate(ids, max_new_tokens=4, generation_mode="fast")
    with pytest.raises(TypeError, match="vericache_config"):
        llama.generate(ids, max_new_tokens=4, generation_mode="vericache", vericache_config=3)


def test_stop_strings_without_a_tokenizer_ask_for_one(llama, ids):
    with pytest.raises(ValueError, match="tokenizer"):
        llama.generate(ids, max_new_tokens=4, generation_mode="vericache", stop_strings=["ab"])


def test_sampling_no_longer_refused(llama, ids):
    torch.manual_seed(0)
    out = llama.generate(ids, max_new_tokens=4, do_sample=True, generation_mode="vericache")
    assert out.shape == (1, 16)
