"""What one batch row of each decoder layer's cache weighs, read from the model's own modules (no forward pass, so a
model built on the meta device answers too).

- An attention layer: the bytes of one token's keys and values, from its key and value projections and its
  `head_dim`, so a config whose layers differ (Gemma 4's `global_head_dim` and `num_global_key_value_heads` for
  its full-attention layers) counts each layer at its own size. Multi-head latent attention caches one latent
  (`kv_lora_rank`) and one rotary key (`qk_rope_head_dim`) per token; a layer without key and value projections
  otherwise falls back to the config's `num_key_value_heads` and `head_dim`.
- A recurrent layer: its convolution state (each `Conv1d`'s channels times its kernel, as transformers'
  linear-attention cache layer keeps it) and its recurrent state, whose shape is known for the gated delta rule
  (`num_v_heads x head_k_dim x head_v_dim`: Qwen3-Next, Qwen3.5, OLMo-Hybrid), Mamba-2
  (`num_heads x head_dim x ssm_state_size`), Mamba (`intermediate_size x ssm_state_size`) and Kimi's delta rule
  (`num_heads x head_dim x head_dim`). Another kind of recurrent state counts 0 bytes here, its convolution state
  alone. The recurrent state is counted in float32, the dtype transformers keeps it in whatever the model's.
- A layer without attention or state (`mlp`, `moe`): nothing.
Layers that share another layer's K/V (`num_kv_shared_layers`) are counted as holding their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..layer_plan import layer_plan, recurrent_states, text_config
from ..pass_model import attention_layers

__all__ = ["LayerBytes", "layer_bytes"]


@dataclass(frozen=True)
class LayerBytes:
    """One decoder layer's cache for one batch row: `token`, the bytes of one token's keys and values (attention
    layers); `conv` and `recurrent`, the bytes of its states and `conv_column` of one token of convolution input
    (recurrent layers)."""

    index: int
    kind: str
    window: int | None = None
    token: int = 0
    conv: int = 0
    conv_column: int = 0
    recurrent: int = 0

    @property
    def state(self) -> int:
        return self.conv + self.recurrent


def _token_bytes(module: nn.Module | None, config, index: int, itemsize: int) -> int:
    latent = getattr(config, "kv_lora_rank", None)
    if isinstance(latent, int):  # multi-head latent attention caches one latent and one rotary key per token
        return (latent + config.qk_rope_head_dim) * itemsize
    keys, values = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
    dim = getattr(module, "head_dim", None)
    if isinstance(keys, nn.Linear) and isinstance(dim, int) and keys.out_features % dim == 0:
        heads = keys.out_features // dim
        return (
            heads
            * (dim + (values.out_features // heads if isinstance(values, nn.Linear) else dim))
            * itemsize
        )
    per_layer = getattr(config, "per_layer_config", None)  # a config whose layers differ in shape
    config = per_layer[index] if per_layer else config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * heads * dim * itemsize


def _recurrent_elements(module: nn.Module) -> int:
    """Elements of a recurrent state of a known shape, else 0."""
    get = lambda *names: [getattr(module, name, None) for name in names]  # noqa: E731
    for names in (("num_v_heads", "head_k_dim", "head_v_dim"), ("num_heads", "head_dim", "ssm_state_size")):
        sizes = get(*names)
        if all(isinstance(size, int) for size in sizes):
            return sizes[0] * sizes[1] * sizes[2]
    inner, state = get("intermediate_size", "ssm_state_size")
    if isinstance(inner, int) and isinstance(state, int):
        return inner * state
    heads, dim = get("num_heads", "head_dim")  # a delta rule over square heads (Kimi Delta Attention)
    return heads * dim * dim if isinstance(heads, int) and isinstance(dim, int) else 0


def _state_bytes(owners: list[nn.Module], itemsize: int) -> tuple[int, int, int]:
    """A recurrent layer's (conv, conv_column, recurrent) bytes, from the modules that name it as their layer."""
    convs = {id(c): c for owner in owners for c in owner.modules() if isinstance(c, nn.Conv1d)}.values()
    columns = sum(c.in_channels for c in convs)
    conv = sum(c.in_channels * c.kernel_size[0] for c in convs)
    recurrent = max((_recurrent_elements(m) for owner in owners for m in owner.modules()), default=0)
    return conv * itemsize, columns * itemsize, recurrent * 4  # recurrent states stay float32


def layer_bytes(model: nn.Module) -> list[LayerBytes]:
    """Each decoder layer's cache for one batch row, in the model's dtype."""
    config, itemsize = text_config(model), model.dtype.itemsize
    attention = {module.layer_idx: module for module in attention_layers(model)}
    recurrent = recurrent_states(model)
    owners: dict[int, list[nn.Module]] = {index: [] for index in recurrent}
    for module in model.modules() if recurrent else ():
        if getattr(module, "layer_idx", None) in owners:
            owners[module.layer_idx].append(module)
    layers = []
    for plan in layer_plan(model, strict=False):
        if plan.attends:
            token = _token_bytes(attention.get(plan.index), config, plan.index, itemsize)
            layers.append(LayerBytes(plan.index, plan.kind, plan.window, token=token))
        elif plan.index in recurrent:
            conv, column, state = _state_bytes(owners[plan.index], itemsize)
            layers.append(LayerBytes(plan.index, plan.kind, conv=conv, conv_column=column, recurrent=state))
        else:
            layers.append(LayerBytes(plan.index, plan.kind))
    return layers
