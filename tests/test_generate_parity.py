"""Whatever works with stock `generate` works with generation_mode="vericache", with the same greedy output:
batches, stopping, processors, scores, streamers, configs saved with the model, and the Hub-style entry point."""

from __future__ import annotations

import string
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Cache,
    PreTrainedTokenizerFast,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
)

from vericache_hf import VeriCacheConfig
from vericache_hf.registration import set_default_mode
from vericache_tools.lossy import compressed_only_generate

from .conftest import VOCAB, random_prompt, tiny_model, vericache_dict

REPO = Path(__file__).resolve().parents[1]
LONG_DRAFTS = VeriCacheConfig(
    compressor="streaming_llm", compression_ratio=0.5, draft_length=16, max_draft_length=32
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer for the tiny models' vocabulary, built without the Hub."""
    chars = (string.ascii_letters + string.digits + string.punctuation)[: VOCAB - 3]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", padding_side="left"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    return tokenizer


def both(model, ids, config=LONG_DRAFTS, **kwargs):
    """(stock, vericache) greedy outputs of the same call."""
    stock = model.generate(ids, do_sample=False, **kwargs)
    ours = model.generate(
        ids, do_sample=False, generation_mode="vericache", vericache_config=config, **kwargs
    )
    return stock, ours


def left_padded_batch(lengths=(41, 17, 30), seed=7):
    prompts = [random_prompt(n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


@pytest.mark.parametrize("compressor", ["streaming_llm", "snapkv", "kivi"])
def test_left_padded_batch_matches_stock_batched_greedy(model, compressor):
    ids, mask = left_padded_batch()
    config = VeriCacheConfig(compressor=compressor, draft_length=6)
    stock, ours = both(model, ids, config, attention_mask=mask, max_new_tokens=30)
    assert torch.equal(ours, stock)


def test_rows_that_finish_early_by_eos_stop_cleanly(llama):
    ids, mask = left_padded_batch()
    free = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    eos = int(free[1, ids.shape[1] + 4])  # row 1 emits it early; other rows may emit it later or never
    stock, ours = both(llama, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    assert (stock[1, ids.shape[1] + 5 :] == 0).all() and stock.shape[-1] > ids.shape[1] + 6
    assert torch.equal(ours, stock)


def test_eos_list_and_custom_criteria_stop_inside_a_block(llama):
    ids = random_prompt(40, seed=21)
    free = llama.generate(ids, do_sample=False, max_new_tokens=40)[0, 40:].tolist()
    stock, ours = both(llama, ids, max_new_tokens=40, eos_token_id=[free[9], free[13]])
    assert stock.shape[-1] <= 50 and torch.equal(ours, stock)

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[-1] >= 47, dtype=torch.bool)

    criteria = StoppingCriteriaList([StopAfter()])
    stock, ours = both(llama, ids, max_new_tokens=40, stopping_criteria=criteria)
    assert stock.shape[-1] == 47 and torch.equal(ours, stock)


def test_stop_strings_with_a_tokenizer(llama):
    tokenizer = tiny_tokenizer()
    ids = random_prompt(40, seed=22)
    free = llama.generate(ids, do_sample=False, max_new_tokens=40)[0, 40:]
    stop = tokenizer.decode(free[10:12])  # spans two tokens, inside a 16-token draft
    stock, ours = both(llama, ids, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer)
    assert stock.shape[-1] < 80 and tokenizer.decode(stock[0, 40:]).endswith(stop)
    assert torch.equal(ours, stock)


def test_max_time_stops_as_in_stock(llama):
    ids = random_prompt(20, seed=23)
    stock, ours = both(llama, ids, max_new_tokens=30, max_time=1e-9)  # both check after the first token
    assert stock.shape[-1] == 21 and torch.equal(ours, stock)


def test_processors_scores_and_logits_match_stock(model):
    ids, mask = left_padded_batch(lengths=(33, 25))
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=24,
        repetition_penalty=1.3,
        no_repeat_ngram_size=3,
        bad_words_ids=[[5], [9]],
        min_new_tokens=5,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    stock, ours = both(model, ids, **kwargs)
    assert torch.equal(ours.sequences, stock.sequences)
    assert (
        len(ours.scores) == len(stock.scores) == len(ours.logits) == stock.sequences.shape[-1] - ids.shape[1]
    )
    for row, generated in enumerate(stock.sequences[:, ids.shape[1] :].tolist()):
        # stock keeps scoring a row after its EOS; compare the emitted tokens' entries
        emitted = generated.index(2) + 1 if 2 in generated else len(generated)
        for step in range(emitted):
            torch.testing.assert_close(ours.scores[step][row], stock.scores[step][row], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ours.logits[step][row], stock.logits[step][row], rtol=1e-5, atol=1e-5)


def test_no_deprecated_cache_keyword_and_the_cache_where_stock_puts_it(llama):
    """transformers 5.24 renamed the cache keyword of `forward` (`past_key_values` -> `cache`, the old name goes in
    5.40). Our passes must use the installed release's name, and the dict output must hold the cache under the same
    key as stock's."""
    ids = random_prompt(40)
    stock = llama.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = vericache_dict(llama, ids, max_new_tokens=12)
        compressed_only_generate(llama, ids, "streaming_llm", 12, compression_ratio=0.5)
    assert not [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert torch.equal(ours.sequences, stock.sequences)

    def cache_keys(output):
        return [key for key, value in output.items() if isinstance(value, Cache)]

    assert cache_keys(ours) == cache_keys(stock) != []


def test_streamers_receive_the_accepted_tokens(llama, capsys):
    tokenizer = tiny_tokenizer()
    ids = random_prompt(30, seed=24)
    out = llama.generate(
        ids,
        do_sample=False,
        max_new_tokens=40,
        generation_mode="vericache",
        vericache_config=LONG_DRAFTS,
        streamer=TextStreamer(tokenizer, skip_prompt=True),
    )
    text = tokenizer.decode(out[0, 30:])
    assert capsys.readouterr().out == text + "\n"

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    kwargs = dict(do_sample=False, max_new_tokens=40, generation_mode="vericache", streamer=streamer)
    worker = threading.Thread(target=llama.generate, args=(ids,), kwargs=kwargs)
    worker.start()
    streamed = "".join(streamer)
    worker.join()
    assert streamed == text


def test_generation_config_options_survive_save_and_reload(tmp_path):
    model = tiny_model("llama")
    ids = random_prompt(40, seed=25)
    expected = model.generate(ids, do_sample=False, max_new_tokens=25)
    set_default_mode(model, VeriCacheConfig(compressor="kivi", draft_length=3))
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert reloaded.generation_config.generation_mode == "vericache"
    out = reloaded.generate(ids, do_sample=False, max_new_tokens=25, return_dict_in_generate=True)
    # 3: not the default 8, nor cost_aware's first-round cap, 4
    assert out.vericache_stats is not None and out.vericache_stats.draft_lengths[0] == 3
    assert torch.equal(out.sequences, expected)


def test_hub_style_custom_generate_folder_without_importing_the_library():
    script = f"""
import sys, torch
sys.path = [p for p in sys.path if p != {str(REPO)!r}]
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
model = LlamaForCausalLM(config).double().eval()
ids = torch.randint(3, 96, (1, 30))
stock = model.generate(ids, max_new_tokens=20, do_sample=False)
assert "vericache_hf" not in sys.modules
out = model.generate(ids, max_new_tokens=20, do_sample=False, custom_generate={str(REPO)!r},
                     trust_remote_code=True, vericache_config={{"compressor": "streaming_llm", "draft_schedule": "fixed"}},
                     return_dict_in_generate=True)
assert out.vericache_stats.rounds > 0
assert torch.equal(out.sequences, stock)
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]
