"""The full tier's host store and the transfer engine on CPU: chunked appends, ordering, backpressure, shutdown,
timeouts and failures. The same queue and worker thread serve CUDA; here (`stage_on_cpu=True`) copies go into
separate CPU buffers. By default a CPU consumer reads the host chunks in place, tested last."""

from __future__ import annotations

import threading

import pytest
import torch

from vericache_hf.cache.full_tier import HostKVStore, HostSnapshot
from vericache_hf.cache.staging import StagingBuffers
from vericache_hf.cache.transfer import TransferEngine, TransferError

from .conftest import no_worker_left


def filled_store(
    tokens: int, seed: int = 0, chunk_tokens: int = 16
) -> tuple[HostKVStore, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, tokens, 8, generator=generator)
    values = torch.randn(2, 3, tokens, 4, generator=generator)
    store = HostKVStore(chunk_tokens)
    store.append(keys[:, :, : tokens // 3], values[:, :, : tokens // 3])
    store.append(keys[:, :, tokens // 3 :], values[:, :, tokens // 3 :])
    return store, keys, values


def copy_all(snapshot, keys_out, values_out) -> int:
    """Copy a snapshot's tokens, chunk by chunk, into the first slots of (B, H, >=length, D) buffers."""
    moved = 0
    for chunk in range(snapshot.num_chunks):
        start, take = snapshot.chunk_span(chunk)
        span = slice(start, start + take)
        moved += snapshot.copy_chunk_into(chunk, keys_out[:, :, span], values_out[:, :, span])
    return moved


def test_store_appends_in_place_across_chunks_and_rolls_back_by_length():
    store, keys, values = filled_store(50)
    first_chunk = store.key_chunks[0]
    pointer = first_chunk.data_ptr()
    store.append(keys[:, :, :40], values[:, :, :40])  # grows by whole chunks
    assert store.key_chunks[0] is first_chunk and first_chunk.data_ptr() == pointer
    assert store.length == 90 and store.capacity == 96
    out_keys, out_values = torch.empty(2, 3, 90, 8), torch.empty(2, 3, 90, 4)
    assert copy_all(store.snapshot(), out_keys, out_values) == store.nbytes() == 90 * 2 * 3 * (8 + 4) * 4
    assert torch.equal(out_keys, torch.cat([keys, keys[:, :, :40]], dim=2))
    assert torch.equal(out_values, torch.cat([values, values[:, :, :40]], dim=2))
    store.truncate(50)
    assert store.length == 50 and store.key_chunks[0] is first_chunk


def test_a_snapshot_is_not_disturbed_by_later_appends():
    store, keys, values = filled_store(20)
    snapshot = store.snapshot()
    store.append(keys, values)
    out_keys, out_values = torch.zeros(2, 3, 40, 8), torch.zeros(2, 3, 40, 4)
    copy_all(snapshot, out_keys, out_values)
    assert torch.equal(out_keys[:, :, :20], keys) and not out_keys[:, :, 20:].any()


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="chunk_tokens"):
        HostKVStore(0)
    with pytest.raises(ValueError, match="staging buffers"):
        StagingBuffers(0)
    with pytest.raises(ValueError, match="timeout"):
        TransferEngine(timeout=0)
    with pytest.raises(ValueError, match="prefill"):
        HostKVStore().snapshot()


def test_chunks_arrive_in_order_with_the_stored_tokens():
    engine = TransferEngine(num_buffers=2, timeout=10, stage_on_cpu=True)
    stores = [filled_store(30 + 7 * i, seed=i) for i in range(5)]
    layers = [engine.submit(store, "cpu", label=i) for i, (store, _, _) in enumerate(stores)]
    for chunks, (store, keys, values) in zip(layers, stores, strict=True):
        assert [t.chunk for t in chunks] == list(range(-(-store.length // 16)))
        got_keys = []
        for transfer in chunks:
            chunk_keys, chunk_values = engine.wait(transfer)
            span = slice(transfer.start, transfer.start + transfer.tokens)
            assert torch.equal(chunk_values, values[:, :, span]) and transfer.seconds > 0
            got_keys.append(chunk_keys.clone())
            engine.release(transfer)
        assert torch.equal(torch.cat(got_keys, dim=2), keys)
        assert sum(t.bytes for t in chunks) == store.nbytes()
    assert all(t.state == "released" for chunks in layers for t in chunks)
    assert no_worker_left()


@pytest.mark.parametrize("num_buffers", [1, 2, 3])
def test_backpressure_bounds_the_chunks_on_the_device(num_buffers):
    engine = TransferEngine(num_buffers=num_buffers, timeout=10, stage_on_cpu=True)
    stores = [filled_store(12, seed=i)[0] for i in range(5)]  # one chunk each
    transfers = [transfer for store in stores for transfer in engine.submit(store, "cpu")]
    for transfer in transfers[:num_buffers]:
        engine.wait(transfer)
    # Every slot is held: the next transfers wait in the backlog, without a buffer.
    assert [t.state for t in transfers[num_buffers:]] == ["backlog"] * (5 - num_buffers)
    assert engine.buffers.held == num_buffers and len(engine.buffers.pairs) == num_buffers
    engine.release(transfers[0])
    engine.wait(transfers[num_buffers])
    assert len(engine.buffers.pairs) == num_buffers  # the freed slot's buffer was reused
    for transfer in transfers:
        engine.release(transfer)
    assert engine.buffers.held == 0 and all(store.transfers_in_flight == 0 for store in stores)
    assert no_worker_left()


@pytest.mark.parametrize("tokens", [20, 250, 1000])
def test_staging_buffers_are_chunk_sized_whatever_the_length(tokens):
    engine = TransferEngine(num_buffers=2, timeout=10, stage_on_cpu=True)
    store, _, _ = filled_store(tokens)
    for transfer in engine.submit(store, "cpu"):
        engine.wait(transfer)
        engine.release(transfer)
    assert engine.buffers.peak_bytes == 2 * 2 * 3 * 16 * (8 + 4) * 4  # two 16-token chunks of (B=2, H=3)


def test_truncating_a_store_with_a_transfer_in_flight_is_refused():
    engine = TransferEngine(timeout=10, stage_on_cpu=True)
    store, _, _ = filled_store(30)
    transfers = engine.submit(store, "cpu")  # two chunks
    with pytest.raises(RuntimeError, match="in flight"):
        store.truncate(10)
    for transfer in transfers:  # as the verify pass does: read each chunk, then release it
        engine.wait(transfer)
        engine.release(transfer)
    store.truncate(10)


def test_a_failure_in_the_worker_raises_in_the_caller_and_leaves_the_engine_usable(monkeypatch):
    engine = TransferEngine(num_buffers=2, timeout=10, stage_on_cpu=True)
    original = HostSnapshot.copy_chunk_into
    stores = [filled_store(12, seed=i)[0] for i in range(4)]

    all_submitted = threading.Event()

    def failing_copy(self, chunk, keys_out, values_out):
        # Only this test's second store fails, and only once the whole request is queued: a failure cancels what
        # is pending, and a transfer submitted after the failure is a new request's business.
        if self.key_chunks[0] is stores[1].key_chunks[0]:
            all_submitted.wait(10)
            raise OSError("injected DMA failure")
        return original(self, chunk, keys_out, values_out)

    monkeypatch.setattr(HostSnapshot, "copy_chunk_into", failing_copy)
    group = object()
    transfers = [engine.submit(store, "cpu", group=group, label=i)[0] for i, store in enumerate(stores)]
    all_submitted.set()
    engine.wait(transfers[0])
    engine.release(transfers[0])
    with pytest.raises(TransferError, match="injected DMA failure"):
        engine.wait(transfers[1])
    for later in transfers[2:]:  # the rest of the failed request is cancelled, not left waiting
        with pytest.raises(TransferError, match="cancelled"):
            engine.wait(later)
    assert no_worker_left() and not engine.worker_alive
    assert engine.buffers.held == 0 and all(store.transfers_in_flight == 0 for store in stores)

    monkeypatch.setattr(HostSnapshot, "copy_chunk_into", original)
    store, keys, _ = filled_store(12, seed=9)
    (transfer,) = engine.submit(store, "cpu")
    assert torch.equal(engine.wait(transfer)[0], keys)
    engine.release(transfer)


def test_a_stuck_worker_times_out_in_the_caller_and_close_stops_it(monkeypatch):
    engine = TransferEngine(num_buffers=2, timeout=0.5, stage_on_cpu=True)
    unblock = threading.Event()
    original = HostSnapshot.copy_chunk_into

    def stuck_copy(self, chunk, keys_out, values_out):
        unblock.wait(10)
        return original(self, chunk, keys_out, values_out)

    monkeypatch.setattr(HostSnapshot, "copy_chunk_into", stuck_copy)
    transfers = [engine.submit(filled_store(12, seed=i)[0], "cpu", label=i)[0] for i in range(3)]
    with pytest.raises(TransferError, match="did not finish"):
        engine.wait(transfers[0])
    assert transfers[2].state == "cancelled"
    unblock.set()
    engine.close()
    assert no_worker_left()


def test_close_cancels_pending_transfers_and_stops_the_worker():
    engine = TransferEngine(num_buffers=1, timeout=10, stage_on_cpu=True)
    stores = [filled_store(12, seed=i)[0] for i in range(3)]
    transfers = [engine.submit(store, "cpu")[0] for store in stores]
    engine.wait(transfers[0])
    engine.close()
    for transfer in transfers[1:]:
        with pytest.raises(TransferError, match="cancelled"):
            engine.wait(transfer)
    engine.release(transfers[0])
    assert no_worker_left() and engine.buffers.held == 0


def test_by_default_a_cpu_consumer_reads_the_host_chunks_in_place():
    """No copy and no thread when the device is the host; the store still may not shrink under the reader."""
    store, keys, values = filled_store(40)
    engine = TransferEngine(num_buffers=1, timeout=10)
    transfers = engine.submit(store, "cpu")
    assert [t.state for t in transfers] == ["ready"] * 3 and engine._last_thread is None
    got = [engine.wait(t) for t in transfers]  # one buffer slot, yet all three are readable at once
    for transfer, (chunk_keys, _) in zip(transfers, got, strict=True):
        assert chunk_keys.data_ptr() == store.key_chunks[transfer.chunk].data_ptr() and transfer.bytes == 0
    assert torch.equal(torch.cat([k for k, _ in got], dim=2), keys)
    assert torch.equal(torch.cat([v for _, v in got], dim=2), values)
    with pytest.raises(RuntimeError, match="in flight"):
        store.truncate(10)
    for transfer in transfers:
        engine.release(transfer)
    store.truncate(10)
    assert engine.buffers.device_bytes() == 0 and engine._last_thread is None
