"""On a CUDA GPU, the accelerator path that the CPU tests reach only through `stage_on_cpu=True`: the full tier in
pinned host memory, copied layer by layer into staging buffers on the transfer engine's own CUDA stream, greedy
output equal to stock `generate` (float64, so batched and sequential passes agree to the last bit), a failure in the
worker raised in the caller, and a model split across devices by accelerate with each layer's tiers on that layer's
device (the GPU layers staged, the CPU layers reading their full tier in place), engine workers each computing on
its own CUDA stream, composed drafting (prompt lookup and an assistant model proposing), and a stored prefix reused
with its draft tier on the GPU while its full tier loads into pinned host memory behind drafting.

Skipped without CUDA. On a GPU machine: `python -m pytest tests/test_cuda.py`."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from vericache_hf import VeriCacheConfig, VeriCacheEngine
from vericache_hf.cache.full_tier import HostSnapshot
from vericache_hf.cache.staging import buffer_tokens
from vericache_hf.cache.streaming import DEFAULT_ROOM
from vericache_hf.cache.transfer import TransferError
from vericache_hf.compat import CACHE_OUTPUT_FIELD
from vericache_hf.prefix import DiskStore, ThrottledStore

from .conftest import no_worker_left, random_prompt, tiny_model
from .test_prefix_reuse import CHUNK, corrupt, request
from .test_prefix_reuse import vericache as vericache_with_store
from .test_proposers import assistant_model, repeat_tail

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW_TOKENS = 40


def padded_batch(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 150, 110 and 60 tokens, left-padded: the full tier's rows mix padding and prompt."""
    ids = random_prompt(150, batch=3, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    mask[2, :90] = 0
    ids[mask == 0] = 0
    return ids.to(device), mask.to(device)


def vericache_generate(model, ids, mask, config: VeriCacheConfig, **kwargs):
    return model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        generation_mode="vericache",
        vericache_config=config,
        **kwargs,
    )


def generate_both(model, ids, mask, config: VeriCacheConfig):
    """(stock greedy sequences on the full cache, VeriCache's dict output)."""
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS)
    return expected, vericache_generate(model, ids, mask, config, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def cuda_llama():
    return tiny_model("llama").to("cuda")


@pytest.mark.parametrize("compressor", ["streaming_llm", "snapkv", "kivi"])
def test_greedy_on_cuda_matches_stock_with_a_pinned_full_tier_staged_over_the_transfer_stream(
    cuda_llama, compressor
):
    ids, mask = padded_batch("cuda")
    config = VeriCacheConfig(
        compressor=compressor, compression_ratio=0.75, chunk_tokens=32, draft_length=6, draft_schedule="fixed"
    )
    expected, out = generate_both(cuda_llama, ids, mask, config)
    assert torch.equal(out.sequences, expected)

    cache, stats = getattr(out, CACHE_OUTPUT_FIELD), out.vericache_stats
    for layer in cache.layers:
        assert layer.device.type == "cuda" and layer.draft.valid.device.type == "cuda"
        assert layer.full.keys.is_pinned() and layer.full.values.is_pinned()
        assert not layer.reads_in_place
    assert torch.device("cuda", torch.cuda.current_device()) in cache.stream.transfers._streams
    assert stats.rounds > 0 and stats.accepted_tokens > 0
    # One transfer per layer and verify pass (drafting rounds and plain ones alike), all of them released.
    passes = stats.rounds + stats.plain_rounds
    assert stats.chunk_transfers == passes * len(cache.layers)
    assert cache.stream.transfers.buffers.held == 0 and all(
        layer.full.transfers_in_flight == 0 for layer in cache.layers
    )
    # Every verify pass stages the whole full tier, so at least the prompt's K/V (150 tokens a row) each pass.
    prompt_bytes = 150 * sum(
        layer.full.keys[:, :, 0].nbytes + layer.full.values[:, :, 0].nbytes for layer in cache.layers
    )
    assert stats.bytes_to_device >= passes * prompt_bytes and stats.transfer_seconds > 0
    # Two staging slots of one layer each, with room for the verified tokens (a draft's, or the default room).
    room = max(config.max_draft_length + 1, DEFAULT_ROOM)
    full = cache.layers[0].full
    per_token = full.keys[:, :, 0].nbytes + full.values[:, :, 0].nbytes
    assert 0 < stats.peak_staging_bytes <= 2 * buffer_tokens(full.length + room) * per_token


def test_a_failure_in_the_cuda_transfer_raises_in_the_caller_and_leaves_no_worker(cuda_llama, monkeypatch):
    def failing_copy(self, keys_out, values_out):
        raise OSError("injected DMA failure")

    monkeypatch.setattr(HostSnapshot, "copy_into", failing_copy)
    ids, mask = padded_batch("cuda")
    config = VeriCacheConfig(compressor="streaming_llm", chunk_tokens=32, draft_length=6, transfer_timeout=10)
    with pytest.raises(TransferError, match="injected DMA failure"):
        vericache_generate(cuda_llama, ids, mask, config)
    assert no_worker_left()


def test_a_model_split_between_the_gpu_and_the_cpu_keeps_each_layers_tiers_on_its_device():
    """accelerate's `dispatch_model` with layers on two devices, as `device_map` does across GPUs: here the first
    half on cuda:0 and the second on the CPU (main_device="cpu" makes the CPU layers run there, not offload)."""
    from accelerate import dispatch_model

    model = tiny_model("llama", num_hidden_layers=4)
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": 0,
        "model.layers.2": "cpu",
        "model.layers.3": "cpu",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    model = dispatch_model(model, device_map=device_map, main_device="cpu")
    ids, mask = padded_batch("cuda")
    config = VeriCacheConfig(
        compressor="snapkv", compression_ratio=0.75, chunk_tokens=32, draft_length=6, draft_schedule="fixed"
    )
    expected, out = generate_both(model, ids, mask, config)
    assert torch.equal(out.sequences.cpu(), expected.cpu())

    cache = getattr(out, CACHE_OUTPUT_FIELD)
    devices = [layer.device.type for layer in cache.layers]
    assert devices == ["cuda", "cuda", "cpu", "cpu"]
    assert [layer.draft.valid.device.type for layer in cache.layers] == devices
    # The GPU layers are staged through the engine; the CPU layers read their full tier in place.
    assert [layer.reads_in_place for layer in cache.layers] == [False, False, True, True]
    stats = out.vericache_stats
    assert stats.accepted_tokens > 0
    assert stats.chunk_transfers == 2 * (stats.rounds + stats.plain_rounds)


def test_engine_workers_compute_on_their_own_streams(cuda_llama):
    """Each engine worker's requests run on a CUDA stream of its own (not the shared default stream), and every
    request stays exact."""
    seen = []

    class Recorder(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(torch.cuda.current_stream().cuda_stream)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    prompts = [random_prompt(60 + 10 * i, seed=20 + i)[0].tolist() for i in range(4)]
    config = VeriCacheConfig(compressor="snapkv", compression_ratio=0.5)
    with VeriCacheEngine(cuda_llama, config, max_concurrent=2, do_sample=False) as engine:
        ids = engine.add_requests(
            prompts, max_new_tokens=NEW_TOKENS, stopping_criteria=StoppingCriteriaList([Recorder()])
        )
        results = [engine.get_result(request_id, timeout=120) for request_id in ids]
    default = torch.cuda.default_stream().cuda_stream
    assert seen and default not in seen
    for prompt, result in zip(prompts, results, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        expected = cuda_llama.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(prompt) :]
        assert result.generated_tokens == expected.tolist()


@pytest.mark.parametrize("kernel", ["auto", "lower_right", "flex"])
def test_verify_kernels_and_streamed_chunks_on_cuda_match_stock(cuda_llama, kernel):
    """Each verify kernel on CUDA, and the full tier streamed through chunks far shorter than the prompt (merged by
    log-sum-exp on the device): a left-padded batch decodes exactly as stock generate, with several chunk transfers
    a layer and pass, none left held."""
    ids, mask = padded_batch("cuda")
    config = VeriCacheConfig(
        compressor="snapkv", compression_ratio=0.75, chunk_tokens=32, draft_length=6, draft_schedule="fixed",
        staging_chunk_tokens=40, verify_attention=kernel,
    )  # fmt: skip
    expected, out = generate_both(cuda_llama, ids, mask, config)
    assert torch.equal(out.sequences, expected)
    cache, stats = getattr(out, CACHE_OUTPUT_FIELD), out.vericache_stats
    assert stats.chunk_transfers >= 3 * (stats.rounds + stats.plain_rounds) * len(cache.layers)
    assert cache.stream.transfers.buffers.held == 0


@pytest.mark.parametrize("proposer", ["prompt_lookup", "assistant"])
def test_composed_drafting_on_cuda_matches_stock(cuda_llama, proposer):
    """A proposer offers tokens, the draft tier on the GPU checks them many per pass, the full tier verifies."""
    ids, mask = repeat_tail(*padded_batch("cuda"))
    kwargs = (
        {"prompt_lookup_num_tokens": 5}
        if proposer == "prompt_lookup"
        else {"assistant_model": assistant_model().to("cuda")}
    )
    config = VeriCacheConfig(
        compressor="snapkv", compression_ratio=0.75, chunk_tokens=32, draft_length=6, draft_schedule="fixed"
    )
    expected = cuda_llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS)
    out = vericache_generate(cuda_llama, ids, mask, config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    stats = out.vericache_stats
    assert stats.proposed_tokens > 0 and stats.draft_forwards > 0 and stats.chunk_transfers > 0
    assert all(layer.full.keys.is_pinned() for layer in getattr(out, CACHE_OUTPUT_FIELD).layers)


@pytest.mark.parametrize("compressor", ["snapkv", "kivi"])
def test_bfloat16_drafts_on_cuda_match_stock(cuda_llama, compressor):
    """Draft steps on a bfloat16 copy of the weights on the GPU, the verify pass on the float64 model."""
    ids, mask = padded_batch("cuda")
    config = VeriCacheConfig(
        compressor=compressor, chunk_tokens=32, draft_length=6, draft_schedule="fixed", draft_dtype="bfloat16"
    )
    expected, out = generate_both(cuda_llama, ids, mask, config)
    assert torch.equal(out.sequences, expected)
    assert out.vericache_stats.draft_forwards > 0 and out.vericache_stats.chunk_transfers > 0


@pytest.mark.parametrize("damaged", [False, True])
def test_a_reused_prefix_on_cuda_drafts_while_the_full_prefix_loads_into_pinned_memory(
    cuda_llama, tmp_path, damaged
):
    """Saved on the GPU, then reused over a slow link: the draft tier lands on the GPU and drafting starts while the
    full chunks load into the pinned host tier (or, when a layer's chunks are damaged, are recomputed on the GPU)."""
    store = DiskStore(tmp_path)
    vericache_with_store(cuda_llama, request(0).to("cuda"), store)
    if damaged:
        corrupt(cuda_llama, store, "full", lambda b: b[: len(b) // 2], layer=1)
    slow = ThrottledStore(store, bandwidth_bytes_per_s=2e6, latency_s=0.002)
    # draft from the suffix's round on, whatever the clock says
    fixed = dict(draft_schedule="fixed", draft_length=4, max_draft_length=16)
    for question in (1, 2):
        ids = request(question).to("cuda")
        if damaged:
            with pytest.warns(UserWarning, match="refused"):
                out, stats = vericache_with_store(cuda_llama, ids, slow, **fixed)
        else:
            out, stats = vericache_with_store(cuda_llama, ids, slow, **fixed)
        expected = cuda_llama.generate(ids, do_sample=False, max_new_tokens=out.shape[-1] - ids.shape[-1])
        assert torch.equal(out, expected), question
        if question == 1 and not damaged:  # the first hit drafts while the prefix loads (no prior yet)
            assert 0 < stats.first_draft_seconds < stats.first_token_seconds
        assert stats.bytes_to_device > 0  # the full tier reached the GPU through the staging buffers
        if damaged:
            assert stats.prefix_tokens_reused < 3 * CHUNK
            break  # the damaged chunks were refused; a later request may hit the repaired entry
        assert stats.prefix_tokens_reused == 3 * CHUNK and stats.prefix_full_bytes > 0
