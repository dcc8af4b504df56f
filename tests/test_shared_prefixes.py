"""Prefix caching in the serving engine (`prefix/shared.py`): a prompt that starts with chunks an earlier request
kept prefills only the rest, and its output still equals stock `generate` of that prompt alone (float64); the
kept chunks stay within their memory, shortest-first from a prefix's end."""

from __future__ import annotations

import threading

import pytest
import torch

from vericache_hf import VeriCacheConfig, VeriCacheEngine
from vericache_hf.prefix.shared import SharedPrefixes

from .conftest import random_prompt, tiny_model
from .test_engine import stock

CHUNK = 16


@pytest.fixture(scope="module")
def served():
    return tiny_model("llama", num_hidden_layers=3)


def vericache(
    model, prompt: list[int], config: VeriCacheConfig, prefixes: SharedPrefixes, new: int
) -> list[int]:
    """One `generate` call that seeds its prefill from `prefixes` and keeps its prompt there."""
    out = model.generate(
        torch.tensor([prompt]),
        generation_mode="vericache",
        vericache_config=config,
        vericache_prefixes=prefixes,
        max_new_tokens=new,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def document_prompts() -> list[list[int]]:
    """Prompts over one shared document: its first 40 tokens, all 90, and 90 with other questions after them."""
    document = random_prompt(90, seed=7)[0].tolist()
    questions = [random_prompt(n, seed=20 + n)[0].tolist() for n in (13, 5, 30)]
    return [
        document + questions[0],
        document[:40] + questions[1],
        document + questions[1],
        document + questions[2],
    ]


@pytest.mark.parametrize(
    ("compressor", "kwargs"),
    [
        ("streaming_llm", {}),  # K/V only: its draft tier is built from the full tier when drafting starts
        ("snapkv", {"window_size": 8}),  # reads the last 8 queries: the rest of the prompt holds them
        ("kivi", {}),
    ],
)
def test_requests_after_a_shared_prefix_prefill_only_the_rest_and_stay_exact(served, compressor, kwargs):
    config = VeriCacheConfig(
        compressor=compressor, compression_ratio=0.5, compressor_kwargs=kwargs, prefix_chunk_tokens=CHUNK
    )
    inputs = document_prompts()
    with VeriCacheEngine(served, config, do_sample=False) as engine:
        first = engine.add_request(inputs[0], max_new_tokens=16)
        assert engine.get_result(first, timeout=120).generated_tokens == stock(served, inputs[0], 16)
        assert engine.prefix_stats()["prefix_tokens_reused"] == 0
        ids = engine.add_requests(inputs[1:], max_new_tokens=16)
        outputs = [engine.get_result(request_id, timeout=120) for request_id in ids]
        stats = engine.prefix_stats()
    for prompt, output in zip(inputs[1:], outputs, strict=True):
        assert output.error is None
        assert output.generated_tokens == stock(served, prompt, 16)
    # each later prompt started from the document's kept whole chunks (two of the 45-token one's; five of the
    # others', whose sixth holds their own question), leaving it the compressor's queries to prefill
    expected = (2 + 5 + 5) * CHUNK
    assert stats["prefix_hits"] == 3 and stats["prefix_tokens_reused"] == expected


def test_a_compressor_that_reads_every_prompt_query_prefills_whole(served):
    config = VeriCacheConfig(compressor="h2o", compression_ratio=0.5, prefix_chunk_tokens=CHUNK)
    inputs = document_prompts()[:1] + document_prompts()[2:3]
    with VeriCacheEngine(served, config, do_sample=False) as engine:
        outputs = [engine.get_result(engine.add_request(p, max_new_tokens=12), timeout=120) for p in inputs]
        stats = engine.prefix_stats()
    assert [o.generated_tokens for o in outputs] == [stock(served, p, 12) for p in inputs]
    assert stats["prefix_hits"] == 0 and stats["prefix_chunks_held"] == 0


def test_a_seeded_prefix_read_through_staging_buffers_stays_exact(served):
    """The path a GPU takes: the prefill reads the kept prefix through the transfer queue, not in place."""
    config = VeriCacheConfig(
        compressor="snapkv",
        compression_ratio=0.5,
        compressor_kwargs={"window_size": 8},
        prefix_chunk_tokens=CHUNK,
        stage_on_cpu=True,
    )
    prefixes = SharedPrefixes(served, 1 << 30, CHUNK)
    inputs = document_prompts()
    for prompt in inputs[:3]:
        assert vericache(served, prompt, config, prefixes, 16) == stock(served, prompt, 16)
    assert prefixes.stats()["prefix_hits"] == 2


def test_kept_chunks_stay_within_their_memory_and_shorten_from_the_end(served):
    chunk_bytes = 3 * 2 * 2 * CHUNK * 16 * 8  # layers x (K, V) x heads x tokens x head_dim x float64
    prefixes = SharedPrefixes(served, 4 * chunk_bytes, CHUNK)
    document = random_prompt(90, seed=7)[0].tolist()  # five whole chunks: one more than fits
    config = VeriCacheConfig(compressor="streaming_llm", prefix_chunk_tokens=CHUNK)
    for prompt in (document, document + [5, 6, 7]):
        vericache(served, prompt, config, prefixes, 2)
    stats = prefixes.stats()
    assert stats["prefix_bytes_held"] <= 4 * chunk_bytes and stats["prefix_chunks_held"] == 4
    assert stats["prefix_evictions"] >= 1
    # the second prompt found the document's first four chunks: its fifth was the one evicted
    assert stats["prefix_hits"] == 1 and stats["prefix_tokens_reused"] == 4 * CHUNK


def test_prefix_cache_memory_is_checked_and_can_be_off(served):
    with pytest.raises(ValueError, match="memory budget"):
        VeriCacheEngine(served, prefix_cache_memory="lots")
    engine = VeriCacheEngine(served, prefix_cache_memory=None)
    assert engine.prefix_stats() == {}
    engine.stop()


def test_requests_prefilling_side_by_side_share_prefixes_safely(served):
    """Each request alone on its own worker (`cohort_size=1`): prefills that seed from and keep chunks run at once,
    added from several threads; every output stays exact."""
    config = VeriCacheConfig(compressor="streaming_llm", compression_ratio=0.5, prefix_chunk_tokens=CHUNK)
    inputs = document_prompts() * 2
    with VeriCacheEngine(served, config, max_concurrent=4, cohort_size=1, do_sample=False) as engine:
        ids: dict[int, str] = {}
        threads = [
            threading.Thread(
                target=lambda i=i: ids.__setitem__(i, engine.add_request(inputs[i], max_new_tokens=12))
            )
            for i in range(len(inputs))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        outputs = [engine.get_result(ids[i], timeout=120) for i in range(len(inputs))]
        stats = engine.prefix_stats()
    assert [o.generated_tokens for o in outputs] == [stock(served, p, 12) for p in inputs]
    assert stats["prefix_hits"] + stats["prefix_misses"] == len(inputs) and stats["prefix_hits"] >= 1
