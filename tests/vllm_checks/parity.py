"""Runs vLLM with and without VeriCache drafting on the same requests and writes what each produced to a JSON file.
Run in the vLLM venv by tests/test_vllm.py: `python -m tests.vllm_checks.parity MODEL_DIR OUT.json`.

Requests: prompts of mixed lengths (one too short to draft), each with its own output length so that they finish
at different steps and vLLM condenses its batch between them; two more fail inside the proposer, one while its
draft tier is built and one at its first drafting round. A sampled run draws two tokens after one prompt under many seeds,
both ways: the second is the first that a draft can decide, so its distribution is what drafting must keep. A
control run draws them under a proposer whose drafts come from no model (`fixed_drafts.py`): whether vLLM's own
rejection sampling keeps the distribution at all.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# engine and worker in this process: one vLLM start-up instead of three (a test's time is mostly start-up)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SOURCE = Path(__file__).resolve().parents[2] / "src" / "vericache_hf" / "cache" / "draft_tier.py"


def requests(tokenizer) -> list[tuple[list[int], int]]:
    code = SOURCE.read_text()
    texts = [
        (code[:4000], 40),
        ("# A list of the planets, one per line, with their order from the sun:\n" + code[:1200], 24),
        (code[2000:3400] + "\nclass ", 56),
        ("def add(a, b):", 12),  # under the proposer's minimum context: never drafts
        (code[500:2500], 32),  # fails when its draft tier is built
        (code[1000:3000], 32),  # fails at its first drafting round
    ]
    return [(tokenizer(text).input_ids, length) for text, length in texts]


def run(llm, reqs, sampling) -> list[list[int]]:
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [sampling.clone() for _ in reqs]
    for param, (_, length) in zip(params, reqs, strict=True):
        param.max_tokens = length
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def sampled_pairs(llm, prompt: list[int], samples: int) -> list[int]:
    from vllm import SamplingParams

    # no per-request seeds: vLLM's CPU runner cannot rewind a request's generator (`set_offset`) when a seeded
    # request's prefill is split into chunks; the engine's own seed keeps the run repeatable
    params = SamplingParams(temperature=1.0, max_tokens=2)
    outs = llm.generate([{"prompt_token_ids": prompt}] * samples, params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]


def main(model: str, out_path: str) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vericache_hf import VeriCacheConfig
    from vericache_hf.vllm.proposer import _settings

    tokenizer = AutoTokenizer.from_pretrained(model)
    reqs = requests(tokenizer)
    greedy = SamplingParams(temperature=0.0)
    common = {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 2048,
        "seed": 0,
        "distributed_executor_backend": "uni",
    }
    results: dict = {"prompt_lengths": [len(ids) for ids, _ in reqs]}

    plain = LLM(model, **common)
    results["plain"] = run(plain, reqs, greedy)
    sample_prompt = reqs[0][0][:600]
    samples = int(os.environ.get("VERICACHE_TEST_SAMPLES", 64))
    results["plain_sampled"] = sampled_pairs(plain, sample_prompt, samples)
    results["plain_greedy_after"] = {
        str(first): run(plain, [(sample_prompt + [first], 4)], greedy)[0]
        for first in {pair[0] for pair in results["plain_sampled"]}
    }
    plain.llm_engine.engine_core.shutdown()
    del plain

    folder = tempfile.mkdtemp(prefix="vericache-vllm-")
    config = VeriCacheConfig(
        compressor="snapkv", compression_ratio=0.5, draft_length=4, draft_schedule="fixed"
    )
    faults = {
        "settings": _settings(config),
        "build": [reqs[4][0][:64]],
        "draft": [reqs[5][0][:64]],
        "stats": os.path.join(folder, "stats.json"),
    }
    Path(folder, "faults.json").write_text(json.dumps(faults))
    os.environ["VERICACHE_TEST_FAULTS"] = os.path.join(folder, "faults.json")
    proposer = "tests.vllm_checks.faulty_proposer.FaultyProposer"
    spec = {"method": "custom_class", "model": proposer, "num_speculative_tokens": 4}
    drafting = LLM(model, speculative_config=spec, **common)
    results["vericache"] = run(drafting, reqs, greedy)
    results["stats"] = json.loads(Path(faults["stats"]).read_text())
    results["vericache_sampled"] = sampled_pairs(drafting, sample_prompt, len(results["plain_sampled"]))
    drafting.llm_engine.engine_core.shutdown()
    del drafting

    # the control: drafts from no model at all (plain greedy's next tokens after the most common first token)
    first = max(
        set(pair[0] for pair in results["plain_sampled"]), key=[p[0] for p in results["plain_sampled"]].count
    )
    os.environ["VERICACHE_TEST_FIXED_DRAFTS"] = json.dumps(results["plain_greedy_after"][str(first)])
    spec = {
        "method": "custom_class",
        "model": "tests.vllm_checks.fixed_drafts.FixedDrafts",
        "num_speculative_tokens": 4,
    }
    control = LLM(model, speculative_config=spec, **common)
    results["control_sampled"] = sampled_pairs(control, sample_prompt, len(results["plain_sampled"]))
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
