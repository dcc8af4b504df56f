"""Hierarchical drafting: a proposer (prompt lookup or an assistant model) offers tokens, the draft tier checks them
many per pass, the full tier verifies. Greedy output equals stock `generate` of the model alone; sampling keeps
stock's distribution."""

from __future__ import annotations

import pytest
import torch

from vericache_hf import VeriCacheConfig, VeriCacheStats
from vericache_hf.accept import proposal_accept, speculative_accept
from vericache_hf.drafting.proposed import widen_for
from vericache_hf.drafting.proposers import PromptLookupProposer
from vericache_hf.schedule.draft_length import CostAwareDraftLength

from .conftest import VOCAB, random_prompt, small_model, tiny_model
from .test_generate_parity import left_padded_batch, tiny_tokenizer
from .test_sampling import ALPHA, SAMPLING, chi_square_p

COMPRESSORS = ["streaming_llm", "snapkv", "kivi"]


def assistant_model():
    """A different, smaller random model with the same vocabulary: its proposals are often wrong."""
    return tiny_model("llama", seed=5, num_hidden_layers=1, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def assistant():
    return assistant_model()


@pytest.fixture(scope="module")
def peaked():
    """A one-layer model whose distributions are peaked enough that sampled text often follows its greedy text."""
    model = small_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    return model


def repetitive_batch():
    """Left-padded rows that repeat themselves, so prompt lookup finds n-grams to propose."""
    return repeat_tail(*left_padded_batch())


def repeat_tail(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row followed by its last 12 tokens twice: n-grams for prompt lookup to find."""
    return torch.cat([ids, ids[:, -12:], ids[:, -12:]], dim=1), torch.cat([mask, mask[:, -24:]], dim=1)


def proposer_kwargs(kind: str, model, assistant) -> dict:
    return {
        "lookup": dict(prompt_lookup_num_tokens=5),
        "assistant": dict(assistant_model=assistant),
        "self": dict(assistant_model=model),  # proposals that agree with the model: long kept runs
    }[kind]


def generate_both(model, ids, config, **kwargs):
    stock = model.generate(
        ids, do_sample=False, **{k: v for k, v in kwargs.items() if k not in PROPOSER_KWARGS}
    )
    ours = model.generate(
        ids,
        do_sample=False,
        generation_mode="vericache",
        vericache_config=config,
        return_dict_in_generate=True,
        **kwargs,
    )
    return stock, ours


PROPOSER_KWARGS = ("prompt_lookup_num_tokens", "assistant_model")


@pytest.mark.parametrize("kind", ["lookup", "assistant", "self"])
@pytest.mark.parametrize("compressor", COMPRESSORS)
def test_greedy_batches_with_ragged_acceptance_match_stock(model, assistant, kind, compressor):
    ids, mask = repetitive_batch()
    for draft_length in (3, 9):
        config = VeriCacheConfig(compressor=compressor, draft_length=draft_length, draft_schedule="fixed")
        stock, ours = generate_both(
            model,
            ids,
            config,
            attention_mask=mask,
            max_new_tokens=40,
            **proposer_kwargs(kind, model, assistant),
        )
        assert torch.equal(ours.sequences, stock), (kind, compressor, draft_length)
        stats = ours.vericache_stats
        assert stats.proposed_tokens > 0 and stats.draft_forwards > 0
        if kind == "self" and compressor == "kivi":  # the same model proposes: most proposals are kept
            assert stats.proposal_keep_rate > 0.5 and stats.draft_forwards_per_token < 0.8


@pytest.mark.parametrize("kind", ["lookup", "self"])
def test_eos_inside_proposed_blocks_stops_rows_as_stock(llama, kind):
    ids, mask = repetitive_batch()
    free = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    eos = int(free[1, ids.shape[1] + 6])  # row 1 emits it inside a block; other rows later or never
    config = VeriCacheConfig(compressor="snapkv", draft_length=12, draft_schedule="fixed")
    stock, ours = generate_both(
        llama,
        ids,
        config,
        attention_mask=mask,
        max_new_tokens=30,
        eos_token_id=eos,
        pad_token_id=0,
        **proposer_kwargs(kind, llama, None),
    )
    assert (stock[1, ids.shape[1] + 7 :] == 0).all() and stock.shape[-1] > ids.shape[1] + 8
    assert torch.equal(ours.sequences, stock)


@pytest.mark.parametrize("kind", ["lookup", "self"])
def test_stop_strings_inside_proposed_blocks(llama, kind):
    tokenizer = tiny_tokenizer()
    ids = torch.cat([random_prompt(30, seed=22)] * 2, dim=1)
    free = llama.generate(ids, do_sample=False, max_new_tokens=40)[0, 60:]
    stop = tokenizer.decode(free[10:12])
    config = VeriCacheConfig(compressor="streaming_llm", draft_length=16, draft_schedule="fixed")
    stock, ours = generate_both(
        llama,
        ids,
        config,
        max_new_tokens=40,
        stop_strings=[stop],
        tokenizer=tokenizer,
        **proposer_kwargs(kind, llama, None),
    )
    assert stock.shape[-1] < 100 and torch.equal(ours.sequences, stock)


def test_the_config_names_the_proposer_and_the_default_schedule_stays_exact(model, assistant):
    ids, mask = repetitive_batch()
    stock = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    for proposer in ("prompt_lookup", assistant):
        stats = VeriCacheStats()
        config = VeriCacheConfig(compressor="snapkv", proposer=proposer, proposal_length=4, stats=stats)
        ours = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=40,
            generation_mode="vericache",
            vericache_config=config,
        )
        assert torch.equal(ours, stock), proposer
        assert "draft passes per drafted token" in str(stats) or not stats.proposed_tokens


@pytest.mark.parametrize("schedule", ["fixed", "plain"])
def test_sampled_tokens_with_prompt_lookup_are_distributed_as_stock(peaked, schedule, monkeypatch):
    """fixed: every round drafts on the draft tier, which checks the proposals; plain: the cost-aware schedule held
    to plain rounds, which verify the proposals on the full tier directly, as where drafting does not pay (held,
    because whether drafting pays on this tiny model is the clock's to say, and the test needs plain rounds)."""
    if schedule == "plain":
        monkeypatch.setattr(CostAwareDraftLength, "_next", lambda self, *args, **kwargs: 0)
    samples, new_tokens = 3000, 6
    sampling = dict(SAMPLING, repetition_penalty=1.0)  # the penalty would make the loop's tokens unlikely
    # the model's own greedy text, which falls into a loop: prompt lookup proposes what the model often samples
    ids = peaked.generate(random_prompt(6, seed=0), do_sample=False, max_new_tokens=30)
    config = VeriCacheConfig(
        compressor="streaming_llm",
        compression_ratio=0.9,
        draft_length=2,
        min_draft_length=1,
        draft_schedule="fixed" if schedule == "fixed" else "cost_aware",
    )
    torch.manual_seed(4321)
    out = peaked.generate(  # transformers refuses num_return_sequences with prompt lookup, so the rows are copies
        ids.expand(samples, -1),
        max_new_tokens=new_tokens,
        generation_mode="vericache",
        vericache_config=config,
        return_dict_in_generate=True,
        prompt_lookup_num_tokens=3,
        **sampling,
    )
    stock = peaked.generate(ids, max_new_tokens=new_tokens, num_return_sequences=samples, **sampling)
    stats = out.vericache_stats
    assert 0.05 < stats.proposal_keep_rate < 0.95, "the test needs kept and rejected proposals"
    if schedule == "fixed":
        assert stats.proposal_kept_tokens and 0.2 < stats.acceptance_rate < 0.95
    else:
        assert stats.plain_rounds and stats.proposals_verified_kept, "plain rounds that verify proposals"
    prompt = ids.shape[-1]
    for position in range(prompt, prompt + new_tokens):
        p_value = chi_square_p(out.sequences[:, position], stock[:, position])
        assert p_value > ALPHA / new_tokens, (position, p_value)


def test_two_level_rule_recovers_the_target_distribution():
    """The pure rules chained, many rows at once: a fixed proposal checked against the draft tier's p_d
    (`proposal_accept`), then the drafted token checked against the full tier's p (`speculative_accept`) with p_d
    as its draft distribution. The emitted token follows p, whatever the proposal and p_d were."""
    torch.manual_seed(0)
    rows, vocab = 60_000, 6
    p = torch.softmax(torch.randn(vocab, dtype=torch.float64) * 2, dim=-1)
    p_draft = torch.softmax(torch.randn(vocab, dtype=torch.float64) * 2, dim=-1)
    proposal = torch.full((rows, 1), int(p_draft.argmax()))
    kept, own = proposal_accept(
        proposal, torch.ones(rows, dtype=torch.long), p_draft.log().expand(rows, 2, vocab), True
    )
    drafted = torch.where(kept.bool(), proposal[:, 0], own)
    assert 0 < kept.float().mean() < 1
    counts = torch.bincount(drafted, minlength=vocab).double()
    assert ((counts - p_draft * rows) ** 2 / (p_draft * rows)).sum() < 30  # drafts follow p_draft
    _, tokens = speculative_accept(drafted[:, None], p_draft.expand(rows, 1, vocab), p.expand(rows, 2, vocab))
    first = torch.bincount(tokens[:, 0], minlength=vocab).double()
    assert ((first - p * rows) ** 2 / (p * rows)).sum() < 30  # chi-square, 5 dof: false alarm < 1e-5


def test_greedy_rule_keeps_the_run_that_agrees():
    scores = torch.full((2, 4, VOCAB), -1.0, dtype=torch.float64)
    for row, own in enumerate([[5, 6, 7, 8], [5, 9, 7, 8]]):
        scores[row, torch.arange(4), torch.tensor(own)] = 1.0
    proposals = torch.tensor([[5, 6, 7], [5, 6, 7]])
    kept, own = proposal_accept(proposals, torch.tensor([2, 3]), scores, do_sample=False)
    assert kept.tolist() == [2, 1] and own.tolist() == [
        7,
        9,
    ]  # row 0 was offered 2: its own token follows them


def test_prompt_lookup_proposes_only_after_a_match_of_two_tokens():
    """A one-token match rarely predicts what follows (0.2-0.4 of 10 tokens kept on the embedded model's prompts)
    and at batch > 1 it widens the whole pass, so it proposes nothing; a two-token match proposes as transformers'."""
    lookup = PromptLookupProposer(num_tokens=3, max_ngram_size=None, eos_token_id=None)
    one_token = torch.tensor([5, 6, 7, 8, 9, 6])  # only "6" occurred before
    two_tokens = torch.tensor([5, 6, 7, 8, 9, 5, 6])  # "5 6" occurred before, followed by 7 8 9
    assert lookup.propose(0, one_token, 3).numel() == 0
    assert lookup.propose(0, two_tokens, 3).tolist() == [7, 8, 9]
    assert lookup.propose(0, two_tokens, 2).tolist() == [7, 8]
    # asked for one-token matches, it proposes them
    assert PromptLookupProposer(3, 1, None).propose(0, one_token, 3).tolist() == [7, 8, 9]


def test_a_pass_widens_only_for_the_rows_the_call_waits_for():
    rows = [torch.arange(n) for n in (10, 2, 0, 5)]
    assert [r.shape[-1] for r in widen_for(rows, bound=[1, 3])] == [5, 2, 0, 5]
    assert [r.shape[-1] for r in widen_for(rows, bound=[2])] == [0, 0, 0, 0]  # no bound row found any
    assert torch.equal(widen_for(rows, bound=[0])[0], rows[0])
