"""`draft_matmul="measured"`: draft-tier passes run each linear layer in the layout measured fastest for its shape and
row count, on a copy sharing the model's weights. Greedy output equals stock `generate` of the float64 model in every
layout (alone, composed with a proposer, through the engine); each layout computes `linear`'s product; the
measurement keeps the fastest; the copy is made once, shared by threads, and the model is untouched.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from vericache_hf import VeriCacheConfig, generate_batch
from vericache_hf.drafting import draft_matmul as dm
from vericache_hf.drafting.draft_model import draft_model

from .conftest import random_prompt, tiny_model
from .test_generate_parity import left_padded_batch
from .test_proposers import generate_both, repeat_tail
from .test_threads import model_state, run_threads


def forced(monkeypatch, layout: str) -> None:
    """Every measurement chooses `layout`, so that each layout's exactness is checked, not just the fastest here."""
    monkeypatch.setattr(dm, "fastest", lambda ratios: layout)


def layouts_used(drafter) -> set[str]:
    tables = {id(m.layouts): m.layouts for m in drafter.modules() if isinstance(m, dm.MeasuredLinear)}
    return {layout for table in tables.values() for layout in table.chosen.values()}


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_every_layout_computes_linear(rows, bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 24, dtype=torch.float64, generator=generator)
    weight = torch.randn(40, 24, dtype=torch.float64, generator=generator)
    b = torch.randn(40, dtype=torch.float64, generator=generator) if bias else None
    want = F.linear(x, weight, b)
    for layout in dm.LAYOUTS:
        got = dm.product(layout, x.view(rows, 1, 24), weight, b)
        assert got.shape == (rows, 1, 40) and got.is_contiguous(), layout
        torch.testing.assert_close(got.view(1, rows, 40), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", list(dm.LAYOUTS))
def test_drafts_in_each_layout_on_a_padded_batch_match_stock(monkeypatch, layout):
    model = tiny_model("llama", seed=3, num_hidden_layers=3)
    forced(monkeypatch, layout)
    ids, mask = left_padded_batch()
    config = VeriCacheConfig(compressor="snapkv", draft_schedule="fixed", draft_length=5)
    stock, ours = generate_both(model, ids, config, attention_mask=mask, max_new_tokens=30)
    assert torch.equal(ours.sequences, stock)
    assert ours.vericache_stats.draft_forwards > 0 and ours.vericache_stats.acceptance_rate > 0
    assert layouts_used(draft_model(model, None)) == {layout}  # the drafts ran through the forced layout


@pytest.mark.parametrize("proposer", ["lookup", "assistant"])
def test_measured_drafts_composed_with_a_proposer_match_stock(monkeypatch, proposer):
    model = tiny_model("llama", seed=4, num_hidden_layers=3)
    forced(monkeypatch, "weight_first")
    ids, mask = repeat_tail(*left_padded_batch())
    kwargs = (
        {"prompt_lookup_num_tokens": 5}
        if proposer == "lookup"
        else {"assistant_model": tiny_model("llama", seed=5, num_hidden_layers=1)}
    )
    config = VeriCacheConfig(compressor="snapkv", draft_schedule="fixed", draft_length=6)
    stock, ours = generate_both(model, ids, config, attention_mask=mask, max_new_tokens=30, **kwargs)
    assert torch.equal(ours.sequences, stock)
    assert ours.vericache_stats.proposed_tokens > 0
    assert layouts_used(draft_model(model, None)) == {"weight_first"}


def test_the_engine_drafts_with_measured_layouts_and_stays_exact():
    model = tiny_model("llama", seed=6, num_hidden_layers=2)
    prompts = [random_prompt(30 + 7 * i, seed=40 + i)[0].tolist() for i in range(4)]
    config = VeriCacheConfig(compressor="streaming_llm", draft_length=4, draft_schedule="fixed")
    results = generate_batch(model, prompts, max_new_tokens=16, vericache_config=config, do_sample=False)
    for out, prompt in zip(results.values(), prompts, strict=True):
        stock = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)
        assert out.error is None and out.generated_tokens == stock[0, len(prompt) :].tolist()
    assert layouts_used(draft_model(model, None))  # the engine's drafts were measured


def test_the_median_ratio_decides_and_linear_stays_unless_clearly_beaten():
    # the median (0.8), not the best single pair
    assert dm.fastest([0.8, 0.1, 1.5]) == "weight_first"
    # 2% faster is within the timer's noise
    assert dm.fastest([0.98, 0.98, 0.1]) == "linear"


def test_each_weight_times_both_layouts_in_turn_and_the_order_flips():
    """A weight's products take the layouts in turn, ABBA for even members and BAAB for odd ones: a slow pass (a
    cold first one) lands on both layouts alike, and neighbours of one shape never all run one layout."""
    linear, first = dm.LAYOUTS
    assert [dm.turn(0, n) for n in range(4)] == [linear, first, first, linear]
    assert [dm.turn(1, n) for n in range(4)] == [first, linear, linear, first]


def test_draft_passes_pair_the_layouts_on_each_weight_then_keep_the_fastest(monkeypatch):
    """The layers' own products timed on a clock that moves only with them, one layout's eight times as far as
    the other's (so this machine's noise decides nothing): the table must see it, decide after `PAIRS` pairs
    (each on one weight), and from then on run only the chosen one."""
    model = tiny_model("llama", seed=7, num_hidden_layers=2)
    drafter = draft_model(model, None)
    layers = [block.mlp.down_proj for block in drafter.model.layers]
    assert [layer.member for layer in layers] == [0, 1]
    table, group = layers[0].layouts, layers[0].group
    original, ran, slow = dm.product, [], "linear"
    clock = SimpleNamespace(now=0.0)
    clock.perf_counter = lambda: clock.now

    def slowed(layout, *args):
        ran.append(layout)
        clock.now += (8 if layout == slow else 1) / 1024
        return original(layout, *args)

    monkeypatch.setattr(dm, "product", slowed)
    monkeypatch.setattr(dm, "time", clock)
    x = torch.randn(3, 1, layers[0].in_features, dtype=layers[0].weight.dtype)
    for call in range(2 * dm.PAIRS):  # passes of the two layers: each layer finishes a pair every second pass
        layer = layers[call % 2]
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    # every layout timed PAIRS times, the two layers in opposite turns, then the choice
    assert sorted(ran) == sorted(list(dm.LAYOUTS) * dm.PAIRS)
    assert ran[:4] == ["linear", "weight_first", "weight_first", "linear"]
    assert table.chosen == {(group, 3): "weight_first"}
    ran.clear()
    for layer in layers:
        layer(x)
    assert ran == ["weight_first"] * 2
    slow, one = "weight_first", x[:1]  # a single row (padded to two in weight_first) is measured apart
    for call in range(2 * dm.PAIRS):
        layers[call % 2](one)
    assert table.chosen[(group, 1)] == "linear"
    wide = torch.randn(1, dm.MOST_ROWS + 1, layers[0].in_features, dtype=layers[0].weight.dtype)
    layers[0](wide)
    # many rows: linear, untimed
    assert len(ran) == 2 + 2 * dm.PAIRS and len(table.chosen) == 2


def test_one_shared_copy_holding_the_models_weights_and_the_model_untouched():
    model = tiny_model("llama", seed=9, num_hidden_layers=2)
    before = model_state(model), {n: (type(m), m.forward) for n, m in model.named_modules()}
    copies = []
    errors = run_threads([lambda: copies.append(draft_model(model, None)) for _ in range(4)])
    assert not errors and len({id(c) for c in copies}) == 1
    drafter = copies[0]
    assert drafter is not model and drafter.config is not model.config
    ours = dict(model.named_parameters())
    # the same tensors: no memory, and weights changed in place are seen by the drafts too
    assert all(p is ours[name] for name, p in drafter.named_parameters())
    assert isinstance(drafter.lm_head, dm.MeasuredLinear) and type(model.lm_head) is torch.nn.Linear
    assert draft_model(model, None, "stock") is None
    assert (model_state(model), {n: (type(m), m.forward) for n, m in model.named_modules()}) == before


def test_bad_draft_matmuls_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"draft_matmul must be one of \('measured', 'stock'\)"):
        VeriCacheConfig(draft_matmul="fast")
    with pytest.raises(ValueError, match="draft_matmul must be one of"):
        draft_model(tiny_model("llama", seed=3, num_hidden_layers=1), None, "blas")
