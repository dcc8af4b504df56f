"""A row's exact K/V read from vLLM's own paged KV cache, so that a draft tier is built without a second prefill.

vLLM hands a `custom_class` proposer neither its KV cache nor its block tables: `propose` gets the rows' tokens,
and `load_model` gets the served module. vLLM's runner calls `load_model` itself, so the runner is the caller's
`self`; `RunnerKV.find` takes it from there and reads `input_batch.block_table` and `kv_caches`, the tensors vLLM's
CPU attention reads. That reaches into vLLM's internals: every shape is checked against the model's config on each
read, and anything unexpected (another layout, a quantized KV cache, several KV cache groups) turns it off, after
which the proposer prefills prompts on its own copy, as it does when no runner is found.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

logger = logging.getLogger(__name__)


#: CPU attention kernels (`layer.isa`) whose K/V layout is known here. Per layer, vLLM's cache is (blocks, H_kv,
#: block, 2 * D), each block-and-head holding its keys then its values; the "vec" kernel keeps a block's keys
#: transposed, (D, block), and its values as they are, (block, D). Other kernels pack keys otherwise.
KNOWN_KERNELS = ("vec",)


class RunnerKV:
    """Reads rows' K/V from a vLLM model runner's paged CPU KV cache."""

    def __init__(
        self, runner: Any, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        self.runner, self.num_layers, self.kv_heads, self.head_dim, self.dtype = (
            runner,
            num_layers,
            kv_heads,
            head_dim,
            dtype,
        )
        self.usable = True

    @classmethod
    def find(cls, config: Any, dtype: torch.dtype, depth: int = 6) -> RunnerKV | None:
        """The runner that called the proposer's `load_model` (the nearest caller, at most `depth` frames up, whose
        `self` has vLLM's input batch and KV caches), if any."""
        frame, runner = sys._getframe(1), None
        for _ in range(depth):
            frame = frame.f_back
            if frame is None:
                break
            candidate = frame.f_locals.get("self")
            if hasattr(candidate, "input_batch") and hasattr(candidate, "kv_caches"):
                runner = candidate
                break
        if runner is None:
            logger.warning(
                "vLLM's model runner was not found; prompts are prefilled again to build draft tiers."
            )
            return None
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(runner, config.num_hidden_layers, kv_heads, head_dim, dtype)

    def leading(self, row: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer, the (1, H_kv, count, D) keys and values of row `row`'s first `count` tokens; None when vLLM's
        cache does not have the expected shape."""
        if not self.usable or count <= 0:
            return None
        try:
            caches, table = self.runner.kv_caches, self.runner.input_batch.block_table
            groups = len(getattr(table, "block_tables", [table]))
            block_size = table[0].block_size
            blocks = table[0].get_numpy_array()[row, : -(-count // block_size)]
            kernel = next((m.isa for m in self.runner.model.modules() if hasattr(m, "isa")), None)
            problem = self._problem(caches, groups, block_size)
            if kernel not in KNOWN_KERNELS:
                problem = (
                    problem
                    or f"CPU attention kernel {kernel!r}, whose key layout is not one of {KNOWN_KERNELS}"
                )
        except (AttributeError, IndexError, TypeError) as error:
            problem = f"{type(error).__name__}: {error}"
        if problem:
            logger.warning("vLLM's KV cache is not read (%s); prompts are prefilled again instead.", problem)
            self.usable = False
            return None
        index = torch.from_numpy(blocks.astype("int64"))
        layers = []
        heads, dim = self.kv_heads, self.head_dim
        for cache in caches:
            pages = cache.view(cache.shape[0], heads, 2, block_size * dim)[index]  # (blocks, H, 2, block * D)
            keys = (
                pages[:, :, 0].view(-1, heads, dim, block_size).permute(1, 0, 3, 2)
            )  # (H, blocks, block, D)
            values = pages[:, :, 1].view(-1, heads, block_size, dim).transpose(0, 1)
            keys = keys.reshape(heads, -1, dim)[None, :, :count].contiguous()
            values = values.reshape(heads, -1, dim)[None, :, :count].contiguous()
            layers.append((keys, values))
        return layers

    def _problem(self, caches: list[torch.Tensor], groups: int, block_size: int) -> str | None:
        expected = (self.kv_heads, block_size, 2 * self.head_dim)
        if groups != 1:
            return f"{groups} KV cache groups"
        if len(caches) != self.num_layers:
            return f"{len(caches)} cache tensors for {self.num_layers} layers"
        for cache in caches:
            if cache.dim() != 4 or tuple(cache.shape[1:]) != expected:
                return f"a layer's cache is shaped {tuple(cache.shape)}, expected (blocks, *{expected})"
            if cache.dtype != self.dtype:
                return f"the KV cache holds {cache.dtype}, the drafting model {self.dtype}"
        return None
