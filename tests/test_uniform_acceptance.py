"""Models that count positions from their cache's length (the BART family's causal decoders take no `position_ids`):
every row of a batch keeps the batch's fewest accepted drafts each round, so no row gets masked slots and each row
sits at the position stock `generate` gives it. Greedy output equals stock's on a left-padded batch whose rows accept
different counts, sampled output is distributed as stock's, and the rule itself keeps speculative sampling's
distribution when another row sets the count. Requests of such a model cannot share a cohort's passes."""

from __future__ import annotations

import pytest
import torch
from transformers import BartConfig, BartForCausalLM, PegasusConfig, PegasusForCausalLM

from vericache_hf import VeriCacheConfig, VeriCacheEngine, VeriCacheStats
from vericache_hf.accept import accept_uniformly, speculative_accept
from vericache_hf.passes import counts_positions_from_cache
from vericache_tools import families

from .conftest import VOCAB, random_prompt
from .test_sampling import SAMPLES, assert_same_distribution, sample_both

FAMILIES = {"bart": (BartConfig, BartForCausalLM), "pegasus": (PegasusConfig, PegasusForCausalLM)}
PROMPT = 40
#: A short window: the draft tier then differs enough from the full tier that rows accept different counts.
DRAFTING = dict(compressor="streaming_llm", compression_ratio=0.75, draft_length=6, draft_schedule="fixed")


def causal_decoder(family: str, seed: int = 0, layers: int = 2):
    """A tiny random causal decoder of the family in float64, with untied output embeddings and weights large enough
    that greedy text does not just repeat its last token."""
    config_class, model_class = FAMILIES[family]
    config = config_class(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=256,
        init_std=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        decoder_start_token_id=1,
        is_decoder=True,
        is_encoder_decoder=False,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return model_class(config).to(torch.float64).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def decoder(request):
    return causal_decoder(request.param)


def left_padded(batch: int = 3, seed: int = 3) -> dict[str, torch.Tensor]:
    """Rows of 40, 31 and 23 tokens, left-padded, as a tokenizer pads for generation."""
    ids = random_prompt(PROMPT, batch=batch, seed=seed)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 9, 17][:batch]):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def test_the_family_counts_positions_from_the_cache(decoder):
    assert counts_positions_from_cache(decoder)


def test_greedy_left_padded_batch_whose_rows_accept_differently_equals_stock(decoder):
    assert_greedy_equals_stock(decoder, left_padded(), 30, DRAFTING)


def assert_greedy_equals_stock(model, inputs: dict, tokens: int, drafting: dict) -> None:
    """Greedy VeriCache output equals stock's, over rounds in which some row was cut short by another."""
    kwargs = dict(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)
    stock = model.generate(**inputs, **kwargs)
    stats = VeriCacheStats()
    config = VeriCacheConfig(**drafting, stats=stats)
    out = model.generate(**inputs, generation_mode="vericache", vericache_config=config, **kwargs)
    assert stats.drafts_given_up > 0, "the test needs rounds whose rows accepted different counts"
    assert torch.equal(out, stock)


def test_sampled_rows_of_a_batch_are_distributed_as_stock():
    # thousands of rows in one batch: almost every round some row rejects its first draft, so every other row emits
    # its first draft where the rule accepted it, and the verifier's residual draw where it did not
    model = causal_decoder("bart", layers=1)
    ids = random_prompt(24, seed=11)
    out, stock = sample_both(model, ids, VeriCacheConfig(**{**DRAFTING, "draft_length": 3}))
    assert out.vericache_stats.drafts_given_up > SAMPLES, "the test needs many rows cut short by others"
    assert_same_distribution(out.sequences, stock, ids.shape[-1])


def test_a_row_cut_short_by_another_keeps_the_target_distribution():
    """The rule alone, on many pairs of rows at once: row A's emitted tokens follow the target at each position,
    whether A set the pair's count itself (its residual draw there) or B cut it short (A's accepted draft there).
    Emitting a fresh draw from the target where B cut A short instead fails this test (chi-square near 280)."""
    torch.manual_seed(0)
    pairs, k = 20_000, 2
    target = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)
    vocab = target.shape[-1]
    p = target.expand(2, k + 1, vocab)  # the same target at every position, for rows A and B
    # A drafts far from the target (it keeps a draft with probability 0.4), B nearer (0.7)
    q = torch.stack([target.flip(0), (target + target.flip(0)) / 2])[:, None].expand(2, k, vocab)
    p_rows, q_rows = p.repeat(pairs, 1, 1), q.repeat(pairs, 1, 1)
    drafts = torch.multinomial(q_rows.reshape(-1, vocab), 1).reshape(2 * pairs, k)
    own, tokens = speculative_accept(drafts, q_rows, p_rows)
    cut = [accept_uniformly(a, t, [0, 1]) for a, t in zip(own.split(2), tokens.split(2), strict=True)]
    fewest = torch.stack([a for a, _ in cut])  # (pairs, 2)
    emitted_tokens = torch.stack([t[0] for _, t in cut])  # row A's
    assert bool((fewest[:, 0] == fewest[:, 1]).all()) and bool((fewest[:, 0] <= own[0::2]).all())
    for position in range(k + 1):
        emitted = fewest[:, 0] >= position
        if position < k:  # A's draft here was accepted, and the pair stops here for B's sake
            cut_here = (fewest[:, 0] == position) & (own[0::2] > position)
            assert int(cut_here.sum()) > 500, "the test needs rows cut short at every drafted position"
        counts = torch.bincount(emitted_tokens[emitted, position], minlength=vocab).double()
        expected = target * int(emitted.sum())
        # chi-square, 5 dof: a false alarm has probability < 1e-5 per position
        assert ((counts - expected) ** 2 / expected).sum() < 30, position


def test_finished_rows_do_not_set_the_count():
    accepted, tokens = torch.tensor([3, 0, 2, 5]), torch.arange(24).reshape(4, 6)
    cut, same = accept_uniformly(accepted, tokens, [0, 2, 3])
    assert cut.tolist() == [2, 0, 2, 2] and torch.equal(same, tokens)
    assert accept_uniformly(accepted, tokens, [])[0].tolist() == [3, 0, 2, 5]


def test_cohorts_are_refused_for_such_a_model_and_requests_alone_are_exact():
    model = causal_decoder("bart")
    with pytest.raises(ValueError, match="counts positions from its cache's length.*cohort_size=1"):
        VeriCacheEngine(model, VeriCacheConfig(**DRAFTING), do_sample=False)
    prompts = [random_prompt(30 + 7 * i, seed=40 + i)[0].tolist() for i in range(2)]
    with VeriCacheEngine(model, VeriCacheConfig(**DRAFTING), cohort_size=1, do_sample=False) as engine:
        ids = engine.add_requests(prompts, max_new_tokens=16)
        for request_id, prompt in zip(ids, prompts, strict=True):
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
            got = engine.get_result(request_id, timeout=120).generated_tokens
            assert got == expected[0, len(prompt) :].tolist()


def test_a_model_passing_positions_on_to_a_rotary_decoder_counts_padding_as_stock_does():
    # its forward takes no position_ids but hands them on to a rotary language model, which numbers tokens from
    # the cache's length when given none: a padded row's positions then count its padding, as VeriCache's must
    model = families.tiny_model("moss_transcribe_diarize").to(torch.float64)
    assert counts_positions_from_cache(model)
    assert_greedy_equals_stock(model, families.prompts(3), 20, {**DRAFTING, "draft_length": 4})
