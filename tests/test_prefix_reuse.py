"""Prefix caching through `generate`: the output equals stock `generate` on the full cache whether the
prefix was saved, reused, corrupted, missing or unreachable, on both backends (a real Redis server and a directory).
"""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

import vericache_hf
from vericache_hf import VeriCacheConfig, VeriCacheStats
from vericache_hf.compressors import SnapKVCompressor, build_compressor
from vericache_hf.decoding import _build_cache, _prefix_reuse
from vericache_hf.loop import begin, run_round
from vericache_hf.pass_model import pass_model
from vericache_hf.passes import DecodeIO
from vericache_hf.prefix import DiskStore, PrefixStore, RedisStore, ThrottledStore, flush
from vericache_hf.prefix.reuse import PrefixReuse
from vericache_hf.schedule.draft_length import draft_length_schedule
from vericache_tools.redis_server import free_port

from .conftest import VOCAB, small_model, tiny_model
from .test_sampling import assert_same_distribution, sample_both

CHUNK = 32
SHARED = 3 * CHUNK + 5  # the stored prefix is 3 chunks: 96 tokens
NEW = 24


def shared_prefix(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, SHARED), generator=torch.Generator().manual_seed(seed))


def request(question: int, prefix: torch.Tensor | None = None) -> torch.Tensor:
    prefix = shared_prefix() if prefix is None else prefix
    tail = torch.randint(3, VOCAB, (1, 2 + question), generator=torch.Generator().manual_seed(100 + question))
    return torch.cat([prefix, tail], dim=-1)


def stock(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)


def vericache(model, ids, store, compressor="snapkv", **kwargs) -> tuple[torch.Tensor, VeriCacheStats]:
    stats = VeriCacheStats()
    kwargs.setdefault("compression_ratio", 0.75)
    config = VeriCacheConfig(
        compressor=compressor,
        prefix_store=store,
        prefix_chunk_tokens=CHUNK,
        stats=stats,
        **kwargs,
    )
    out = model.generate(
        ids, max_new_tokens=NEW, do_sample=False, generation_mode="vericache", vericache_config=config
    )
    flush(store)
    return out, stats


#: SnapKV whose window (4 queries) fits in the suffixes here: the first verify pass scores its draft tier again
SNAPKV_4 = SnapKVCompressor(compression_ratio=0.75, window_size=4)


@pytest.mark.parametrize("compressor", ["snapkv", SNAPKV_4, "streaming_llm", "kivi", ["knorm", "kivi"]])
def test_saved_and_reused_prefix_match_stock(model, make_store, compressor):
    store = make_store()
    for question in range(3):
        ids = request(question)
        out, stats = vericache(model, ids, store, compressor)
        assert torch.equal(out, stock(model, ids)), f"question {question}"
        assert stats.prefix_tokens_reused == (0 if question == 0 else 3 * CHUNK)
        if question:
            assert stats.prefix_full_bytes > 0
            assert stats.prefix_compressed_bytes > 0
            assert stats.first_token_seconds > 0
            assert 0 < stats.prefix_load_cpu_seconds <= stats.prefix_load_seconds + 0.01  # one thread's CPU
    # a quarter of the tokens, or 4-bit codes for all but the last 32 (KIVI's full-precision residual)
    assert stats.prefix_compressed_bytes < (0.4 if compressor in ("snapkv", "streaming_llm") else 0.6) * (
        stats.prefix_full_bytes
    )


def test_draft_entry_travels_in_bfloat16_and_restores_in_the_model_type(llama, tmp_path):
    """The stored draft tier (which only drafts) holds its float tensors in bfloat16, half a float32 entry's bytes
    on the link; a hit restores them in the model's type, and the output stays stock's."""
    store = DiskStore(tmp_path)
    vericache(llama, request(0), store)  # saves
    prefixes = vericache_hf.prefix.PrefixCache(store, CHUNK)
    reuse = PrefixReuse(
        store, llama, build_compressor("snapkv", compression_ratio=0.75), VeriCacheStats(), CHUNK
    )
    state, nbytes = prefixes.load_state(request(0)[:, : 3 * CHUNK], reuse.draft_print, "draft")
    floats = {name: t.dtype for name, t in state.items() if t.is_floating_point()}
    assert floats and set(floats.values()) == {torch.bfloat16}, floats
    assert llama.dtype == torch.float64
    ids = request(1)
    out, stats = vericache(llama, ids, store)
    assert stats.prefix_compressed_bytes == nbytes
    assert torch.equal(out, stock(llama, ids))


@pytest.mark.parametrize("stage_on_cpu", [False, True])
def test_suffix_queries_score_the_draft_tier_as_a_whole_prefill_would(llama, tmp_path, stage_on_cpu):
    """A stored prefix's draft tier was scored by the prefix's own last queries; after the first verify pass, which
    computes the suffix's, each layer's draft tier holds what SnapKV keeps of the whole prompt (as a prefill of it
    builds), then the tokens committed since. On a miss (the prefix prefilled alone) and on a hit."""
    store = DiskStore(tmp_path)
    config = VeriCacheConfig(
        compressor=SNAPKV_4, prefix_store=store, prefix_chunk_tokens=CHUNK, stage_on_cpu=stage_on_cpu
    )
    ids = request(1)
    runner = pass_model(llama)
    whole = _build_cache(llama, config, VeriCacheStats())[1]
    begin(runner, whole, ids, None, None, io_for())  # a prefill of the whole prompt
    if (
        not whole.draft_tier.held
    ):  # deferred on the CPU: built from the held layer inputs, as the first draft does
        whole.draft_tier.build()
    for hit in (False, True):
        stats = VeriCacheStats()
        compressor, cache = _build_cache(llama, config, stats)
        io = io_for(_prefix_reuse(runner, config, compressor, stats))
        state = begin(runner, cache, ids, None, None, io)
        schedule = draft_length_schedule(config)
        run_round(runner, cache, state, io, schedule)  # the suffix's round
        run_round(runner, cache, state, io, schedule)  # and one more
        flush(store)
        assert stats.prefix_tokens_reused == (3 * CHUNK if hit else 0)
        committed = cache.full_valid.shape[-1]
        assert committed > ids.shape[-1]  # the rounds committed tokens after the prompt
        for mine, theirs in zip(cache.layers, whole.layers, strict=True):
            kept = theirs.draft.num_committed
            assert mine.draft.num_committed == kept + committed - ids.shape[-1]
            for got, want in zip(mine.draft.export().values(), theirs.draft.export().values(), strict=True):
                assert torch.allclose(
                    got[..., :kept, :] if got.dim() == 4 else got[:, :kept], want, atol=1e-9
                )
            # the tokens after the prompt, whole and exact
            keys = mine.full.view()[0]
            assert torch.equal(mine.draft.export()["keys"][:, :, kept:], keys[:, :, ids.shape[-1] :])


def io_for(prefix: PrefixReuse | None = None) -> DecodeIO:
    return DecodeIO(
        LogitsProcessorList(), StoppingCriteriaList(), max_length=SHARED + 16, pad_token_id=0, prefix=prefix
    )


def test_drafting_runs_on_while_the_full_prefix_loads(llama, tmp_path):
    """Over a slow link the first round drafts past its usual length until the full prefix is there."""
    store = DiskStore(tmp_path)
    vericache(llama, request(0), store)  # save
    # the full prefix takes about 1 s to arrive, so the round drafts past 4 even where this tiny model's passes
    # take 25 times their few milliseconds (a machine under load)
    slow = ThrottledStore(store, bandwidth_bytes_per_s=1e5, latency_s=0.002)
    ids = request(1)
    out, stats = vericache(llama, ids, slow, draft_schedule="fixed", draft_length=4, max_draft_length=16)
    assert torch.equal(out, stock(llama, ids))
    assert stats.prefix_tokens_reused == 3 * CHUNK
    assert stats.draft_lengths[0] > 4
    assert 0 < stats.first_draft_seconds < stats.first_token_seconds
    assert stats.prefix_wait_seconds > 0


def test_sampled_tokens_over_a_reused_prefix_are_distributed_as_stock(tmp_path):
    """The first round after a stored prefix (suffix drafted on the restored draft tier, then verified) samples
    exactly: 4000 copies of one prompt (`num_return_sequences`, which share the prefix) against stock sampling."""
    small = small_model()
    store = DiskStore(tmp_path)
    config = VeriCacheConfig(
        compressor="streaming_llm",
        compression_ratio=0.9,
        draft_length=3,
        draft_schedule="fixed",
        prefix_store=ThrottledStore(store, bandwidth_bytes_per_s=1e6),  # slow: the first round drafts
        prefix_chunk_tokens=CHUNK,
    )
    vericache(small, request(0), store, "streaming_llm", compression_ratio=0.9)  # saves the prefix
    ids = request(1)
    out, stock_out = sample_both(small, ids, config)
    stats = out.vericache_stats
    assert stats.prefix_tokens_reused == 3 * CHUNK
    assert stats.draft_lengths[0] > 0, "the first round should draft while the prefix loads"
    assert 0.2 < stats.acceptance_rate < 0.95, "the test needs both accepted and rejected drafts"
    assert_same_distribution(out.sequences, stock_out, ids.shape[-1])


def corrupt(model, store: PrefixStore, tier: str, edit, layer: int = 0) -> None:
    """Damage the stored bytes of one tier of the shared prefix: one layer of every full chunk after the first
    (layer 0: the loader stops at once; the last layer: after a verify pass has started), or the draft entry."""
    reuse = PrefixReuse(store, model, build_compressor("snapkv", 0.75, None), VeriCacheStats(), CHUNK)
    prefix = shared_prefix()[:, : 3 * CHUNK]
    if tier == "full":
        keys = reuse.prefixes.layer_keys(prefix, reuse.full_print, layer)[1:]
    else:
        keys = reuse.prefixes.chunk_keys(prefix, reuse.draft_print, "draft")[-1:]
    for key in keys:
        store.put(key + ":kv", edit(store.get(key + ":kv")))


@pytest.mark.parametrize(
    "tier,edit,layer",
    [
        ("draft", lambda b: b[:-1] + bytes([b[-1] ^ 1]), 0),  # flipped byte
        ("full", lambda b: b[:-1] + bytes([b[-1] ^ 1]), 0),
        ("full", lambda b: b[: len(b) // 2], 1),  # truncated, in the last layer
    ],
)
def test_damaged_entries_are_never_used(llama, make_store, tier, edit, layer):
    store = make_store()
    vericache(llama, request(0), store)
    corrupt(llama, store, tier, edit, layer)
    ids = request(1)
    with pytest.warns(UserWarning, match="refused"):
        out, stats = vericache(llama, ids, store)
    assert torch.equal(out, stock(llama, ids))
    if tier == "draft":  # a miss: prefilled and saved again
        assert stats.prefix_tokens_reused == 0
        out, stats = vericache(llama, request(2), store)
        assert stats.prefix_tokens_reused == 3 * CHUNK
        assert torch.equal(out, stock(llama, request(2)))
    else:  # the compressed tier was fine: drafting started, and the full chunks were recomputed
        assert stats.prefix_tokens_reused < 3 * CHUNK


def test_other_compressor_or_model_never_matches(llama, make_store):
    store = make_store()
    vericache(llama, request(0), store, "snapkv")
    _, stats = vericache(llama, request(1), store, "streaming_llm")
    assert stats.prefix_tokens_reused == 0
    other = tiny_model("llama", seed=1)
    ids = request(2)
    out, stats = vericache(other, ids, store, "snapkv")
    assert stats.prefix_tokens_reused == 0
    assert torch.equal(out, stock(other, ids))


def test_tenants_do_not_see_each_other(llama, make_store):
    vericache(llama, request(0), make_store("team-a"))
    _, stats = vericache(llama, request(1), make_store("team-b"))
    assert stats.prefix_tokens_reused == 0
    _, stats = vericache(llama, request(2), make_store("team-a"))
    assert stats.prefix_tokens_reused == 3 * CHUNK


@pytest.mark.parametrize("backend", ["disk", "redis"])
def test_store_that_is_down_decodes_exactly_without_hanging(llama, tmp_path, backend):
    """Redis: nothing listens on the port. Disk: the directory was replaced by a file (every read and write fails)."""
    if backend == "redis":
        store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
    else:
        store = DiskStore(tmp_path / "store")
        store.root.rmdir()
        store.root.write_text("not a directory")
    ids = request(0)
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):  # the first call also tries to save
            out, stats = vericache(llama, ids, store)
            assert torch.equal(out, stock(llama, ids))
            assert stats.prefix_tokens_reused == 0
    assert any("failed" in str(w.message) for w in seen)
    assert time.perf_counter() - started < 20


class StallingStore(DiskStore):
    """Full-tier chunks never come in time: each read of one blocks for `stall` seconds."""

    stall = 1.5

    def get_many(self, keys):
        if any(key.startswith("full@") and key.endswith(":kv") for key in keys):
            time.sleep(self.stall)
        return super().get_many(keys)


def test_stalled_full_tier_is_recomputed_after_the_timeout(llama, tmp_path):
    store = StallingStore(tmp_path)
    vericache(llama, request(0), DiskStore(tmp_path))  # saved through a plain view of the same directory
    ids = request(1)
    started = time.perf_counter()
    with pytest.warns(UserWarning, match="recomputing"):
        out, stats = vericache(llama, ids, store, transfer_timeout=0.3)
    assert torch.equal(out, stock(llama, ids))
    assert stats.prefix_tokens_reused < 3 * CHUNK
    assert time.perf_counter() - started < 10


def test_two_requests_writing_one_prefix_at_once(llama, make_store):
    store = make_store()
    results, errors = {}, []

    def run(question):
        try:
            results[question] = vericache(llama, request(question), store)[0]
        except BaseException as error:  # reported below, on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(q,)) for q in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    for question in (0, 1):
        assert torch.equal(results[question], stock(llama, request(question)))
    out, stats = vericache(llama, request(2), store)
    assert stats.prefix_tokens_reused == 3 * CHUNK
    assert torch.equal(out, stock(llama, request(2)))


def test_warm_prefix_then_first_request_hits(llama, tmp_path):
    store = DiskStore(tmp_path)
    config = VeriCacheConfig(prefix_store=store, prefix_chunk_tokens=CHUNK, compression_ratio=0.75)
    assert vericache_hf.warm_prefix(llama, shared_prefix()[:, : 3 * CHUNK], config) == 3 * CHUNK
    ids = request(0)
    out, stats = vericache(llama, ids, store)
    assert stats.prefix_tokens_reused == 3 * CHUNK
    assert torch.equal(out, stock(llama, ids))


def test_short_prompts_and_batches_decode_without_the_store(llama, tmp_path):
    store = DiskStore(tmp_path)
    short = request(0)[:, : CHUNK - 4]
    out, stats = vericache(llama, short, store)
    assert torch.equal(out, stock(llama, short))
    other = request(0).clone()
    other[0, -1] += 1
    batch = torch.cat([request(0), other], dim=0)
    with pytest.warns(UserWarning, match="one prompt per call"):
        out, stats = vericache(llama, batch, store)
    assert torch.equal(out, stock(llama, batch))
    assert stats.prefix_tokens_reused == 0
    repeated = torch.cat([request(0)] * 3, dim=0)  # one prompt, as num_return_sequences makes
    for reused in (0, 3 * CHUNK):  # saved from a batch, then restored into one
        out, stats = vericache(llama, repeated, store)
        assert torch.equal(out, stock(llama, repeated))
        assert stats.prefix_tokens_reused == reused


def test_engine_requests_reuse_a_shared_prefix_and_join_cohorts(llama, tmp_path):
    store = DiskStore(tmp_path)
    stats = VeriCacheStats()
    config = VeriCacheConfig(
        compression_ratio=0.75, prefix_store=store, prefix_chunk_tokens=CHUNK, stats=stats
    )
    vericache(llama, request(0), store)
    prompts = [request(q)[0].tolist() for q in (1, 2, 3)]
    with vericache_hf.VeriCacheEngine(llama, config, max_new_tokens=NEW, do_sample=False) as engine:
        results = [engine.get_result(request_id) for request_id in engine.add_requests(prompts)]
        cohorts = engine.cohort_stats()
    for question, prompt, result in zip((1, 2, 3), prompts, results, strict=True):
        expected = stock(llama, request(question))[0, len(prompt) :].tolist()
        assert result.generated_tokens == expected
    assert stats.prefix_tokens_reused == 3 * 3 * CHUNK
    assert cohorts["rounds"] > 0  # after its suffix's round, each request decoded in a cohort


def test_bad_prefix_settings_say_what_to_do(llama, tmp_path):
    with pytest.raises(TypeError, match="prefix_store must be"):
        VeriCacheConfig(prefix_store=str(tmp_path))
    config = VeriCacheConfig(prefix_store=DiskStore(tmp_path))
    with pytest.raises(ValueError, match="cannot be saved in a generation config"):
        config.to_dict()
    with pytest.raises(ValueError, match="warm_prefix stores into"):
        vericache_hf.warm_prefix(llama, request(0), VeriCacheConfig())


@pytest.mark.parametrize("compressor", ["snapkv", SNAPKV_4])
def test_staged_full_tier_waits_for_the_whole_prefix(llama, tmp_path, compressor):
    """Where the full tier reaches the model through staging buffers (an accelerator; here `stage_on_cpu`), the
    first verify pass waits for the whole prefix, then streams it as usual (and, for `SNAPKV_4`, the full tier
    streams in once more to score the draft tier again)."""
    store = DiskStore(tmp_path)
    vericache(llama, request(0), store, compressor, stage_on_cpu=True)
    slow = ThrottledStore(store, bandwidth_bytes_per_s=2e6, latency_s=0.002)
    for question in (1, 2):
        ids = request(question)
        out, stats = vericache(llama, ids, slow, compressor, stage_on_cpu=True)
        assert torch.equal(out, stock(llama, ids))
        assert stats.prefix_tokens_reused == 3 * CHUNK
        assert stats.bytes_to_device > 0  # the staged path ran


def test_reuse_composes_with_a_proposer(llama, tmp_path):
    """Prompt lookup after a restored prefix: the first round drafts from the suffix, later rounds check proposals."""
    store = DiskStore(tmp_path)
    fixed = dict(proposer="prompt_lookup", draft_schedule="fixed", draft_length=6)  # proposals in every pass
    vericache(llama, request(0), store, **fixed)
    ids = request(1)
    out, stats = vericache(llama, ids, store, **fixed)
    assert torch.equal(out, stock(llama, ids))
    assert stats.prefix_tokens_reused == 3 * CHUNK
    assert stats.proposed_tokens > 0
