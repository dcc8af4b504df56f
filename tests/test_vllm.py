"""VeriCache as a vLLM proposer, against real vLLM (CPU build) in its own venv, `.venv-vllm`
(`scripts/setup_vllm.sh`). The checks run there in a subprocess (`tests/vllm_checks/parity.py`), so this process
never imports vLLM; without that venv they are skipped. The draft book's row tracking is also tested here, on
a tiny model, without vLLM.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run of the checks: vLLM without speculation, then with VeriCache drafting, on the same requests."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh to test the vLLM proposer")
    from vericache_tools.embedded import embedded_model_dir

    model = embedded_model_dir()  # the HF folder vLLM loads, converted from the GGUF where no test has yet
    out = tmp_path_factory.mktemp("vllm") / "runs.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    # vLLM's own binding would take cores of its own; unbound, it runs the threads this process is given
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    done = subprocess.run(
        [str(VLLM_PYTHON), "-m", "tests.vllm_checks.parity", str(model), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        pytest.fail(
            f"the vLLM checks failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )
    return json.loads(out.read_text())


@pytest.mark.slow
def test_greedy_output_is_vllms_own(runs):
    """Mixed prompt lengths and output lengths (rows finish at different steps and vLLM condenses its batch)."""
    assert len(set(runs["prompt_lengths"])) == len(runs["prompt_lengths"])
    assert runs["vericache"] == runs["plain"]


@pytest.mark.slow
def test_drafts_are_accepted_and_states_follow_their_requests(runs):
    stats = runs["stats"]
    assert stats["kept"] > 0, stats
    # four requests build a draft tier (three draft, one fails at its first drafting round), each once: every
    # state followed its request across the batch's reorders
    assert stats["built"] == 4, stats
    # vLLM's own K/V built every draft tier: the copy computed only SnapKV's 32-token windows
    assert stats["runner_kv"] and stats["prefilled_tokens"] == 4 * 32, stats


@pytest.mark.slow
def test_a_request_failing_in_the_proposer_gets_no_drafts(runs):
    """One request fails as its draft tier is built, one at its first drafting round: both finish as without drafts."""
    assert runs["stats"]["failed_rows"] == 2
    assert runs["vericache"][4:6] == runs["plain"][4:6]


def _z(plain: list[list[int]], drafted: list[list[int]]) -> float:
    """A two-proportion z statistic: how often the second token equals its most common value, in each run."""
    seconds = [pair[1] for pair in plain + drafted]
    common = max(set(seconds), key=seconds.count)
    p1 = sum(pair[1] == common for pair in plain) / len(plain)
    p2 = sum(pair[1] == common for pair in drafted) / len(drafted)
    pooled = (p1 + p2) / 2
    return abs(p1 - p2) / math.sqrt(max(pooled * (1 - pooled), 1e-9) * 2 / len(plain))


@pytest.mark.slow
def test_sampling_keeps_the_distribution(runs):
    """The second token after the prompt is the first a draft decides: how often it equals its most common value
    must agree with vLLM's own sampling (|z| < 4, so a correct proposer fails about once in 16,000 runs; one that
    accepted every greedy draft would not pass). It is checked only where vLLM's rejection sampling keeps the
    distribution for drafts that come from no model at all (the control); vLLM 0.32's CPU build does not."""
    control = _z(runs["plain_sampled"], runs["control_sampled"])
    if control >= 4:
        pytest.skip(
            f"vLLM's own rejection sampling does not keep the distribution here: drafts from no model move the "
            f"second token's distribution (z = {control:.1f}), so no proposer's sampled output can match it"
        )
    assert _z(runs["plain_sampled"], runs["vericache_sampled"]) < 4


def test_package_imports_without_vllm():
    code = "import sys, vericache_hf.vllm; assert 'vllm' not in sys.modules, 'vllm was imported'"
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}
    )


def tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(torch.float64).eval()


def test_book_follows_rows_by_their_tokens():
    """Rows swap places and one is replaced by another request: each row drafts exactly what its own request's
    state, driven alone, drafts, and a row whose tokens no state stands for gets a new state."""
    import torch

    from vericache_hf.compressors import build_compressor
    from vericache_hf.vllm import DraftBook, DraftState, Pacing

    model, compressor = tiny_model(), build_compressor("snapkv", 0.5, window_size=4)
    built = []

    def build(tokens, row):
        built.append(list(tokens))
        return DraftState.build(model, compressor, tokens)

    generator = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(0, 96, (40,), generator=generator).tolist() for _ in range(3))
    alone = {
        name: DraftState.build(model, compressor, prompt)
        for name, prompt in zip("abc", (a, b, c), strict=True)
    }
    book = DraftBook(
        build, Pacing(max_length=3, first_length=3, min_length=3, min_context=20, measure_plain=False)
    )
    steps = [
        [("a", a + [1]), ("b", b + [2])],
        [("b", b + [2, 5, 6]), ("a", a + [1, 7])],  # the engine swapped the rows; each request gained tokens
        [("b", b + [2, 5, 6, 9]), ("c", c + [3])],  # row 1 now holds a request the book has not seen
    ]
    for step in steps:
        drafts = book.propose([tokens for _, tokens in step])
        assert drafts == [alone[name].draft(tokens, 3) for name, tokens in step]
    assert built == [a, b, c]

    # a row whose tokens differ from its state's anywhere (not just at the end) never drafts on that state
    drafts = book.propose([b[:30] + [0] + b[31:] + [2, 5, 6, 9, 4]])
    assert len(built) == 4 and built[-1][30] == 0


class FakeClock:
    """The book's clock, moved by the test: an engine step and a draft pass take the times the test gives."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def paced_book(draft_pass: float):
    """A book on the tiny model whose draft passes take `draft_pass` on its clock."""
    from vericache_hf.compressors import build_compressor
    from vericache_hf.vllm import DraftBook, DraftState, Pacing
    from vericache_hf.vllm.draft import draft_rows

    model, compressor = tiny_model(), build_compressor("streaming_llm", 0.5)
    book = DraftBook(lambda tokens, row: DraftState.build(model, compressor, tokens), Pacing(min_context=20))
    book.clock = clock = FakeClock()

    def timed(states, rows, lengths):
        clock.now += draft_pass * max(lengths)
        return draft_rows(states, rows, lengths)

    book.draft_rows = timed
    return book, clock


def test_book_stops_a_row_whose_drafts_do_not_pay():
    """A row whose drafts are all rejected stops drafting after its probe rounds and costs no pass then."""
    book, clock = paced_book(draft_pass=0.01)
    tokens = list(range(1, 41))
    drafted = []
    for _ in range(12):
        drafts = book.propose([tokens])[0]
        clock.now += 0.1  # the engine's step
        drafted.append(len(drafts))
        # the engine rejects every draft: the next token is never the first draft
        tokens = tokens + [(drafts[0] + 1) % 96 if drafts else 0]
    assert drafted[:2] == [0, 0] and drafted[2] > 0 and drafted[-1] == 0, (
        drafted
    )  # two plain steps, then drafts
    assert book.rounds >= book.pacing.probe_rounds and book.kept == 0


def test_book_stops_at_once_where_a_draft_pass_costs_an_engine_step():
    """Every draft is kept, but a draft pass costs more than a plain engine step (timed by the second step; the
    first two draft nothing): no draft length can pay, so the row stops after its first round, without the probe rounds, and
    the probes its backoff brings are skipped while that holds; with passes a tenth of a step it goes on."""
    for draft_pass, stops in ((0.2, True), (0.01, False)):
        book, clock = paced_book(draft_pass)
        tokens = list(range(1, 41))
        drafted = []
        for _ in range(80 if stops else 5):
            drafts = book.propose([tokens])[0]
            clock.now += 0.1
            drafted.append(len(drafts))
            tokens = tokens + drafts + [1]  # the engine keeps every draft, and adds its own token
        assert drafted[:2] == [0, 0] and drafted[2] > 0, drafted
        assert (not any(drafted[3:])) is stops, drafted
        # past the first backoff (32 steps), and the second, no probe drafted
        assert (book.rounds == 1) is stops


def test_book_stops_where_the_verify_step_costs_more_than_every_kept_draft_saves():
    """A draft pass costs a little less than a plain step (0.08 against 0.1) and every draft is kept, but the step
    that verifies drafts costs three plain ones: even a round of the longest drafts, all kept, gives fewer tokens
    per second than plain steps. The row stops after the round that timed the verify step, and the probes its
    backoff brings are skipped without a pass; where the verify step costs what a plain one does, it goes on."""
    for verify, stops in ((0.3, True), (0.1, False)):
        book, clock = paced_book(draft_pass=0.08)
        tokens = list(range(1, 41))
        drafted = []
        for _ in range(80 if stops else 6):
            drafts = book.propose([tokens])[0]
            clock.now += verify if drafts else 0.1
            drafted.append(len(drafts))
            tokens = tokens + drafts + [1]
        assert drafted[:2] == [0, 0] and drafted[2] > 0, drafted
        assert (not any(drafted[4:])) is stops, drafted
        assert (book.rounds <= 2) is stops, book.rounds


def test_the_plain_step_drafting_must_beat_is_a_steady_one():
    """The first engine step after the prefill takes ten plain steps' time. Timed as the plain step, it would make
    drafts at 0.15 a pass look cheap, and every draft is kept, so the row would draft on; the steady plain step (0.1)
    is the one timed, against which no length can pay: one round, then no probe over 80 steps."""
    book, clock = paced_book(draft_pass=0.15)
    tokens = list(range(1, 41))
    drafted = []
    for step in range(80):
        drafts = book.propose([tokens])[0]
        clock.now += 1.0 if step == 0 else 0.1
        drafted.append(len(drafts))
        tokens = tokens + drafts + [1]
    assert book.plain_steps[1] == pytest.approx(0.1)
    assert book.rounds == 1 and sum(map(bool, drafted)) == 1, drafted


def test_a_probe_that_the_rows_curves_say_does_not_pay_drafts_the_shortest_length_once():
    """The engine keeps five drafts a round; a pass costs 0.08, a plain step 0.1 and the step that verifies drafts
    0.22. Every draft kept could pay (not hopeless), but five kept do not, at any length: drafting stops after its
    probe rounds. Each probe after that drafts the shortest length for one round, a look at the acceptance, not
    the best length for three."""
    book, clock = paced_book(draft_pass=0.08)
    tokens = list(range(1, 41))
    drafted = []
    for _ in range(120):
        drafts = book.propose([tokens])[0]
        clock.now += 0.22 if drafts else 0.1
        drafted.append(len(drafts))
        tokens = tokens + drafts[:5] + [(drafts[5] + 1) % 96 if len(drafts) > 5 else 1]
    first_stop = next(i for i in range(3, len(drafted)) if not drafted[i])
    probes = [(i, n) for i, n in enumerate(drafted) if n and i > first_stop]
    assert len(probes) >= 2, drafted  # the backoffs of 32 and 64 steps
    assert all(n == book.pacing.min_length and not drafted[i + 1] for i, n in probes), drafted


def test_drafting_stops_where_its_rounds_gave_less_than_plain_steps_however_the_model_priced_them():
    """The step that verifies L drafts costs 0.1 + 0.1 L, which the cost model, one verify cost for every length,
    underprices for long rounds: with every draft kept it would draft on at the longest length. What the rounds
    gave (L + 1 tokens over the round's passes and its verify step) is below plain steps' 10 tokens/s at every
    length, so drafting stops after its probe rounds, and each later probe drafts one round."""
    book, clock = paced_book(draft_pass=0.02)
    tokens = list(range(1, 41))
    drafted = []
    for _ in range(80):
        drafts = book.propose([tokens])[0]
        clock.now += 0.1 + 0.1 * len(drafts)
        drafted.append(len(drafts))
        tokens = tokens + drafts + [1]
    probe_rounds = book.pacing.probe_rounds
    assert all(drafted[2 : 2 + probe_rounds]) and not any(drafted[2 + probe_rounds : 30]), drafted
    assert book.rounds <= probe_rounds + 2, (
        drafted
    )  # a probe of one round after each backoff (32, then 64 steps)


def test_the_batch_drafts_the_length_whose_rounds_give_the_most_tokens_per_second():
    """The row's drafts are kept five at a time (the engine rejects the sixth), a draft pass costs a fifth of an
    engine step: a round of 5 drafts gives 6 tokens for 2 steps' time, the best rate of any length, and drafting
    settles there (it started at 4; longer rounds cost passes that nothing is kept from)."""
    book, clock = paced_book(draft_pass=0.02)
    tokens = list(range(1, 41))
    drafted = []
    for _ in range(30):
        drafts = book.propose([tokens])[0]
        clock.now += 0.1
        drafted.append(len(drafts))
        kept = drafts[:5]
        tokens = tokens + kept + [(drafts[5] + 1) % 96 if len(drafts) > 5 else 1]
    assert drafted[:2] == [0, 0] and drafted[2] == 4, drafted
    assert any(n > 5 for n in drafted), drafted  # runs past 5 were tried
    # now and then a run of 6 is tried again
    assert drafted[-10:].count(5) >= 8 and max(drafted[-10:]) <= 6, drafted


def test_drafting_is_decided_for_the_batch_whose_step_waits_for_every_pass():
    """Two rows: the engine keeps every draft of the first, none of the second. A batched pass costs 0.06, a
    plain step of both rows 0.1 (20 tokens/s). The first row's rounds alone would pay, but the batch's do not: a
    round of L gives L + 2 tokens for 0.06 L + 0.1 s, under 20 tokens/s at every length. So both rows draft one
    length while drafting is probed, and then neither drafts."""
    book, clock = paced_book(draft_pass=0.06)
    rows = [list(range(1, 41)), list(range(41, 81))]
    drafted = []
    for _ in range(12):
        drafts = book.propose(rows)
        clock.now += 0.1
        drafted.append([len(d) for d in drafts])
        rows = [rows[0] + drafts[0] + [1], rows[1] + [(drafts[1][0] + 1) % 96 if drafts[1] else 1]]
    assert drafted[:2] == [[0, 0]] * 2 and drafted[2][0] > 0, drafted
    assert all(a == b for a, b in drafted), drafted  # one length for the batch
    assert drafted[-4:] == [[0, 0]] * 4 and book.rounds >= 2 * book.pacing.probe_rounds, drafted


def test_rows_drafted_together_continue_as_stock_generate():
    """Rows of different lengths, fed different numbers of new tokens and drafting different lengths, drafted in
    one batch on draft tiers that keep every token (ratio 0): each row's drafts are stock greedy `generate`'s next
    tokens for that row alone. With SnapKV at 0.5, the batch drafts what each row drafts alone."""
    import torch

    from vericache_hf.compressors import build_compressor
    from vericache_hf.vllm.draft import DraftState, draft_rows

    model = tiny_model()
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=generator).tolist() for n in (40, 23, 57)]
    fed = [[5], [7, 8, 9], [11, 12]]
    lengths = [4, 2, 5]
    rows = [prompt + new for prompt, new in zip(prompts, fed, strict=True)]
    keep_all = build_compressor("snapkv", 0.0, window_size=4)
    states = [DraftState.build(model, keep_all, prompt) for prompt in prompts]
    drafts = draft_rows(states, rows, lengths)
    for row, length, got in zip(rows, lengths, drafts, strict=True):
        stock = model.generate(torch.tensor([row]), max_new_tokens=length, do_sample=False)
        assert got == stock[0, len(row) :].tolist()
    # the fed tokens were committed: a second round on top drafts as stock does on the longer rows
    longer = [row + got[:1] for row, got in zip(rows, drafts, strict=True)]
    again = draft_rows(states, longer, [3, 3, 3])
    for row, got in zip(longer, again, strict=True):
        stock = model.generate(torch.tensor([row]), max_new_tokens=3, do_sample=False)
        assert got == stock[0, len(row) :].tolist()

    snapkv = build_compressor("snapkv", 0.5, window_size=4)
    together = draft_rows([DraftState.build(model, snapkv, p) for p in prompts], rows, lengths)
    alone = [
        DraftState.build(model, snapkv, p).draft(r, n) for p, r, n in zip(prompts, rows, lengths, strict=True)
    ]
    assert together == alone


def test_a_row_failing_in_a_batched_round_fails_alone():
    """One row's drafting raises inside a batched round: the others get the drafts they get alone, it gets none
    from then on."""
    import torch

    from vericache_hf.compressors import build_compressor
    from vericache_hf.vllm import DraftBook, DraftState, Pacing
    from vericache_hf.vllm.draft import draft_rows

    model, compressor = tiny_model(), build_compressor("snapkv", 0.5, window_size=4)
    generator = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, 96, (40,), generator=generator).tolist() for _ in range(3))
    book = DraftBook(
        lambda tokens, row: DraftState.build(model, compressor, tokens),
        Pacing(max_length=3, first_length=3, min_length=3, min_context=20, measure_plain=False),
    )

    def failing_on_b(states, rows, lengths):
        if any(state.tokens[:40] == b for state in states):
            raise RuntimeError("injected")
        return draft_rows(states, rows, lengths)

    book.draft_rows = failing_on_b
    rows = [a + [1], b + [2], c + [3]]
    drafts = book.propose(rows)
    alone = [DraftState.build(model, compressor, p).draft(r, 3) for p, r in ((a, rows[0]), (c, rows[2]))]
    assert drafts == [alone[0], [], alone[1]]
    assert book.failed_rows == 1
    assert book.propose([rows[1] + [drafts[0][0]]]) == [[]]
