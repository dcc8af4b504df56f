"""`VeriCacheEngine` and `generate_batch`: transformers' continuous-batching call shapes, every request's greedy
output equal to stock `generate` of its prompt alone, requests added while others run and from many threads,
cancelled and failing requests that end alone, and a `stop` that leaves no thread behind."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria
from transformers.cache_utils import LinearAttentionLayer

import vericache_hf
from vericache_hf import RequestStatus, VeriCacheConfig, VeriCacheEngine, VeriCacheStats, generate_batch
from vericache_hf.cache.window import held_slots
from vericache_hf.serving.admission import MemoryBudget, footprint, parse_bytes
from vericache_hf.serving.layer_bytes import layer_bytes
from vericache_tools.families import tiny_model as family_model

from .conftest import VOCAB, random_prompt, tiny_model
from .test_sampling import NEW_TOKENS, PROMPT, SAMPLING, chi_square_p

CONFIG = VeriCacheConfig(compressor="streaming_llm", compression_ratio=0.75, draft_length=4)


@pytest.fixture(scope="module")
def served():
    return tiny_model("llama", num_hidden_layers=3)


def stock(model, prompt: list[int], new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    return [random_prompt(30 + 9 * (i % 5), seed=seed + i)[0].tolist() for i in range(count)]


def no_engine_thread_left() -> bool:
    for thread in threading.enumerate():
        if thread.name.startswith("vericache-engine"):
            thread.join(10)
    return not any(t.name.startswith("vericache-engine") and t.is_alive() for t in threading.enumerate())


def test_generate_batch_matches_stock_per_prompt_in_transformers_shapes(served):
    inputs = prompts(5)
    results = generate_batch(served, inputs, max_new_tokens=20, vericache_config=CONFIG, do_sample=False)
    assert list(results) == [f"req_{i}" for i in range(5)]
    for (request_id, out), prompt in zip(results.items(), inputs, strict=True):
        assert isinstance(out, vericache_hf.GenerationOutput) and out.request_id == request_id
        assert out.status == RequestStatus.FINISHED and out.error is None
        assert out.prompt_ids == prompt
        assert out.generated_tokens == stock(served, prompt, 20)
        assert len(out.timestamps) == len(out.generated_tokens)
        assert out.created_time <= out.lifespan[0] <= out.lifespan[1]
    assert no_engine_thread_left()


def test_requests_added_while_others_run_stream_and_stay_exact(served):
    inputs = prompts(4, seed=20)
    with VeriCacheEngine(served, CONFIG, max_concurrent=2, do_sample=False) as engine:
        first = engine.add_request(inputs[0], max_new_tokens=40)
        partials = []
        for partial in engine.request_id_iter(first, timeout=60):
            partials.append(partial)
            if len(partials) == 2:  # the first request is decoding: add the others now
                later = engine.add_requests(inputs[1:], max_new_tokens=24)
        assert partials[-1].status == RequestStatus.FINISHED
        lengths = [len(p.generated_tokens) for p in partials]
        assert lengths == sorted(lengths) and len(partials) > 2  # it streamed, round by round
        assert partials[-1].generated_tokens == stock(served, inputs[0], 40)
        for request_id, prompt in zip(later, inputs[1:], strict=True):
            assert engine.get_result(request_id, timeout=60).generated_tokens == stock(served, prompt, 24)
    assert no_engine_thread_left()


class Hold(StoppingCriteria):
    """Blocks a request's decoding until released: a request that is surely in flight."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        self.started.set()
        self.release.wait(60)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_cancel_ends_a_running_request_and_one_not_yet_started(served):
    hold = Hold()
    with VeriCacheEngine(served, CONFIG, max_concurrent=1, do_sample=False) as engine:
        running = engine.add_request(prompts(1)[0], max_new_tokens=200, stopping_criteria=[hold])
        waiting = engine.add_request(prompts(1, seed=5)[0], max_new_tokens=20)
        assert hold.started.wait(60)
        engine.cancel(waiting)
        engine.cancel(running)
        hold.release.set()
        stopped = engine.get_result(running, timeout=60)
        assert stopped.status == RequestStatus.FAILED and stopped.error == "cancelled"
        assert len(stopped.generated_tokens) < 200
        never = engine.get_result(waiting, timeout=60)
        assert never.status == RequestStatus.FAILED and never.error == "cancelled before it started"
        assert never.generated_tokens == []


class Explode(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise RuntimeError("criterion exploded")


def test_a_failing_request_fails_alone(served):
    inputs = prompts(3, seed=40)
    with VeriCacheEngine(served, CONFIG, max_concurrent=2, do_sample=False) as engine:
        healthy = engine.add_requests(inputs, max_new_tokens=16)
        raising = engine.add_request(inputs[0], max_new_tokens=16, stopping_criteria=[Explode()])
        bad_token = engine.add_request([3, 4, VOCAB + 50], max_new_tokens=8)  # outside the vocabulary
        bad_option = engine.add_request(inputs[1], max_new_tokens=8, num_beams=2)
        for request_id, prompt in zip(healthy, inputs, strict=True):
            out = engine.get_result(request_id, timeout=60)
            assert out.status == RequestStatus.FINISHED and out.generated_tokens == stock(served, prompt, 16)
        assert "criterion exploded" in engine.get_result(raising, timeout=60).error
        assert engine.get_result(bad_token, timeout=60).status == RequestStatus.FAILED
        assert "num_beams" in engine.get_result(bad_option, timeout=60).error
    assert no_engine_thread_left()


def test_many_threads_add_requests_and_every_output_is_exact(served):
    inputs = prompts(12, seed=60)
    ids: dict[int, str] = {}
    with VeriCacheEngine(served, CONFIG, max_concurrent=3, do_sample=False) as engine:

        def add(start: int) -> None:
            for i in range(start, len(inputs), 4):
                ids[i] = engine.add_request(inputs[i], max_new_tokens=12)

        threads = [threading.Thread(target=add, args=(start,)) for start in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(set(ids.values())) == len(inputs)
        for i, request_id in ids.items():
            assert engine.get_result(request_id, timeout=60).generated_tokens == stock(served, inputs[i], 12)


def test_stop_with_requests_in_flight_ends_cleanly_and_refuses_more(served):
    hold = Hold()
    engine = VeriCacheEngine(served, CONFIG, max_concurrent=2, do_sample=False).start()
    running = engine.add_request(prompts(1)[0], max_new_tokens=300, stopping_criteria=[hold])
    queued = [engine.add_request(p, max_new_tokens=300) for p in prompts(3, seed=80)]
    assert hold.started.wait(60)
    hold.release.set()
    engine.stop(timeout=60)
    assert no_engine_thread_left() and not engine.is_running
    for request_id in [running, *queued]:
        assert engine.get_result(request_id, timeout=1).is_finished()
    with pytest.raises(RuntimeError, match="stopped"):
        engine.add_request([3, 4, 5])


def test_bad_arguments_get_clear_errors(served):
    with VeriCacheEngine(served, CONFIG) as engine:
        with pytest.raises(KeyError, match="unknown request id"):
            engine.get_result("req_99")
        with pytest.raises(ValueError, match="shape"):
            engine.add_request(torch.ones(2, 5, dtype=torch.long))
        with pytest.raises(ValueError, match="non-empty"):
            engine.add_request([])
        request_id = engine.add_request([3, 4, 5], max_new_tokens=2)
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request([3, 4], request_id=request_id)
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.add_request([3, 4], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_concurrent"):
        VeriCacheEngine(served, CONFIG, max_concurrent=0)


def test_sampled_tokens_through_the_engine_are_distributed_as_stock(small):
    """The engine serves sampling requests with stock's distribution (speculative sampling per request)."""
    prompt = random_prompt(PROMPT, seed=11)
    config = VeriCacheConfig(
        compressor="streaming_llm", compression_ratio=0.9, draft_length=3, draft_schedule="fixed"
    )
    torch.manual_seed(99)
    reference = small.generate(prompt, max_new_tokens=NEW_TOKENS, num_return_sequences=3000, **SAMPLING)[
        :, PROMPT:
    ]
    torch.manual_seed(100)
    requests = 600
    results = generate_batch(
        small, [prompt[0]] * requests, max_new_tokens=NEW_TOKENS, vericache_config=config, **SAMPLING
    )
    pad = small.generation_config.pad_token_id  # stock pads a row that sampled EOS early; so do we here
    served_tokens = torch.tensor(
        [out.generated_tokens + [pad] * (NEW_TOKENS - len(out.generated_tokens)) for out in results.values()]
    )
    assert served_tokens.shape == (requests, NEW_TOKENS)
    for position in range(NEW_TOKENS):
        assert chi_square_p(served_tokens[:, position], reference[:, position]) > 1e-3 / NEW_TOKENS


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
def test_a_thousand_short_requests_leave_no_memory_behind(small):
    """Results are handed out once and then forgotten: after 1,000 requests the engine holds none, and resident
    memory after the last 900 is what it was after the first 100 (warm-up) within a few MiB."""
    prompt = random_prompt(12, seed=3)[0].tolist()
    with VeriCacheEngine(small, CONFIG, max_concurrent=2, do_sample=False) as engine:

        def serve(count: int) -> None:
            ids = engine.add_requests([prompt] * count, max_new_tokens=2)
            for _ in ids:
                assert engine.get_result(timeout=60).status == RequestStatus.FINISHED

        serve(100)
        gc.collect()
        before = resident_mib()
        serve(900)
        gc.collect()
        grown = resident_mib() - before
        assert not engine._requests
    print(f"resident memory grew by {grown:.1f} MiB over 900 requests")
    assert grown < 16, f"resident memory grew by {grown:.1f} MiB over 900 requests"


def test_device_memory_budget_admits_what_fits_and_stays_exact(served):
    inputs = prompts(6, seed=40)
    need = max(footprint(served, CONFIG, len(p), 20).device_bytes for p in inputs)
    budget = int(2.5 * need)  # two requests at a time, never three
    engine = VeriCacheEngine(served, CONFIG, max_concurrent=4, device_memory_budget=budget, do_sample=False)
    with engine:
        ids = engine.add_requests(inputs, max_new_tokens=20)
        results = [engine.get_result(request_id, timeout=120) for request_id in ids]
    for out, prompt in zip(results, inputs, strict=True):
        assert out.status == RequestStatus.FINISHED
        assert out.generated_tokens == stock(served, prompt, 20)
    stats = engine.memory_stats()
    assert 1 <= stats["peak_running"] <= 2
    assert stats["peak_in_use_bytes"] <= budget
    assert no_engine_thread_left()


def test_a_budget_holds_more_vericache_requests_than_full_kv_ones(served):
    """At 4000 prompt tokens and a quarter kept, the draft tier is about a quarter of the full KV."""
    need = footprint(served, CONFIG, 4000, 100)
    assert 3 * need.device_bytes < need.full_kv_bytes
    staged = footprint(served, CONFIG, 4000, 100, on_device=True)  # an accelerator adds the staging buffers
    assert staged.device_bytes > need.device_bytes
    budget = MemoryBudget(10 * need.full_kv_bytes)
    assert budget.admit(need, threading.Event())
    stats = budget.stats()
    assert stats["full_kv_capacity"] == 10 and stats["vericache_capacity"] > 30


def test_a_sliding_layer_holds_its_window_in_stock_and_in_vericache():
    """Gemma 3's shape, tiny: five sliding layers of a 16-token window, then one full-attention layer. Both hold a
    sliding layer's window alone, whatever the context (VeriCache with a trim's slack and a pass's block); only the
    full-attention layer has a draft tier and staging."""
    model = family_model("gemma3_text")
    text = model.config
    token = 2 * text.num_key_value_heads * text.head_dim * model.dtype.itemsize
    sliding = text.layer_types.count("sliding_attention")
    short, long = (footprint(model, CONFIG, n, 20, on_device=False) for n in (400, 4000))
    for need, n in ((short, 400), (long, 4000)):
        assert need.full_kv_by_kind["sliding_attention"] == sliding * text.sliding_window * token
        assert need.full_kv_by_kind["full_attention"] == (len(text.layer_types) - sliding) * (n + 20) * token
        assert need.full_kv_bytes == sum(need.full_kv_by_kind.values())
        held = held_slots(text.sliding_window, CONFIG.max_draft_length + 1)
        assert need.window_bytes == need.device_by_kind["sliding_attention"] == sliding * held * token
        assert need.device_bytes == need.draft_bytes + need.window_bytes
    assert long.device_by_kind["full_attention"] > 5 * short.device_by_kind["full_attention"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_hybrid_s_recurrent_layers_count_their_state_not_kv(dtype):
    """Qwen3.5's shape, tiny: three gated-delta-rule layers, then one full-attention layer. The recurrent
    state stays float32 whatever the model's dtype; the convolution state follows the model."""
    model = family_model("qwen3_5").to(dtype)
    kinds = model.config.get_text_config().layer_types
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8, 9]]), past_key_values=cache, use_cache=True)
    states = [
        [*layer.conv_states.values(), *layer.recurrent_states.values()]
        for layer in cache.layers
        if isinstance(layer, LinearAttentionLayer)
    ]
    state = sum(s.numel() * s.element_size() for layer in states for s in layer if s is not None)
    assert len(states) == kinds.count("linear_attention") > 0 and state > 0
    token = next(layer.token for layer in layer_bytes(model) if layer.kind == "full_attention")
    short, long = (footprint(model, CONFIG, n, 20, on_device=False) for n in (400, 4000))
    for need, n in ((short, 400), (long, 4000)):
        assert need.full_kv_by_kind["linear_attention"] == state  # whatever the context
        assert need.full_kv_by_kind["full_attention"] == kinds.count("full_attention") * (n + 20) * token
        assert need.full_kv_bytes == state + kinds.count("full_attention") * (n + 20) * token
        # VeriCache keeps the state on the device, with its copy and a verify pass's recording beside it
        assert need.recurrent_bytes == need.device_by_kind["linear_attention"] > 2 * state
    assert long.recurrent_bytes == short.recurrent_bytes


def test_layers_of_different_head_sizes_count_each_at_its_own():
    """Gemma 4's full-attention layers have heads of their own size (`global_head_dim`)."""
    model = family_model("gemma4_text")
    per_layer = model.config.per_layer_config
    sizes = {(layer.kind, layer.token) for layer in layer_bytes(model)}
    expected = {
        (kind, 2 * per_layer[i].num_key_value_heads * per_layer[i].head_dim * model.dtype.itemsize)
        for i, kind in enumerate(model.config.layer_types)
    }
    assert sizes == expected and len({token for _, token in sizes}) == 2


def test_memory_budget_errors_name_the_fix(served):
    with pytest.raises(ValueError, match="device_memory_budget is"):
        VeriCacheEngine(served, CONFIG, device_memory_budget="1KiB").add_request(
            prompts(1)[0], max_new_tokens=20
        )
    for bad in ("forty", "-1GiB", "3 parsecs", 0):
        with pytest.raises(ValueError, match="memory budget must be"):
            VeriCacheEngine(served, CONFIG, device_memory_budget=bad if bad != 0 else -1)
    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("512 MiB") == 512 * 2**20 and parse_bytes(4096) == 4096


def test_model_generate_batch_routes_to_the_engine(served):
    inputs = prompts(3, seed=60)
    results = served.generate_batch(
        inputs, generation_mode="vericache", vericache_config=CONFIG, max_new_tokens=16, do_sample=False
    )
    assert list(results) == ["req_0", "req_1", "req_2"]
    for out, prompt in zip(results.values(), inputs, strict=True):
        assert out.generated_tokens == stock(served, prompt, 16)
    with pytest.raises(TypeError, match="by keyword"):
        served.generate_batch(inputs, None, None, generation_mode="vericache")
    with pytest.raises(ValueError, match="Unknown generation_mode"):
        served.generate_batch(inputs, generation_mode="lookahead")


def staged_config(**config) -> VeriCacheConfig:
    """StreamingLLM whose full tier is staged through the engine's queue (`stage_on_cpu`) over a 50 MB/s emulated
    link (override any of it)."""
    settings = dict(compressor="streaming_llm", compression_ratio=0.75, draft_length=4, stage_on_cpu=True)
    return VeriCacheConfig(**(settings | {"emulated_link_bytes_per_s": 50e6} | config))


def served_over_an_emulated_link(served, inputs, new_tokens: int, cohort_size="auto", **config):
    """`generate_batch` with every full tier staged through the engine's queue (`stage_on_cpu`) over a 50 MB/s
    emulated link; checks each output against stock and returns the results."""
    config = staged_config(**config)
    results = generate_batch(
        served,
        inputs,
        max_new_tokens=new_tokens,
        vericache_config=config,
        max_concurrent=2,
        cohort_size=cohort_size,
    )
    for out, prompt in zip(results.values(), inputs, strict=True):
        assert out.status == RequestStatus.FINISHED, out.error
        assert out.generated_tokens == stock(served, prompt, new_tokens)
    return results


def test_requests_share_one_transfer_queue_over_an_emulated_link(served):
    """The full tier of every request goes through the engine's one queue (staged here with `stage_on_cpu`, over
    an emulated link), while other requests draft; every output stays exact."""
    stats = VeriCacheStats()
    served_over_an_emulated_link(served, prompts(4, seed=80), 16, stats=stats)
    assert stats.bytes_to_device > 0 and stats.transfer_seconds >= stats.bytes_to_device / 50e6
    assert no_engine_thread_left()
    with pytest.raises(ValueError, match="emulated_link_bytes_per_s must be"):
        VeriCacheConfig(emulated_link_bytes_per_s=-1)


def test_a_timeline_records_each_requests_spans_on_its_own_track(served, copies_begin_before_drafts_end):
    """Requests served alone (`cohort_size=1`): prefill, draft, transfer and verify spans, each on the track of the
    request it served (a copy too, though the transfer worker made it); outputs stay exact."""
    timeline = vericache_hf.Timeline()
    results = served_over_an_emulated_link(
        served, prompts(3, seed=90), 12, cohort_size=1, draft_schedule="fixed", timeline=timeline
    )
    spans = timeline.to_dicts()
    assert {span["track"] for span in spans} == set(results)
    for request_id in results:
        kinds = [span["kind"] for span in spans if span["track"] == request_id]
        assert kinds.count("prefill") == 1 and {"draft", "transfer", "verify"} <= set(kinds)
    assert all(0 <= span["start"] <= span["end"] for span in spans)
    # a round's copies run behind its draft: some transfer time overlaps drafting
    assert 0 < timeline.overlap_seconds("transfer", "draft") <= timeline.busy_seconds("transfer")
    assert "timeline" not in VeriCacheConfig(timeline=timeline).to_dict()


def test_timeline_measures_union_and_overlap():
    timeline = vericache_hf.Timeline()
    for kind, start, end in [("draft", 0, 2), ("draft", 1, 3), ("transfer", 2.5, 4), ("transfer", 5, 6)]:
        timeline.add(kind, start, end, track="a")
    assert timeline.busy_seconds("draft") == 3
    assert timeline.busy_seconds("transfer") == 2.5
    assert timeline.overlap_seconds("transfer", "draft") == 0.5


def test_the_engines_stopping_criteria_answer_on_the_ids_device():
    """StoppingCriteriaList ORs every criterion's answer into a tensor on the ids' device: an answer elsewhere (a CPU
    tensor for ids on a GPU) breaks every request there. The meta device stands in for the GPU."""
    from vericache_hf.serving.cohort import _RowCriteria
    from vericache_hf.serving.engine import _Cancelled, _Request

    class Failing(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            raise ValueError("a criterion that fails")

    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    request = _Request.__new__(_Request)
    request.cancelled = threading.Event()
    assert _Cancelled(request)(ids, None).device == ids.device
    io = type("IO", (), {"failed": None})()
    assert _RowCriteria(io, Failing())(ids, None).device == ids.device
    assert isinstance(io.failed, ValueError)
