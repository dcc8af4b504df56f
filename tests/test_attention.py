"""The attention VeriCache's passes run (`attention.py`, `pass_model.py`): the model's own numbers, its queries
as attention receives them, and nothing of the user's model changed."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import vericache_hf
from vericache_hf.attention import wrapped_name
from vericache_hf.cache.capture import QueryCapture
from vericache_hf.pass_model import attention_layers, pass_model

from .conftest import random_prompt, tiny_model


class _Heads(torch.nn.Module):
    """What sdpa reads of an attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_length", [1, 9, 33])
def test_grouped_sdpa_on_a_cpu_is_transformers_sdpa_bit_for_bit(dtype, query_length):
    """A masked multi-token pass (a verify pass) through the wrapper equals transformers' sdpa, which repeats K/V
    per query head, to the last bit: the CPU path needs no environment variable and changes no output."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    generator = torch.Generator().manual_seed(query_length)
    batch, heads, kv_heads, length, dim = 3, 8, 2, 301, 16
    query = torch.randn(batch, heads, query_length, dim, generator=generator).to(dtype)
    key = torch.randn(batch, kv_heads, length, dim, generator=generator).to(dtype)
    value = torch.randn(batch, kv_heads, length, dim, generator=generator).to(dtype)
    mask = torch.rand(batch, 1, query_length, length, generator=generator) > 0.2
    module = _Heads(heads // kv_heads)
    stock, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=0.25)
    wrapped, _ = ALL_ATTENTION_FUNCTIONS[wrapped_name("sdpa")](
        module, query, key, value, mask, dropout=0.0, scaling=0.25
    )
    assert torch.equal(stock, wrapped)


def test_the_pass_model_shares_every_tensor_and_leaves_the_model_alone(monkeypatch):
    model = tiny_model("llama", seed=3)
    before = model.config._attn_implementation
    runner = pass_model(model)
    assert runner is not model and pass_model(model) is runner  # made once
    shared = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert {t.data_ptr() for t in [*runner.parameters(), *runner.buffers()]} == shared
    assert runner.config._attn_implementation == wrapped_name(before)
    assert model.config._attn_implementation == before
    assert not any(m._forward_pre_hooks for m in attention_layers(model))
    model.set_attn_implementation("eager")  # a model set to another attention gets a new copy
    assert pass_model(model) is not runner
    assert pass_model(model).config._attn_implementation == wrapped_name("eager")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_captured_queries_are_the_queries_attention_receives(family):
    """Llama's queries recomputed by hand (projection, Qwen3's per-head norm, rotary) equal what the wrapper hands
    a capture: the capture reads them from attention itself, so families that compute them otherwise are served
    by the same code."""
    model = tiny_model(family, seed=4)
    runner = pass_model(model)
    ids = random_prompt(40, seed=4)
    capture = QueryCapture(torch.ones_like(ids, dtype=torch.bool), runner)
    layer_inputs = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda m, a, k: layer_inputs.__setitem__(m.layer_idx, (a, k)), with_kwargs=True
        )
        for m in attention_layers(runner)
    ]
    try:
        with torch.no_grad():
            runner(ids, vericache_capture=capture)
    finally:
        for hook in hooks:
            hook.remove()
    for module in attention_layers(runner):
        args, kwargs = layer_inputs[module.layer_idx]
        hidden = args[0] if args else kwargs["hidden_states"]
        queries = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim)
        if hasattr(module, "q_norm"):
            queries = module.q_norm(queries)
        cos, sin = kwargs["position_embeddings"]
        expected, _ = apply_rotary_pos_emb(queries.transpose(1, 2), queries.transpose(1, 2), cos, sin)
        captured = capture.contexts[module.layer_idx]
        assert torch.allclose(captured.queries, expected, rtol=0, atol=1e-12)
        assert captured.scaling == module.scaling


@pytest.mark.parametrize("force_gqa", [None, "1"])
def test_verify_passes_need_no_environment_variable(monkeypatch, force_gqa):
    """With TRANSFORMERS_SDPA_FORCE_GQA unset (and set, as a user's environment may have it), a left-padded batch decodes
    exactly as stock generate, and another thread's plain generate on the same model, running meanwhile, is stock
    too."""
    if force_gqa is None:
        monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    else:
        monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", force_gqa)
    model = tiny_model("llama", seed=5)
    ids = random_prompt(60, batch=3, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :13] = 0
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    plain: list[torch.Tensor] = []
    worker = threading.Thread(
        target=lambda: plain.append(
            model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        )
    )
    config = vericache_hf.VeriCacheConfig(compressor="snapkv", draft_length=5, draft_schedule="fixed")
    worker.start()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=24,
        do_sample=False,
        generation_mode="vericache",
        vericache_config=config,
        return_dict_in_generate=True,
    )
    worker.join()
    assert torch.equal(out.sequences, stock)
    assert torch.equal(plain[0], stock)
    assert out.vericache_stats.accepted_tokens > 0
    assert model.config._attn_implementation == "sdpa"
