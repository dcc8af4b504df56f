"""Sampling with generation_mode="vericache" is lossless in distribution: speculative sampling emits tokens
distributed as stock `generate(do_sample=True)`'s, though the random stream differs, so the check is statistical."""

from __future__ import annotations

import torch
from scipy.stats import chi2_contingency

from vericache_hf import VeriCacheConfig
from vericache_hf.accept import speculative_accept

from .conftest import random_prompt

SAMPLES = 4000
PROMPT = 24
NEW_TOKENS = 4
#: Total false-alarm rate of the chi-square test (Bonferroni over the NEW_TOKENS positions). The seed is fixed, so
#: the outcome is deterministic; over seeds a correct implementation fails this test with probability <= ALPHA.
ALPHA = 1e-3
SAMPLING = dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.95, repetition_penalty=1.2)


def chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square homogeneity test on token ids; tokens rarer than 5 in the pooled sample share a bin."""
    counts = torch.stack([torch.bincount(a, minlength=256), torch.bincount(b, minlength=256)])
    common = counts.sum(0) >= 10
    table = torch.cat([counts[:, common], counts[:, ~common].sum(1, keepdim=True)], dim=1)
    table = table[:, table.sum(0) > 0]
    return float(chi2_contingency(table.numpy()).pvalue)


def sample_both(model, ids: torch.Tensor, config: VeriCacheConfig):
    """SAMPLES continuations of `ids` by VeriCache (a dict output, with stats) and by stock sampling."""
    torch.manual_seed(1234)
    out = model.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        num_return_sequences=SAMPLES,
        generation_mode="vericache",
        vericache_config=config,
        return_dict_in_generate=True,
        **SAMPLING,
    )
    stock = model.generate(ids, max_new_tokens=NEW_TOKENS, num_return_sequences=SAMPLES, **SAMPLING)
    assert out.sequences.shape == stock.shape == (SAMPLES, ids.shape[-1] + NEW_TOKENS)
    return out, stock


def assert_same_distribution(sequences: torch.Tensor, stock: torch.Tensor, prompt: int) -> None:
    """Every new position passes the chi-square homogeneity test against stock's samples."""
    for position in range(prompt, prompt + NEW_TOKENS):
        p_value = chi_square_p(sequences[:, position], stock[:, position])
        assert p_value > ALPHA / NEW_TOKENS, (position, p_value)


def test_sampled_tokens_are_distributed_as_stock(small):
    ids = random_prompt(PROMPT, seed=11)
    # a heavily compressed draft tier on a short prompt: drafts differ from the verifier often enough that the
    # accept/resample rule decides the distribution
    config = VeriCacheConfig(
        compressor="streaming_llm", compression_ratio=0.9, draft_length=3, draft_schedule="fixed"
    )
    out, stock = sample_both(small, ids, config)
    assert 0.2 < out.vericache_stats.acceptance_rate < 0.95, (
        "the test needs both accepted and rejected drafts"
    )
    assert_same_distribution(out.sequences, stock, PROMPT)


def test_speculative_rule_recovers_the_target_distribution():
    """The pure rule, many rows at once: draft from q, accept/resample, and the emitted token follows p."""
    torch.manual_seed(0)
    rows, vocab = 60_000, 6
    p = torch.softmax(torch.randn(vocab, dtype=torch.float64) * 2, dim=-1)
    q = torch.softmax(torch.randn(vocab, dtype=torch.float64) * 2, dim=-1)
    drafts = torch.multinomial(q.expand(rows, vocab), 1)
    accepted, tokens = speculative_accept(drafts, q.expand(rows, 1, vocab), p.expand(rows, 2, vocab))
    assert 0 < accepted.float().mean() < 1
    first = torch.bincount(tokens[:, 0], minlength=vocab).double()
    expected = p * rows
    assert ((first - expected) ** 2 / expected).sum() < 30  # chi-square, 5 dof: false alarm < 1e-5


def test_rule_keeps_matching_drafts_and_samples_bonus_from_target():
    vocab = 4
    p = torch.tensor([[[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]], dtype=torch.float64)
    q = torch.tensor([[[0.0, 1.0, 0.0, 0.0]]], dtype=torch.float64)
    accepted, tokens = speculative_accept(torch.tensor([[1]]), q, p)
    assert accepted.tolist() == [1] and tokens.tolist() == [[1, 2]]
    q_wrong = torch.tensor([[[0.0, 0.0, 0.0, 1.0]]], dtype=torch.float64)
    accepted, tokens = speculative_accept(torch.tensor([[3]]), q_wrong, p)
    assert accepted.tolist() == [0] and tokens[0, 0].item() == 1
    assert vocab == p.shape[-1]


def test_sampling_rows_stop_exactly_at_eos_and_length(small):
    ids = random_prompt(PROMPT, seed=12)
    config = VeriCacheConfig(
        compressor="streaming_llm", compression_ratio=0.75, draft_length=6, draft_schedule="fixed"
    )
    torch.manual_seed(5)
    out = small.generate(
        ids,
        max_new_tokens=20,
        num_return_sequences=64,
        generation_mode="vericache",
        vericache_config=config,
        eos_token_id=[5, 7],
        pad_token_id=0,
        bad_words_ids=[[0]],
        **SAMPLING,
    )
    assert out.shape[-1] <= PROMPT + 20
    for row in out[:, PROMPT:].tolist():
        stops = [i for i, token in enumerate(row) if token in (5, 7)]
        if stops:
            assert all(token == 0 for token in row[stops[0] + 1 :]), row
        else:
            assert len(row) == 20 and 0 not in row, row


def test_a_seeded_sampling_run_repeats_with_the_default_schedule(small):
    # the default ("auto") keeps the draft length off the clock under sampling, so a seed fixes the output
    ids = random_prompt(PROMPT, seed=13)
    config = VeriCacheConfig(compressor="streaming_llm", compression_ratio=0.75)
    outputs = []
    for _ in range(2):
        torch.manual_seed(21)
        outputs.append(
            small.generate(
                ids,
                max_new_tokens=40,
                num_return_sequences=8,
                generation_mode="vericache",
                vericache_config=config,
                **SAMPLING,
            )
        )
    assert torch.equal(*outputs)
