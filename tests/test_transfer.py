"""The full tier's host store and the transfer engine on CPU: in-place appends into one growable buffer, snapshots,
layer transfers in order, backpressure, staging buffer sizes, shutdown, timeouts and failures. The same queue and
worker thread serve CUDA; here the copies go into separate CPU staging buffers (what `stage_on_cpu=True` uses). By
default a CPU layer reads its full tier in place (`extend_view` + `commit_in_place`), tested last."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from transformers import LogitsProcessorList

from vericache_hf import VeriCacheConfig
from vericache_hf.cache.full_tier import HostKVStore, HostSnapshot
from vericache_hf.cache.staging import StagingBuffers, buffer_tokens
from vericache_hf.cache.transfer import WORKER_THREAD_NAME, TransferEngine, TransferError

from .conftest import no_worker_left, random_prompt, tiny_model

BYTES_PER_TOKEN = 2 * 3 * (8 + 4) * 4  # (B=2, H=3), key dim 8 + value dim 4, float32


def random_kv(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, tokens, 8, generator=generator), torch.randn(
        2, 3, tokens, 4, generator=generator
    )


def filled_store(
    tokens: int, seed: int = 0, chunk_tokens: int = 16
) -> tuple[HostKVStore, torch.Tensor, torch.Tensor]:
    """A store holding `tokens` random tokens, appended in two parts (so it has grown once at least)."""
    keys, values = random_kv(tokens, seed)
    store = HostKVStore(chunk_tokens)
    store.append(keys[:, :, : tokens // 3], values[:, :, : tokens // 3])
    store.append(keys[:, :, tokens // 3 :], values[:, :, tokens // 3 :])
    return store, keys, values


def copied(snapshot: HostSnapshot, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A snapshot's tokens copied into zeroed buffers with `extra` slots after them, and the bytes reported."""
    batch, heads, key_dim, value_dim = snapshot.shape
    keys = torch.zeros(batch, heads, snapshot.length + extra, key_dim)
    values = torch.zeros(batch, heads, snapshot.length + extra, value_dim)
    moved = snapshot.copy_into(keys, values)
    return keys, values, moved


def test_store_appends_in_place_grows_by_doubling_and_rolls_back_by_length():
    store, keys, values = filled_store(50)  # 16 tokens (capacity 16), then 34 more: grows to 50 -> 64
    assert store.length == 50 and store.capacity == 64
    buffer, pointer = store.keys, store.keys.data_ptr()
    store.append(keys[:, :, :10], values[:, :, :10])  # fits: written in place, after the stored tokens
    assert store.keys is buffer and store.keys.data_ptr() == pointer and store.capacity == 64
    store.append(keys[:, :, 10:40], values[:, :, 10:40])  # 90 > 64: doubles to 128, in whole chunks
    assert store.length == 90 and store.capacity == 128 and store.keys is not buffer
    expected_keys = torch.cat([keys, keys[:, :, :40]], dim=2)
    expected_values = torch.cat([values, values[:, :, :40]], dim=2)
    got_keys, got_values = store.view()  # the data survived the growth
    assert torch.equal(got_keys, expected_keys) and torch.equal(got_values, expected_values)
    assert store.nbytes() == store.snapshot().nbytes() == 90 * BYTES_PER_TOKEN
    out_keys, out_values, moved = copied(store.snapshot())
    assert moved == store.nbytes()
    assert torch.equal(out_keys, expected_keys) and torch.equal(out_values, expected_values)

    grown = store.keys
    store.truncate(50)  # rollback: only the length moves
    assert store.length == 50 and store.keys is grown and store.capacity == 128
    more_keys, more_values = random_kv(5, seed=1)
    store.append(more_keys, more_values)  # written over the rolled-back slots
    assert store.keys is grown and store.length == 55
    got_keys, got_values = store.view()
    assert torch.equal(got_keys, torch.cat([keys, more_keys], dim=2))
    assert torch.equal(got_values, torch.cat([values, more_values], dim=2))


def test_a_large_first_append_and_reserve_round_up_to_whole_chunks():
    store = HostKVStore(chunk_tokens=16)
    keys, values = random_kv(40)
    store.append(keys, values)
    assert store.capacity == 48 and torch.equal(store.view()[0], keys)
    store.reserve(100, keys, values)  # max(100, 2 * 48) rounded up to chunks
    assert store.capacity == 112 and store.length == 40 and torch.equal(store.view()[1], values)
    store.reserve(50, keys, values)  # already room: nothing moves
    assert store.capacity == 112


def test_a_snapshot_is_not_disturbed_by_later_appends_or_growth():
    store, keys, values = filled_store(20)  # capacity 32
    snapshot = store.snapshot()
    more_keys, more_values = random_kv(8, seed=1)
    store.append(more_keys, more_values)  # in place, after the snapshot's tokens
    assert store.keys is snapshot.keys
    out_keys, out_values, moved = copied(snapshot, extra=20)
    assert moved == 20 * BYTES_PER_TOKEN == snapshot.nbytes()
    assert torch.equal(out_keys[:, :, :20], keys) and torch.equal(out_values[:, :, :20], values)
    assert not out_keys[:, :, 20:].any() and not out_values[:, :, 20:].any()

    store.append(*random_kv(100, seed=2))  # grows: later writes go to new buffers
    assert store.keys is not snapshot.keys
    out_keys, out_values, _ = copied(snapshot)
    assert torch.equal(out_keys, keys) and torch.equal(out_values, values)
    assert torch.equal(store.view()[0][:, :, 20:28], more_keys)


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="chunk_tokens"):
        HostKVStore(0)
    with pytest.raises(ValueError, match="staging buffers"):
        StagingBuffers(0)
    with pytest.raises(ValueError, match="staging buffers"):
        TransferEngine(num_buffers=0)
    with pytest.raises(ValueError, match="timeout"):
        TransferEngine(timeout=0)
    with pytest.raises(ValueError, match="prefill"):
        HostKVStore().snapshot()
    with pytest.raises(ValueError, match="prefill"):
        TransferEngine(timeout=10).submit(HostKVStore(), "cpu")
    store, _, _ = filled_store(10)
    for length in (-1, 11):
        with pytest.raises(ValueError, match="cannot truncate"):
            store.truncate(length)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory"):
            HostKVStore(pin_memory=True)
    assert no_worker_left()


def test_layers_arrive_in_submission_order_with_exactly_the_stored_tokens(monkeypatch):
    engine = TransferEngine(num_buffers=2, timeout=10)
    stores = [filled_store(30 + 7 * i, seed=i) for i in range(5)]
    order, original = [], HostSnapshot.copy_into

    def recording_copy(self, keys_out, values_out, *span):
        order.append(next(i for i, (store, _, _) in enumerate(stores) if store.keys is self.keys))
        return original(self, keys_out, values_out, *span)

    monkeypatch.setattr(HostSnapshot, "copy_into", recording_copy)
    layers = [engine.submit(store, "cpu", label=i, room=3) for i, (store, _, _) in enumerate(stores)]
    for transfer, (store, keys, values) in zip(layers, stores, strict=True):
        got_keys, got_values = engine.wait(transfer)
        assert transfer.state == "ready" and transfer.tokens == store.length == keys.shape[2]
        assert got_keys.shape[2] >= transfer.tokens + 3  # the layer, then room for the verified tokens
        assert torch.equal(got_keys[:, :, : transfer.tokens], keys)
        assert torch.equal(got_values[:, :, : transfer.tokens], values)
        assert transfer.bytes == store.nbytes() and transfer.seconds > 0
        engine.release(transfer)
        assert transfer.state == "released" and store.transfers_in_flight == 0
    assert order == list(range(5))
    assert engine.buffers.held == 0
    engine.close()
    assert no_worker_left()


@pytest.mark.parametrize("num_buffers", [1, 2, 3])
def test_backpressure_bounds_the_layers_on_the_device(num_buffers):
    engine = TransferEngine(num_buffers=num_buffers, timeout=10)
    stores = [filled_store(12, seed=i)[0] for i in range(5)]
    transfers = [engine.submit(store, "cpu", label=i) for i, store in enumerate(stores)]
    for transfer in transfers[:num_buffers]:
        engine.wait(transfer)
    # Every slot is held: the next transfers wait in the backlog, without a buffer.
    assert [t.state for t in transfers[num_buffers:]] == ["backlog"] * (5 - num_buffers)
    assert all(t.keys is None and t.slot is None for t in transfers[num_buffers:])
    assert engine.buffers.held == num_buffers and len(engine.buffers.pairs) == num_buffers
    freed = transfers[0].keys
    engine.release(transfers[0])
    engine.wait(transfers[num_buffers])
    assert len(engine.buffers.pairs) == num_buffers  # the freed slot's buffer was reused
    assert transfers[num_buffers].keys is freed
    for transfer in transfers:
        engine.release(transfer)
    assert engine.buffers.held == 0 and all(store.transfers_in_flight == 0 for store in stores)
    # Released unread, a transfer still waiting for a slot (or for the worker) is cancelled, not copied.
    assert all(t.state in ("released", "cancelled") for t in transfers)
    assert [t.state for t in transfers[: num_buffers + 1]] == ["released"] * (num_buffers + 1)
    engine.close()
    assert no_worker_left()


@pytest.mark.parametrize("tokens", [20, 250, 1000])
def test_staging_buffers_hold_the_layer_plus_room_and_are_reused_while_large_enough(tokens):
    engine = TransferEngine(num_buffers=1, timeout=10)
    store, keys, _ = filled_store(tokens)
    transfer = engine.submit(store, "cpu", room=7)
    got_keys, got_values = engine.wait(transfer)
    capacity = buffer_tokens(tokens + 7)
    assert got_keys.shape == (2, 3, capacity, 8) and got_values.shape == (2, 3, capacity, 4)
    assert capacity >= tokens + 7 and torch.equal(got_keys[:, :, :tokens], keys)
    assert engine.buffers.peak_bytes == engine.buffers.device_bytes() == capacity * BYTES_PER_TOKEN
    engine.release(transfer)

    # A longer layer that still fits reuses the slot's buffers.
    store.append(*random_kv(capacity - tokens - 7, seed=3))
    transfer = engine.submit(store, "cpu", room=7)
    assert engine.wait(transfer)[0] is got_keys
    engine.release(transfer)

    # One more token than fits: the buffers are replaced (the old pair is freed first).
    store.append(*random_kv(1, seed=4))
    transfer = engine.submit(store, "cpu", room=7)
    bigger_keys, _ = engine.wait(transfer)
    assert bigger_keys is not got_keys and bigger_keys.shape[2] == buffer_tokens(capacity + 1)
    assert (
        engine.buffers.device_bytes() == bigger_keys.shape[2] * BYTES_PER_TOKEN == engine.buffers.peak_bytes
    )
    assert torch.equal(bigger_keys[:, :, :tokens], keys)
    engine.release(transfer)

    # Another shape (here: one row) or dtype does not fit either.
    other = HostKVStore(16)
    other.append(*(t[:1].double() for t in random_kv(5, seed=5)))
    transfer = engine.submit(other, "cpu")
    other_keys, _ = engine.wait(transfer)
    assert other_keys.shape[:2] == (1, 3) and other_keys.dtype == torch.float64
    engine.release(transfer)
    engine.close()
    assert len(engine.buffers.pairs) == 1 and no_worker_left()


def test_truncating_a_store_with_a_transfer_in_flight_is_refused():
    engine = TransferEngine(timeout=10)
    store, keys, values = filled_store(30)
    transfer = engine.submit(store, "cpu")
    with pytest.raises(RuntimeError, match="in flight"):
        store.truncate(10)
    engine.wait(transfer)
    with pytest.raises(
        RuntimeError, match="in flight"
    ):  # ready is still in flight: the buffers are being read
        store.truncate(10)
    with pytest.raises(RuntimeError, match="being transferred"):
        store.extend_view(keys[:, :, :2], values[:, :, :2])
    engine.release(transfer)  # as the verify pass does once it has attended to the layer
    store.truncate(10)
    engine.close()
    assert store.length == 10 and no_worker_left()


def test_a_failure_in_the_worker_raises_in_the_caller_and_leaves_the_engine_usable(monkeypatch):
    engine = TransferEngine(num_buffers=2, timeout=10)
    original = HostSnapshot.copy_into
    stores = [filled_store(12, seed=i)[0] for i in range(4)]

    all_submitted = threading.Event()

    def failing_copy(self, keys_out, values_out, *span):
        # Only this test's second store fails, and only once the whole request is queued: a failure cancels what
        # is pending, and a transfer submitted after the failure is a new request's business.
        if self.keys is stores[1].keys:
            all_submitted.wait(10)
            raise OSError("injected DMA failure")
        return original(self, keys_out, values_out, *span)

    monkeypatch.setattr(HostSnapshot, "copy_into", failing_copy)
    group = object()
    transfers = [engine.submit(store, "cpu", group=group, label=i) for i, store in enumerate(stores)]
    all_submitted.set()
    engine.wait(transfers[0])
    engine.release(transfers[0])
    with pytest.raises(TransferError, match="injected DMA failure"):
        engine.wait(transfers[1])
    assert transfers[1].state == "failed"
    for later in transfers[2:]:  # the rest of the failed request is cancelled, not left waiting
        with pytest.raises(TransferError, match="cancelled"):
            engine.wait(later)
        assert later.state == "cancelled"
    assert engine.worker_alive  # a failed copy fails its transfer, not the worker
    assert engine.buffers.held == 0 and all(store.transfers_in_flight == 0 for store in stores)
    for transfer in transfers:  # releasing a failed or cancelled transfer is harmless
        engine.release(transfer)
    assert engine.buffers.held == 0

    monkeypatch.setattr(HostSnapshot, "copy_into", original)
    store, keys, _ = filled_store(12, seed=9)
    transfer = engine.submit(store, "cpu")
    assert torch.equal(engine.wait(transfer)[0][:, :, :12], keys)
    engine.release(transfer)
    engine.close()
    assert no_worker_left()


def test_a_stuck_worker_times_out_in_the_caller_and_close_stops_it(monkeypatch):
    engine = TransferEngine(num_buffers=2, timeout=0.5)
    unblock = threading.Event()
    original = HostSnapshot.copy_into

    def stuck_copy(self, keys_out, values_out, *span):
        unblock.wait(10)
        return original(self, keys_out, values_out, *span)

    monkeypatch.setattr(HostSnapshot, "copy_into", stuck_copy)
    stores = [filled_store(12, seed=i)[0] for i in range(3)]
    transfers = [engine.submit(store, "cpu", label=i) for i, store in enumerate(stores)]
    with pytest.raises(TransferError, match="did not finish"):
        engine.wait(transfers[0])
    # The timeout cancels what of the request has not started: one queued (holding a slot), one in the backlog.
    assert [t.state for t in transfers] == ["copying", "cancelled", "cancelled"]
    assert engine.buffers.held == 1
    unblock.set()
    engine.close()
    assert no_worker_left() and not engine.worker_alive
    assert transfers[0].state == "ready"
    engine.release(transfers[0])
    assert engine.buffers.held == 0 and all(store.transfers_in_flight == 0 for store in stores)


def test_close_cancels_pending_transfers_and_stops_the_worker():
    engine = TransferEngine(num_buffers=1, timeout=10)
    stores = [filled_store(12, seed=i)[0] for i in range(3)]
    transfers = [engine.submit(store, "cpu") for store in stores]
    engine.wait(transfers[0])
    engine.close()
    for transfer in transfers[1:]:
        with pytest.raises(TransferError, match="cancelled"):
            engine.wait(transfer)
    engine.release(transfers[0])
    assert no_worker_left() and engine.buffers.held == 0
    assert all(store.transfers_in_flight == 0 for store in stores)


def test_a_cpu_verify_pass_reads_the_store_in_place_and_commits_by_length():
    """`extend_view` writes the verified tokens after the stored ones without committing them and returns views of
    the store's own buffers (no copy, no engine, no thread); `commit_in_place` keeps the accepted ones."""
    store, keys, values = filled_store(20)  # capacity 32
    new_keys, new_values = random_kv(5, seed=1)
    seen_keys, seen_values = store.extend_view(new_keys, new_values)
    assert seen_keys.data_ptr() == store.keys.data_ptr() and seen_values.data_ptr() == store.values.data_ptr()
    assert torch.equal(seen_keys, torch.cat([keys, new_keys], dim=2))
    assert torch.equal(seen_values, torch.cat([values, new_values], dim=2))
    assert store.length == 20 and store.nbytes() == 20 * BYTES_PER_TOKEN  # nothing committed yet

    assert store.commit_in_place(3) == 3 * BYTES_PER_TOKEN
    assert store.length == 23
    got_keys, got_values = store.view()
    assert torch.equal(got_keys, torch.cat([keys, new_keys[:, :, :3]], dim=2))
    assert torch.equal(got_values, torch.cat([values, new_values[:, :, :3]], dim=2))

    # A pass that accepts nothing leaves the store as it was; the next pass writes over its tokens.
    store.extend_view(*random_kv(4, seed=2))
    assert store.commit_in_place(0) == 0 and store.length == 23
    assert torch.equal(store.view()[0], got_keys)

    # A pass past the capacity grows the buffer first, keeping the stored tokens.
    buffer = store.keys
    long_keys, long_values = random_kv(30, seed=3)
    seen_keys, seen_values = store.extend_view(long_keys, long_values)
    assert store.keys is not buffer and store.capacity >= 53
    assert torch.equal(seen_keys, torch.cat([got_keys, long_keys], dim=2))
    store.commit_in_place(30)
    assert store.length == 53 and torch.equal(store.view()[1], torch.cat([got_values, long_values], dim=2))
    assert no_worker_left()


def test_commit_in_place_keeps_no_more_than_the_last_pass_wrote():
    store, _, _ = filled_store(20)
    store.extend_view(*random_kv(2, seed=1))
    with pytest.raises(ValueError, match="wrote 2"):
        store.commit_in_place(10)
    assert store.length == 20
    store.commit_in_place(2)
    with pytest.raises(ValueError, match="wrote 0"):
        store.commit_in_place(1)  # each pass commits once


def test_an_emulated_link_makes_each_copy_take_its_time_on_that_link():
    """Benchmarks only: with `link_bytes_per_s` a copy is not ready before its bytes could have crossed the link."""
    store, keys, values = filled_store(40)
    engine = TransferEngine(num_buffers=2, link_bytes_per_s=1e6)
    transfer = engine.submit(store, "cpu")
    got_keys, got_values = engine.wait(transfer)
    assert torch.equal(got_keys[:, :, :40], keys) and torch.equal(got_values[:, :, :40], values)
    assert transfer.bytes == 40 * BYTES_PER_TOKEN
    assert transfer.seconds >= transfer.bytes / 1e6
    engine.release(transfer)
    engine.close()
    assert TransferEngine().link_bytes_per_s is None  # never on by default
    with pytest.raises(ValueError, match="link_bytes_per_s must be"):
        TransferEngine(link_bytes_per_s=0)


def test_a_shared_engine_gives_each_group_its_share_of_the_slots():
    """Request A queued all its layers first and is still drafting (reads none); request B, which submits after it,
    still gets its slots and its layers copied, instead of waiting behind A's backlog."""
    engine = TransferEngine(num_buffers=4, timeout=10, slots_per_group=2)
    drafting, verifying = object(), object()
    early = [engine.submit(filled_store(12, seed=i)[0], "cpu", group=drafting, label=i) for i in range(5)]
    late = [engine.submit(filled_store(12, seed=9 + i)[0], "cpu", group=verifying, label=i) for i in range(3)]
    assert sum(t.state != "backlog" for t in early) == 2
    for transfer in late[:2]:
        engine.wait(transfer)  # copied while the first group holds its two slots, unread
    assert late[2].state == "backlog"
    engine.release(late[0])
    engine.wait(late[2])  # the freed slot goes back to the same group, whose next layer is waiting
    assert sum(t.state != "backlog" for t in early) == 2
    for transfer in early + late:
        engine.release(transfer)
    assert engine.buffers.held == 0 and not engine._held
    engine.close()
    engine.close()
    assert no_worker_left()


def transfer_workers() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == WORKER_THREAD_NAME]


def test_one_worker_serves_the_engine_between_rounds_until_it_is_closed_or_collected():
    before = set(transfer_workers())
    engine = TransferEngine(num_buffers=1, timeout=10)
    seen = []
    for seed in range(3):  # rounds, with the engine idle between them
        store, keys, _ = filled_store(12, seed=seed)
        transfer = engine.submit(store, "cpu")
        assert torch.equal(engine.wait(transfer)[0][:, :, :12], keys)
        engine.release(transfer)
        (worker,) = set(transfer_workers()) - before
        worker.join(0.2)  # idle: it waits for the next round instead of exiting
        assert worker.is_alive()
        seen.append(worker)
    assert seen == [seen[0]] * 3
    engine.close()
    assert not seen[0].is_alive()

    store, keys, _ = filled_store(12)  # a closed engine still serves: its next transfer starts a worker
    transfer = engine.submit(store, "cpu")
    assert torch.equal(engine.wait(transfer)[0][:, :, :12], keys)
    engine.release(transfer)
    (worker,) = set(transfer_workers()) - before
    del engine, transfer  # nobody holds the engine: collecting it stops its worker
    gc.collect()
    worker.join(5)
    assert not worker.is_alive()


def test_a_call_staging_on_the_cpu_keeps_one_worker_for_all_its_rounds_and_leaves_none():
    """The verify pass of every round reads its full tier through the transfer engine; the same worker serves them
    all, and the call's end stops it."""
    model = tiny_model("llama", num_hidden_layers=3)
    ids = random_prompt(60, seed=4)
    expected = model.generate(ids, do_sample=False, max_new_tokens=24)
    before = set(transfer_workers())
    seen: list[list[threading.Thread]] = []

    def observe(input_ids, scores):
        seen.append(sorted(set(transfer_workers()) - before, key=id))
        return scores

    config = VeriCacheConfig(
        compressor="streaming_llm", draft_length=4, draft_schedule="fixed", stage_on_cpu=True, chunk_tokens=32
    )
    out = model.generate(
        ids,
        do_sample=False,
        max_new_tokens=24,
        generation_mode="vericache",
        vericache_config=config,
        logits_processor=LogitsProcessorList([observe]),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, expected)
    assert out.vericache_stats.rounds >= 3 and out.vericache_stats.chunk_transfers > 0
    served = seen[next(i for i, workers in enumerate(seen) if workers) :]  # from the first verify pass on
    assert len(served) >= 3 and all(len(workers) == 1 for workers in served), served
    assert all(workers == served[0] for workers in served)  # one thread, not one a round
    served[0][0].join(5)
    assert not served[0][0].is_alive()
