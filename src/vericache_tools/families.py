"""Tiny random models of every causal-LM family transformers ships, and the verdict VeriCache gives each.

The families come from transformers' own `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, so the matrix grows with
transformers. A family's tiny model is its default config shrunk field by field (only the fields its config has),
with a short sliding window so that window layers matter at a 70-token prompt. A family is *in the matrix* when its
tiny model builds and runs stock `generate`; then VeriCache must either match stock at batch 1 and on left-padded
batches of 3, one of them with rows that accept different counts, or refuse it with a `ValueError` before decoding. `python -m vericache_tools.families` writes
`docs/models.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import multiprocessing
import os
import platform
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import vericache_hf
from vericache_hf.layer_plan import layer_plan
from vericache_hf.passes import counts_positions_from_cache

VOCAB = 128
PROMPT_TOKENS = 70
NEW_TOKENS = 20
WINDOW = 16
MAX_PARAMETERS = 30_000_000
MODULE = "vericache_tools.families"
#: (prompt seed, compressor, compression ratio) tried for the batch of 3, in turn, until its rows accept different
#: counts in some round: a draft tier that still holds a short window whole drafts every token right, so harder
#: compression follows
RAGGED_TRIES = ((0, "snapkv", 0.5), (1, "snapkv", 0.75), (2, "snapkv", 0.875), (3, "streaming_llm", 0.9))

#: Field values that make any family's config tiny; a config takes those of its own fields.
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "ffn_hidden_size": 128,
    "n_inner": 128,
    "num_hidden_layers": 4,
    "n_layer": 4,
    "num_layers": 4,
    "num_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "n_positions": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW,
    "sliding_window_pattern": 2,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_intermediate_size": 64,
    "expert_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "state_size": 8,
    "mamba_d_state": 8,
    "mamba_n_heads": 4,
    "mamba_d_head": 32,  # times mamba_n_heads: mamba_expand * hidden_size
    "mamba_n_groups": 1,
    "mamba_expand": 2,
    "mamba_d_conv": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "conv_L_cache": 3,
    "attn_layer_period": 2,  # Jamba: an attention layer among the first four
    "attn_layer_offset": 1,
    "attn_layer_indices": [1],  # Bamba
    "mamba_d_ssm": 128,  # Falcon-H1: mamba_d_head * mamba_n_heads
    "block_dim": 64,
    "block_ff_dim": 128,
    "attention_window_size": WINDOW,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    "rotary_dim": 8,
    "is_decoder": True,
}


#: Families whose default config is not what their checkpoints look like: Granite 4's hybrid defaults to Mamba
#: layers alone, which stock `generate` cannot run, while its checkpoints interleave attention layers.
OVERRIDES = {
    "granitemoehybrid": {
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    },
}


@dataclasses.dataclass
class Verdict:
    """What VeriCache does with one family: `exact`, `refused` (with the reason), `differs`, `crashes`, or `out`
    of the matrix (its tiny model does not build or stock `generate` fails on it)."""

    family: str
    verdict: str
    layer_kinds: str = ""
    dtype: str = ""
    reason: str = ""
    rows: str = ""  # how the batch of 3's rows accepted: `ragged`, `uniform` (by design), `all` or `even`


def _fields(config_class) -> set[str]:
    names = set(inspect.signature(config_class.__init__).parameters)
    if dataclasses.is_dataclass(config_class):
        names |= {f.name for f in dataclasses.fields(config_class)}
    return names


def _tiny_kwargs(config_class) -> dict:
    fields = _fields(config_class)
    return {name: value for name, value in TINY.items() if name in fields}


def _keep_layer_kinds(default, kwargs: dict) -> None:
    """Keep every layer kind of the default config in the shrunk one: the shortest prefix of its layer pattern
    that holds each kind, at least the tiny layer count."""
    fields = _fields(type(default))
    field = next((name for name in ("layer_types", "layers_block_type") if name in fields), None)
    kinds = getattr(default, field, None) if field is not None else None
    if not kinds:
        return
    layers = kwargs.get("num_hidden_layers", 4)
    while layers < len(kinds) and set(kinds[:layers]) != set(kinds):
        layers += 1
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if name in kwargs:
            kwargs[name] = layers
    kwargs[field] = list(kinds[:layers])


def tiny_config(family: str):
    """The family's default config, shrunk; sub-configs (text, vision, audio) shrunk alike."""
    config_class = type(AutoConfig.for_model(family))
    kwargs = _tiny_kwargs(config_class)
    default = config_class()
    _keep_layer_kinds(default, kwargs)
    kwargs.update(OVERRIDES.get(family, {}))
    if getattr(default, "kv_lora_rank", None) is not None:  # latent attention: one KV head per query head
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    for name in ("text_config", "vision_config", "audio_config"):
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            shrunk = _tiny_kwargs(type(sub))
            _keep_layer_kinds(sub, shrunk)
            kwargs[name] = {**sub.to_dict(), **shrunk}
            if name == "vision_config":
                kwargs[name].update(num_hidden_layers=1, depth=1, image_size=32, patch_size=8)
    return config_class(**kwargs)


def tiny_model(family: str, seed: int = 0):
    """The family's tiny random model in float64, or float32 where the family does not run in float64."""
    config = tiny_config(family)
    with torch.device("meta"):  # counted before a byte is allocated
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise RuntimeError(f"the shrunk config still has {size} parameters")
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # a family without sdpa runs its eager attention
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        for module in model.modules():  # sharper distributions: random weights then draft long runs
            if module is model.get_output_embeddings():
                module.weight.mul_(4.0)
    return model


def prompts(batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A 70-token prompt (batch 1) or a left-padded batch of rows 70, 55 and 40 tokens long."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, PROMPT_TOKENS), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 15, 30][:batch]):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def stock_greedy(model, inputs, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    """Stock greedy `generate` of exactly `new_tokens`."""
    return model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)


class TokenCounter:
    """A streamer that counts what it is handed: the prompt first, then each generated token."""

    def __init__(self) -> None:
        self.puts = 0

    def put(self, value) -> None:
        self.puts += 1

    def end(self) -> None:
        pass


def vericache_greedy(model, inputs, new_tokens: int = NEW_TOKENS, streamer=None, **settings) -> torch.Tensor:
    """VeriCache's greedy `generate` of exactly `new_tokens`, with the matrix's settings (SnapKV at 0.5, fixed drafts
    of 4) under `settings` (any `VeriCacheConfig` field)."""
    defaults = {
        "compressor": "snapkv",
        "compression_ratio": 0.5,
        "draft_length": 4,
        "draft_schedule": "fixed",
    }
    return model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        generation_mode="vericache",
        vericache_config=vericache_hf.VeriCacheConfig(**(defaults | settings)),
        streamer=streamer,
    )


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:300]


class _Ended(Exception):
    """A run that settles the verdict: a refusal, a crash or a difference from stock."""

    def __init__(self, verdict: str, reason: str) -> None:
        super().__init__(reason)
        self.verdict, self.reason = verdict, reason


def _compare(model, inputs, stock, streamer=None, label: str = "", **settings) -> None:
    """Run VeriCache on `inputs`; raise `_Ended` unless it matches `stock`."""
    try:
        got = vericache_greedy(model, inputs, streamer=streamer, **settings)
    except ValueError as error:
        if streamer is not None and streamer.puts > 1:  # a refusal must come before the first token
            raise _Ended("crashes", f"refused after decoding began: {_first_line(error)}") from error
        raise _Ended("refused", str(error).strip().splitlines()[0]) from error
    except Exception as error:  # noqa: BLE001 - a crash is a verdict of its own
        traceback.print_exc(file=sys.stderr)
        raise _Ended("crashes", f"{label}: {_first_line(error)}") from error
    if not torch.equal(got, stock):
        raise _Ended("differs", f"{label} differs from stock generate")


def judge(family: str) -> Verdict:
    """Build the family's tiny model, run stock `generate`, then VeriCache at batch 1 and on batches of 3 until one's
    rows accept different counts in some round (the case that leaves masked slots between a row's tokens)."""
    try:
        model = tiny_model(family)
    except Exception as error:  # noqa: BLE001 - any failure to build keeps the family out, with its reason
        return Verdict(family, "out", reason=f"tiny model does not build: {_first_line(error)}")
    kinds = ", ".join(sorted({layer.kind for layer in layer_plan(model, strict=False)}))
    dtype = torch.float64
    try:
        model = model.to(dtype)
        expected = [stock_greedy(model, prompts(batch)) for batch in (1, 3)]
    except Exception:  # noqa: BLE001 - grouped matmuls and some kernels refuse float64
        dtype = torch.float32
        model = model.to(dtype)
        try:
            expected = [stock_greedy(model, prompts(batch)) for batch in (1, 3)]
        except Exception as error:  # noqa: BLE001
            return Verdict(family, "out", kinds, "", f"stock generate fails: {_first_line(error)}")
    name = str(dtype).removeprefix("torch.")
    uniform = counts_positions_from_cache(model)
    rows, rejected = "uniform" if uniform else "even", False
    try:
        streamer = TokenCounter()  # streamers take batch 1 only
        _compare(model, prompts(1), expected[0], streamer, label="batch 1")
        for seed, compressor, ratio in RAGGED_TRIES[:1] if uniform else RAGGED_TRIES:
            inputs = prompts(3, seed)
            stock = expected[1] if seed == 0 else stock_greedy(model, inputs)
            stats = vericache_hf.VeriCacheStats()
            label = f"batch 3 ({compressor} at {ratio}, prompt seed {seed})"
            _compare(
                model, inputs, stock, label=label, stats=stats, compression_ratio=ratio, compressor=compressor
            )
            rejected = rejected or stats.accepted_tokens < stats.drafted_tokens
            if stats.ragged_rounds:
                rows = "ragged"
                break
        if rows == "even" and not rejected:
            rows = "all"
    except _Ended as ended:
        return Verdict(family, ended.verdict, kinds, name, ended.reason)
    return Verdict(family, "exact", kinds, name, rows=rows)


def families() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _judge_alone(family: str) -> Verdict:
    torch.set_num_threads(1)  # tiny models: one thread each, one family per core
    return judge(family)


def judge_all(names: list[str], processes: int | None = None) -> Iterator[Verdict]:
    """Each family's verdict, in order, judged in `processes` worker processes (one per core by default): the
    tiny models run on one thread, so families judged side by side take the cores a single one cannot use."""
    processes = processes or max(1, min(len(os.sched_getaffinity(0)), 8))
    if processes == 1:
        yield from map(_judge_alone, names)
        return
    # Workers fork from a server process that imported torch, transformers and this module once: a spawned worker
    # would spend seconds importing them afresh, every 8 families. Each worker still starts with no family's
    # modules loaded, and the server has run no torch op, so no thread pool is forked.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([MODULE])
    with context.Pool(processes, maxtasksperchild=8) as pool:
        yield from pool.imap(_judge_alone, names)


def render(verdicts: list[Verdict]) -> str:
    matrix = [v for v in verdicts if v.verdict != "out"]
    counts = {
        kind: sum(v.verdict == kind for v in matrix) for kind in ("exact", "refused", "differs", "crashes")
    }
    rows = {kind: sum(v.rows == kind for v in matrix) for kind in ("ragged", "uniform", "all", "even")}
    lines = [
        "# Models",
        "",
        "Every causal-LM family of the transformers installed here, each as a tiny random model: VeriCache either",
        "matches stock `generate` token for token (greedy, at batch 1 and on left-padded batches of 3), or refuses",
        "the model with a `ValueError` before decoding. A family whose tiny model does not build or does not run",
        "stock `generate` is listed as *out*.",
        "",
        "The *rows* column says how an exact family's batch of 3 accepted drafts. *ragged*: in some round its rows",
        "accepted different counts, which leaves masked slots between a row's tokens (up to "
        f"{len(RAGGED_TRIES)} prompts, compressed",
        "harder each time, are tried for one that does). *uniform*: the model numbers positions from the cache's",
        "length, so every row keeps the fewest drafts any row kept, by design. *all*: every row accepted every draft",
        "however hard the compression, so no row was ever left with a hole (the tiny model's output does not depend",
        "on the tokens dropped). *even*: drafts were rejected, but never in different counts across rows.",
        "",
        f"Regenerate: `.venv/bin/python -m vericache_tools.families --write docs/models.md` "
        f"(transformers {transformers.__version__}, torch {torch.__version__}, Python {platform.python_version()}).",
        "",
        f"Of {len(matrix)} families in the matrix: {counts['exact']} exact ({rows['ragged']} ragged, "
        f"{rows['uniform']} uniform, {rows['all']} all, {rows['even']} even), {counts['refused']} refused, "
        f"{counts['differs']} differ, {counts['crashes']} crash; {len(verdicts) - len(matrix)} out.",
        "",
        "| family | layer kinds | dtype | verdict | rows | reason |",
        "|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        reason = v.reason.replace("|", "\\|")
        lines.append(f"| {v.family} | {v.layer_kinds} | {v.dtype} | {v.verdict} | {v.rows} | {reason} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="families to judge (all by default)")
    parser.add_argument("--write", type=Path, help="write the table to this markdown file")
    parser.add_argument("--processes", type=int, help="families judged at once (one per core by default)")
    args = parser.parse_args(argv)
    verdicts = []
    for verdict in judge_all(args.families or families(), args.processes):
        print(
            f"{verdict.family:28s} {verdict.verdict:8s} {verdict.rows:8s} {verdict.dtype:8s} {verdict.layer_kinds:40s} "
            f"{verdict.reason}"
        )
        sys.stdout.flush()
        verdicts.append(verdict)
    if args.write:
        args.write.write_text(render(verdicts))


if __name__ == "__main__":
    # run as the module the workers import, so that the pool sends them `_judge_alone` by that module's name
    importlib.import_module(MODULE).main()
