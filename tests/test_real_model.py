"""The embedded SmolLM2-135M-Instruct in float32: the lossy draft tier alone drifts from full-cache output, and
VeriCache on the same draft tier reproduces full-cache output exactly."""

from __future__ import annotations

import pytest
import torch

from vericache_hf import VeriCacheConfig, VeriCacheStats
from vericache_tools.lossy import compressed_only_generate, first_divergence

pytestmark = pytest.mark.slow

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2():
    from vericache_tools.embedded import load_embedded_model

    return load_embedded_model()


@pytest.fixture(scope="module")
def code_prompt(smollm2):
    from vericache_tools.prompts import humaneval_problems, long_code_prompt

    _, tokenizer = smollm2
    text = long_code_prompt(tokenizer, humaneval_problems()[0], context_tokens=1200)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def full_output(smollm2, code_prompt):
    model, _ = smollm2
    return model.generate(code_prompt, max_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.mark.parametrize("compressor, ratio", [("kivi", 0.875), ("streaming_llm", 0.875)])
def test_lossy_draft_tier_drifts_but_vericache_is_exact(smollm2, code_prompt, full_output, compressor, ratio):
    model, _ = smollm2
    prompt = code_prompt.shape[-1]
    generated = full_output.shape[-1] - prompt
    lossy = compressed_only_generate(model, code_prompt, compressor, generated, compression_ratio=ratio)
    assert first_divergence(full_output, lossy, prompt) < generated, "expected the lossy output to drift"

    stats = VeriCacheStats()
    # a fixed schedule: the cost-aware one decides by this machine's clock whether to draft at all, and the
    # assertion below needs drafts
    config = VeriCacheConfig(
        compressor=compressor, compression_ratio=ratio, draft_schedule="fixed", draft_length=8, stats=stats
    )
    got = model.generate(
        code_prompt,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        generation_mode="vericache",
        vericache_config=config,
    )
    assert torch.equal(got, full_output)
    assert stats.accepted_tokens > 0


def test_demo_command_shows_identical_output(smollm2, capsys):
    from vericache_tools.cli import main

    argv = ["demo", "--context-tokens", "600", "--max-new-tokens", "24", "--compressor", "streaming_llm"]
    assert main([*argv, "--repeats", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "identical to full-cache output: True (in each of 2 runs)" in out
    assert "identical means token for token equal to this model's own full-cache `generate` output" in out
    assert "Acceptance:" in out and "medians of 2 interleaved run(s)" in out
    speed = out.split("prefill", 1)[1]
    assert speed.count("tok/s") == 3 and speed.count("s  ") >= 3  # decode tok/s beside each prefill time


# Every step after a reused prefix attends to it: half the drift tests' answer shows whether it was restored exactly
REUSE_NEW_TOKENS = NEW_TOKENS // 2


@pytest.fixture(scope="module")
def reuse_requests(smollm2, code_prompt, full_output):
    """The prefix tests' requests and stock `generate` of each, for both stores: the prompt (its stock answer the
    first tokens of `full_output`, as greedy decoding stops where it is told), another suffix after its first 1024
    tokens, and the prompt again."""
    model, tokenizer = smollm2
    other = tokenizer("\n\n# Now write a function that reverses a list.\n", return_tensors="pt").input_ids
    other = torch.cat([code_prompt[:, :1024], other], dim=-1)
    same = full_output[:, : code_prompt.shape[-1] + REUSE_NEW_TOKENS]
    other_output = model.generate(other, max_new_tokens=REUSE_NEW_TOKENS, do_sample=False)
    return [(code_prompt, same), (other, other_output), (code_prompt, same)]


def test_reused_prefix_is_exact_on_the_real_model(smollm2, reuse_requests, make_store):
    """fp32 SmolLM2 through a real store (a directory, a Redis server): the request that saves the prefix and the
    ones that reuse it (compressed tier first) all match stock `generate` on the full cache."""
    from vericache_hf.prefix import flush

    model, _ = smollm2
    store = make_store()
    for index, (ids, expected) in enumerate(reuse_requests):
        stats = VeriCacheStats()
        config = VeriCacheConfig(
            compressor="snapkv", compression_ratio=0.875, prefix_store=store, stats=stats
        )
        got = model.generate(
            ids,
            max_new_tokens=REUSE_NEW_TOKENS,
            do_sample=False,
            generation_mode="vericache",
            vericache_config=config,
        )
        flush(store)
        assert torch.equal(got, expected), f"request {index}"
        assert stats.prefix_tokens_reused == (0 if index == 0 else 1024)


def test_the_serving_example_runs_and_every_answer_is_exact():
    """`examples/serve_many.py`: four fp32 SmolLM2 requests through the engine in shared passes, one streamed; the
    example asserts each answer equals stock `generate` of its prompt."""
    import runpy
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "serve_many.py"
    runpy.run_path(str(example), run_name="__main__")
