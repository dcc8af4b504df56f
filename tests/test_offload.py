"""The full tier off the device: layer-by-layer staging for verification, prefetch during drafting, bounded device
memory, measured transfers, and failures that surface in `generate` without leaving a thread behind."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from vericache_hf import TransferError, VeriCache, VeriCacheConfig
from vericache_hf.cache.full_tier import HostSnapshot
from vericache_hf.cache.layers import VeriCacheLayer
from vericache_hf.cache.staging import buffer_tokens
from vericache_hf.compressors import build_compressor
from vericache_hf.verify_attention import VERIFY_KWARG

from .conftest import no_worker_left, random_prompt, tiny_model, vericache_dict

HEADS, KEY_DIM, VALUE_DIM = 2, 8, 8
CHUNK = 128


def prefilled(
    layers: int,
    tokens: int,
    buffers: int = 2,
    batch: int = 1,
    seed: int = 0,
    staging_chunk: int | None = None,
):
    """A cache after prefill of random K/V (no model): returns it and each layer's prompt keys/values. Its staging
    buffers hold whole layers unless `staging_chunk` is given."""
    generator = torch.Generator().manual_seed(seed)
    cache = VeriCache(
        layers,
        build_compressor("streaming_llm", 0.75),
        chunk_tokens=CHUNK,
        staging_buffers=buffers,
        staging_chunk_tokens=staging_chunk,
        transfer_timeout=30,
        stage_on_cpu=True,  # the accelerator's path: staging buffers and the transfer thread
    )
    prompt = []
    with cache.prefilling(None, torch.ones(batch, tokens, dtype=torch.long)):
        for layer in range(layers):
            keys = torch.randn(batch, HEADS, tokens, KEY_DIM, generator=generator)
            values = torch.randn(batch, HEADS, tokens, VALUE_DIM, generator=generator)
            cache.update(keys, values, layer)
            prompt.append((keys, values))
    return cache, prompt


def verify_pass(cache: VeriCache, prompt, new_tokens: int = 5) -> None:
    """Run the verify side of every layer in order, as attention does, and check each layer hands attention
    exactly the prompt's K/V followed by the new tokens': as one tensor, or (a layer longer than a staging chunk)
    the new tokens alone after the chunks attention reads."""
    batch = prompt[0][0].shape[0]
    with cache.verifying():
        for layer, (keys, values) in enumerate(prompt):
            new_keys = torch.randn(batch, HEADS, new_tokens, KEY_DIM)
            new_values = torch.randn(batch, HEADS, new_tokens, VALUE_DIM)
            got_keys, got_values = cache.update(new_keys, new_values, layer)
            if cache.stream.streams(layer):  # what streamed attention reads
                # a chunk's buffer takes a later chunk once the next is asked for: read each as it comes
                chunks = [(k.clone(), v.clone()) for k, v in cache.stream.stream_chunks(layer)]
                assert all(chunk[0].shape[2] <= cache.stream.staging_chunk_tokens for chunk in chunks)
                got_keys = torch.cat([chunk[0] for chunk in chunks] + [got_keys], dim=2)
                got_values = torch.cat([chunk[1] for chunk in chunks] + [got_values], dim=2)
                cache.pass_kwargs()[VERIFY_KWARG].served.add(layer)
            assert torch.equal(got_keys, torch.cat([keys, new_keys], dim=2))
            assert torch.equal(got_values, torch.cat([values, new_values], dim=2))


def layer_bytes(tokens: int, batch: int = 1) -> int:
    return batch * HEADS * tokens * (KEY_DIM + VALUE_DIM) * 4


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_verify_stages_every_layer_through_a_bounded_set_of_buffers(buffers):
    cache, prompt = prefilled(layers=5, tokens=300, buffers=buffers, batch=2)
    with cache.drafting(4):
        pass
    verify_pass(cache, prompt)
    verify_pass(cache, prompt)  # a second pass without a commit stages the layers again
    assert len(cache.stream.transfers.buffers.pairs) == buffers
    assert cache.stream.staging_bytes() == buffers * layer_bytes(buffer_tokens(300 + 5), batch=2)
    assert cache.stats.chunk_transfers == 2 * 5  # two passes, five layers
    assert cache.stats.bytes_to_device == 10 * layer_bytes(300, batch=2)
    cache.close()
    assert no_worker_left()


def test_prefetch_during_drafting_makes_the_first_layers_resident_before_verify():
    cache, prompt = prefilled(layers=4, tokens=200)
    with cache.drafting(2):
        first, second, third = (cache.stream._round[i][0] for i in range(3))
        assert first.done.wait(10) and second.done.wait(10)
        assert (first.state, second.state, third.state) == ("ready", "ready", "backlog")  # two buffers
        with pytest.raises(RuntimeError, match="in flight"):
            cache.layers[0].full.truncate(100)  # the store may not shrink under a transfer
    assert cache.stream._round[0][0] is first  # drafting ended; the round waits for the verify pass
    verify_pass(cache, prompt, new_tokens=3)
    assert first.state == "released" and cache.stream._round is None
    cache.close()


def test_a_failed_phase_releases_its_transfers_and_rolls_the_draft_back():
    cache, prompt = prefilled(layers=3, tokens=100)
    with pytest.raises(ZeroDivisionError), cache.drafting(4):
        cache.update(torch.randn(1, HEADS, 1, KEY_DIM), torch.randn(1, HEADS, 1, VALUE_DIM), 0)
        raise ZeroDivisionError("a failure inside the phase")
    assert cache.phase == "idle" and cache.stream._round is None and cache.layers[0].draft.num_drafted == 0
    with pytest.raises(ZeroDivisionError), cache.verifying():
        cache.update(torch.randn(1, HEADS, 2, KEY_DIM), torch.randn(1, HEADS, 2, VALUE_DIM), 0)
        raise ZeroDivisionError("a failure inside the phase")
    assert cache.phase == "idle" and cache.stream._round is None and cache.layers[0].pending is None
    with pytest.raises(RuntimeError, match="nothing to commit"):
        cache.commit(1, torch.ones(1, 1, dtype=torch.bool))
    verify_pass(cache, prompt)  # the cache goes on as if the failed passes never ran
    cache.close()
    assert no_worker_left()


def test_a_forward_outside_any_phase_is_refused():
    cache, _ = prefilled(layers=1, tokens=10)
    with pytest.raises(RuntimeError, match="outside a phase"):
        cache.update(torch.randn(1, HEADS, 1, KEY_DIM), torch.randn(1, HEADS, 1, VALUE_DIM), 0)
    with pytest.raises(RuntimeError, match="single prefill"), cache.prefilling(None, torch.ones(1, 4)):
        pass


@pytest.mark.parametrize("layers", [4, 8])
@pytest.mark.parametrize("staging_chunk", [None, 2048])
def test_full_tier_device_bytes_are_the_staging_buffers_whatever_the_layer_count(layers, staging_chunk):
    """Accounting (B*H*T*D*bytes): the full tier on the device is two staging buffers for 4 layers and for 8, each
    a chunk of 2048 tokens, or without chunks a whole layer a quarter longer than the context; the full KV cache a
    DynamicCache would keep on the device is `layers` whole layers."""
    context = 8192
    cache, prompt = prefilled(layers=layers, tokens=context, staging_chunk=staging_chunk)
    verify_pass(cache, prompt, new_tokens=17)
    staged = buffer_tokens(context + 64) if staging_chunk is None else staging_chunk
    assert cache.stats.peak_staging_bytes == 2 * layer_bytes(staged)
    assert cache.full_tier_bytes() == layers * layer_bytes(context)  # host memory
    assert cache.stats.bytes_to_device == layers * layer_bytes(context)  # all of it staged through
    cache.close()


def test_generate_at_2k_and_8k_matches_stock_with_the_full_tier_staged():
    """End to end in float64 at 2k and 8k tokens, the full tier staged layer by layer: greedy output equals stock
    `generate` on the full cache, and more of the KV is off the device than on it. Chunks of 512 tokens make both
    contexts stream (4 and 16 chunks a layer), so a staging peak that followed the context would read 4x at the
    longer one; the property needs no context beyond 8k, whose float64 prefill grows with its square."""
    model = tiny_model("llama", max_position_embeddings=8300, num_hidden_layers=6)
    config = VeriCacheConfig(
        compressor="streaming_llm", compression_ratio=0.875, stage_on_cpu=True, staging_chunk_tokens=512
    )
    staging = {}
    for context in (2048, 8192):
        ids = random_prompt(context, seed=context)
        expected = stock(model, ids, max_new_tokens=10)
        out = vericache_dict(model, ids, config=config, max_new_tokens=10)
        assert torch.equal(out.sequences, expected)
        stats = out.vericache_stats
        assert stats.chunk_transfers >= model.config.num_hidden_layers
        staging[context] = stats.peak_staging_bytes
        assert stats.full_tier_bytes > staging[context] > 0  # more is off the device than on it
    assert staging[8192] == staging[2048]  # two chunks, whatever the context


def stock(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, **kwargs)


def vericache(model, ids, **kwargs):
    config = VeriCacheConfig(
        compressor="streaming_llm", compression_ratio=0.75, draft_length=8, stage_on_cpu=True
    )
    return model.generate(
        ids, do_sample=False, generation_mode="vericache", vericache_config=config, **kwargs
    )


@pytest.fixture(scope="module")
def deep_llama():
    return tiny_model("llama", num_hidden_layers=6)


def test_generate_streams_the_full_tier_and_reports_the_transfers(deep_llama):
    ids = random_prompt(100, batch=2, seed=11)
    expected = stock(deep_llama, ids, max_new_tokens=16, return_dict_in_generate=True)
    out = vericache(deep_llama, ids, max_new_tokens=16, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)
    stats, cache = out.vericache_stats, out.past_key_values
    layers = deep_llama.config.num_hidden_layers
    assert stats.chunk_transfers > 0 and stats.chunk_transfers % layers == 0
    assert stats.bytes_to_device > 0 and stats.transfer_seconds > 0
    assert 0.0 <= stats.transfer_hidden_share <= 1.0
    # Device to host: the prompt, then only accepted tokens -- exactly what the full tier holds.
    assert stats.bytes_to_host == cache.full_tier_bytes() == stats.full_tier_bytes
    # Peak device memory of the request against full-KV decoding's DynamicCache.
    full_kv = sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in expected.past_key_values.layers
    )
    kv_tokens = expected.past_key_values.layers[0].keys.shape[-2]
    token_bytes = full_kv // (layers * kv_tokens)  # one token of one layer
    assert 0 < stats.peak_staging_bytes <= 2 * token_bytes * buffer_tokens(kv_tokens + 8)
    assert 0 < stats.peak_draft_tier_bytes + stats.peak_staging_bytes < full_kv
    assert no_worker_left()


def test_on_cpu_the_verify_pass_reads_the_full_tier_in_place_by_default(deep_llama):
    """The default on a CPU: the same output as stock, the full tier read where it lies, no copy and no thread."""
    ids = random_prompt(300, batch=2, seed=12)
    config = VeriCacheConfig(compressor="streaming_llm", compression_ratio=0.75, chunk_tokens=128)
    out = vericache_dict(deep_llama, ids, config=config, max_new_tokens=16)
    assert torch.equal(out.sequences, stock(deep_llama, ids, max_new_tokens=16))
    stats = out.vericache_stats
    assert stats.chunk_transfers == stats.bytes_to_device == stats.peak_staging_bytes == 0
    assert out.past_key_values.stream.transfers._last_thread is None


@pytest.mark.parametrize("compressor", ["streaming_llm", "snapkv"])
def test_a_model_split_between_an_accelerator_and_the_cpu_builds_every_layers_draft_tier(
    deep_llama, monkeypatch, compressor
):
    """As accelerate's `device_map` splits a model between a GPU and the CPU (tests/test_cuda.py runs it on one):
    the first layers stage their full tier as an accelerator's do and compress at prefill, the last ones read it in
    place and defer their draft tier to the first draft. Every layer's draft tier is built, and stays exact."""
    monkeypatch.setattr(VeriCacheLayer, "reads_in_place", property(lambda layer: layer.layer_idx >= 3))
    ids = random_prompt(120, batch=2, seed=13)
    config = VeriCacheConfig(
        compressor=compressor, compression_ratio=0.75, chunk_tokens=32, draft_length=4, draft_schedule="fixed"
    )
    out = vericache_dict(deep_llama, ids, config=config, max_new_tokens=16)
    assert torch.equal(out.sequences, stock(deep_llama, ids, max_new_tokens=16))
    cache, stats = out.past_key_values, out.vericache_stats
    assert all(layer.draft is not None for layer in cache.layers)
    assert stats.accepted_tokens > 0 and stats.chunk_transfers == 3 * (stats.rounds + stats.plain_rounds)


def test_a_transfer_failure_raises_from_generate_and_the_next_call_works(deep_llama, monkeypatch):
    ids = random_prompt(80, seed=13)
    original = HostSnapshot.copy_into
    calls = []

    def failing_copy(self, keys_out, values_out, *span):
        calls.append(1)
        if len(calls) == 9:  # layer 2 of the second verify pass
            raise OSError("injected transfer failure")
        return original(self, keys_out, values_out, *span)

    monkeypatch.setattr(HostSnapshot, "copy_into", failing_copy)
    with pytest.raises(TransferError, match="injected transfer failure"):
        vericache(deep_llama, ids, max_new_tokens=40)
    assert len(calls) == 9 and no_worker_left()
    monkeypatch.setattr(HostSnapshot, "copy_into", original)
    assert torch.equal(
        vericache(deep_llama, ids, max_new_tokens=20), stock(deep_llama, ids, max_new_tokens=20)
    )
    assert no_worker_left()


def benchmark(name: str):
    """The module `benchmarks/<name>.py` (benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_benchmark_runs_its_cpu_dry_run(tmp_path):
    bench = benchmark("gpu_offload")
    out = tmp_path / "rows.json"
    rows = bench.main(["--dry-run", "--batches", "2", "--json", str(out)])
    (row,) = rows
    assert row["vericache"]["tokens_per_s"] > 0 and row["full_kv"]["tokens_per_s"] > 0
    # Accounting on CPU: draft tier + two staging buffers against the whole KV cache of 6 layers.
    assert row["vericache"]["device_bytes"] < row["full_kv"]["device_bytes"]
    # Device to host per round: only the k + 1 accepted tokens (batch 2, 6 layers, 2 KV heads, K+V dims 8+8, fp32).
    assert row["vericache"]["bytes_to_host"] == 2 * 6 * 2 * (8 + 8) * (3 + 1) * 4
    assert json.loads(out.read_text()) == rows


def test_the_gpu_pass_width_benchmark_runs_its_cpu_dry_run(tmp_path):
    rows = benchmark("gpu_pass_width").main(["--dry-run", "--out", str(tmp_path / "rows.json")])
    widths = [row["width"] for row in rows if row["pass_"] == "draft tier"]
    assert widths == [1, 2, 4, 8, 11, 11, 8, 4, 2, 1] and all(row["ms"] > 0 for row in rows)
    assert [row["pass_"] for row in rows if row["model"] == "float32"] == [
        "draft tier, own",
        "draft tier, bf16 copy",
    ]
    assert json.loads((tmp_path / "rows.json").read_text())["rows"] == rows


def test_generate_under_inference_mode_matches_stock():
    """The transfer worker writes into buffers the caller made, also when the caller runs under inference_mode."""
    model = tiny_model("llama")
    ids = random_prompt(40, seed=11)
    expected = model.generate(ids, max_new_tokens=20, do_sample=False)
    with torch.inference_mode():
        got = model.generate(
            ids,
            max_new_tokens=20,
            do_sample=False,
            generation_mode="vericache",
            vericache_config=VeriCacheConfig(stage_on_cpu=True),
        )
    assert torch.equal(got, expected)


def test_staging_buffers_and_chunk_size_come_from_the_config(deep_llama):
    ids = random_prompt(300, batch=2, seed=5)
    config = VeriCacheConfig(
        compressor="streaming_llm", chunk_tokens=64, staging_buffers=3, stage_on_cpu=True
    )
    out = vericache_dict(deep_llama, ids, config=config, max_new_tokens=12)
    assert torch.equal(out.sequences, stock(deep_llama, ids, max_new_tokens=12))
    cfg = deep_llama.config
    token_bytes = (
        2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2 * 8
    )  # B=2, f64
    assert 0 < out.vericache_stats.peak_staging_bytes <= 3 * buffer_tokens(300 + 12 + 64) * token_bytes
    assert out.past_key_values.stream.transfers.buffers.num_buffers == 3


@pytest.mark.parametrize(
    "field, value",
    [("staging_buffers", 0), ("chunk_tokens", -1), ("transfer_timeout", 0), ("chunk_tokens", 1.5)],
)
def test_bad_transfer_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        VeriCacheConfig(**{field: value})


def test_the_gpu_serving_benchmark_runs_its_cpu_dry_run(tmp_path):
    """benchmarks/gpu_serving.py on a tiny model: the same KV budget holds more VeriCache requests than full-KV
    ones, their full tiers copied through the engine's queue (drafting every round: on a loaded CPU the cost-aware
    schedule may find a tiny model's drafts dearer than plain rounds). How much of the copying hid behind compute
    is for the benchmark to measure on a GPU: here a copy takes microseconds and a verify pass's wait for one is
    mostly the copy thread's wake-up, so the share only has to be a share."""
    bench = benchmark("gpu_serving")
    row = bench.main(["--dry-run", "--draft-schedule", "fixed", "--out", str(tmp_path)])
    assert row["at_once"] > row["full_kv_at_once"] >= 1
    assert row["vericache_tokens_per_s"] > 0 and row["full_kv_tokens_per_s"] > 0
    assert row["copy_GBps"] > 0 and 0 <= row["hidden_share"] <= 1
    assert json.loads((tmp_path / "results.json").read_text()) == [row]
