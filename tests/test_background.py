"""The library's background threads run torch's CPU ops on themselves alone (`vericache_hf._threads`), so that
their OpenMP teams never outnumber the cores and slow the decoding thread; the caller's setting stays its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from vericache_hf import VeriCacheEngine
from vericache_hf._threads import release_workers, run_ops_alone
from vericache_hf.cache.transfer import TransferEngine
from vericache_hf.prefix import DiskStore, flush

from .test_prefix_reuse import request, stock, vericache
from .test_transfer import filled_store


@pytest.fixture
def two_threads():
    """The caller's thread at two torch threads (what a 2-core CI machine has), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def in_thread(target) -> object:
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", target()))
    thread.start()
    thread.join(timeout=30)
    return out["value"]


class WidthNotingStore(DiskStore):
    """A directory store that notes, per thread that reads or writes it, how many threads torch's ops use there."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.widths: dict[str, int] = {}

    def _note(self) -> None:
        self.widths[threading.current_thread().name] = torch.get_num_threads()

    def get(self, key):
        self._note()
        return super().get(key)

    def get_many(self, keys):
        self._note()
        return super().get_many(keys)

    def put(self, key, value):
        self._note()
        return super().put(key, value)

    def put_many(self, items):
        self._note()
        return super().put_many(items)


def test_run_ops_alone_narrows_only_the_calling_thread(two_threads):
    def alone() -> int:
        run_ops_alone()
        (torch.randn(512, 512) @ torch.randn(512, 512)).sum()  # a parallel op after it stays on this thread
        return torch.get_num_threads()

    assert in_thread(alone) == 1
    assert torch.get_num_threads() == 2  # the caller's setting is untouched
    assert in_thread(torch.get_num_threads) == 2  # and so is what a new thread starts with


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


counts_threads = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc"
)


def parallel_op() -> None:
    """A product large enough for torch to run it on the calling thread's OpenMP team."""
    (torch.randn(512, 512) @ torch.randn(512, 512)).sum()


@counts_threads
def test_release_workers_gives_back_only_the_calling_threads_team(two_threads):
    """A thread that ran a parallel op keeps its OpenMP team (one worker at two threads) until it releases it; its
    next parallel op starts a new one, and a waiting thread's team is untouched by another's release."""
    parallel_op()  # this thread's own team, which the other thread's release must leave alone
    counts = {}
    may_end = threading.Event()

    def releasing() -> None:
        before = os_threads()
        parallel_op()
        counts["with team"] = os_threads() - before
        release_workers()
        counts["released"] = os_threads() - before
        parallel_op()
        counts["again"] = os_threads() - before
        release_workers()
        may_end.wait(30)

    thread = threading.Thread(target=releasing)
    thread.start()
    while "again" not in counts and thread.is_alive():
        thread.join(0.01)
    mine = os_threads()
    parallel_op()  # still runs on this thread's team, no new worker
    assert os_threads() == mine
    may_end.set()
    thread.join(30)
    assert counts == {"with team": 1, "released": 0, "again": 1}, counts


def test_the_prefix_writer_loader_and_reader_threads_run_alone(tmp_path, two_threads):
    from .conftest import small_model

    model = small_model()
    store = WidthNotingStore(tmp_path / "store")
    ids = request(1)
    vericache(model, ids, store)  # saves the prefix, behind decoding
    flush(store)
    out, stats = vericache(model, request(2), store)  # reuses it: compressed first, the full tier behind
    assert stats.prefix_tokens_reused > 0
    assert torch.equal(out, stock(model, request(2)))
    background = {name: width for name, width in store.widths.items() if name != "MainThread"}
    assert any(name.startswith("vericache-prefix-writer") for name in background), store.widths
    assert any(name.startswith("vericache-prefix-") and "writer" not in name for name in background), (
        store.widths
    )
    assert set(background.values()) == {1}, store.widths
    assert torch.get_num_threads() == 2


def test_the_transfer_worker_runs_alone(two_threads):
    widths = []

    class Noting(TransferEngine):
        def _copy(self, transfer, freed) -> None:
            widths.append(torch.get_num_threads())
            super()._copy(transfer, freed)

    engine = Noting(num_buffers=1, timeout=10)
    store, keys, _ = filled_store(40)
    transfer = engine.submit(store, "cpu")
    got_keys, _ = engine.wait(transfer)
    assert torch.equal(got_keys[:, :, :40], keys)
    engine.release(transfer)
    assert widths == [1] and torch.get_num_threads() == 2


class ParallelOp:
    """A logits processor that runs a parallel op, so whichever thread processes scores holds an OpenMP team."""

    def __call__(self, input_ids, scores):
        parallel_op()
        return scores


def native_threads() -> int:
    """The process's threads that Python does not know of: OpenMP's workers, among others."""
    return os_threads() - threading.active_count()


@counts_threads
@pytest.mark.parametrize("cohort_size", ["auto", 1])  # rows decoding in cohorts, or each alone on its worker
def test_an_idle_engine_holds_no_openmp_team(two_threads, cohort_size):
    """Once its requests are done, the engine's workers and cohort threads wait without a team, as does the caller in
    `get_result`: a team left on a waiting thread would stop libgomp's spinning for the thread that decodes."""
    from transformers import LogitsProcessorList

    from .test_engine import CONFIG, prompts, stock, tiny_model

    model = tiny_model("llama", num_hidden_layers=3)
    kwargs = dict(max_new_tokens=12, do_sample=False, logits_processor=LogitsProcessorList([ParallelOp()]))
    inputs = prompts(3)
    expected = [stock(model, prompt, 12) for prompt in inputs]
    release_workers()
    baseline = native_threads()
    with VeriCacheEngine(model, CONFIG, max_concurrent=2, cohort_size=cohort_size) as engine:
        ids = engine.add_requests(inputs, **kwargs)
        outputs = [engine.get_result(request_id, timeout=60) for request_id in ids]
        assert [out.generated_tokens for out in outputs] == expected
        deadline = time.monotonic() + 10
        while native_threads() != baseline and time.monotonic() < deadline:  # each thread reaches its wait
            time.sleep(0.05)
        assert native_threads() == baseline


def run_python(code: str) -> None:
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, timeout=300)


def test_importing_the_library_or_decoding_off_the_cpu_does_not_import_threadpoolctl():
    run_python(
        """
        import sys
        import vericache_hf
        from vericache_hf._threads import in_background, waiting

        waiting("cuda")
        in_background("cuda")
        assert "threadpoolctl" not in sys.modules, "imported"
        """
    )


def test_without_threadpoolctl_the_cpu_hooks_do_nothing_and_decoding_is_exact():
    run_python(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "threadpoolctl":
                    raise ImportError("blocked: threadpoolctl")

        sys.meta_path.insert(0, Block())
        import threading
        import torch
        import vericache_hf
        from vericache_hf._threads import in_background, release_workers, waiting
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.set_num_threads(2)
        waiting()
        release_workers()
        thread = threading.Thread(target=in_background)
        thread.start()
        thread.join()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
        model = LlamaForCausalLM(config).double().eval()
        ids = torch.randint(3, 96, (1, 30))
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)
        config = vericache_hf.VeriCacheConfig(compressor="streaming_llm", draft_schedule="fixed", stage_on_cpu=True)
        out = model.generate(ids, max_new_tokens=12, do_sample=False, generation_mode="vericache",
                             vericache_config=config)
        assert torch.equal(out, expected)
        assert "threadpoolctl" not in sys.modules
        """
    )
