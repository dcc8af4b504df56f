"""Each attention layer's queries in one pass, for compressors that score tokens with them (SnapKV, H2O).

A pass hands a `QueryCapture` to the model as `vericache_capture=`; the wrapped attention (`attention.py`) gives it
each layer's queries as attention receives them, after the model's projections, norms and rotary embedding, so a
compressor scores with exactly the queries the model attends with, whatever the family computes them like. A
compressor that calls code of its own on the layer (a kvpress press) also gets the layer's input, which the pass
model's attention layers hand over from a forward pre-hook of the copy (never the user's model).

Nothing here is shared between calls: the capture is per pass, and another thread's forward carries none.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache

import torch
from torch import nn

from ..attention import ACTIVE_CAPTURE, CAPTURE_KWARG
from .compressor import CompressionContext


class QueryCapture:
    """Collects one `CompressionContext` per layer of a pass: its last `last` queries (all when None) and, with
    `inputs`, the layer's input and attention kwargs. `on_layer` gets each as it is read (a prefill compresses the
    layer there); without it they are kept in `contexts`. `valid` is the prompt's (B, T) validity."""

    def __init__(
        self,
        valid: torch.Tensor,
        model: nn.Module | None = None,
        last: int | None = None,
        inputs: bool = False,
        on_layer: Callable[[CompressionContext], None] | None = None,
    ) -> None:
        self.valid, self.model, self.last, self.inputs, self.on_layer = valid, model, last, inputs, on_layer
        self.contexts: dict[int, CompressionContext] = {}
        self._inputs: dict[int, tuple[torch.Tensor, dict]] = {}
        self._read: set[int] = set()  # layers whose queries reached `read` in this pass

    def read(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        """A layer's (B, H_q, q, D) queries and the keys they attend to, from the wrapped attention. The keys are
        kept only where the cache holds something else: latent attention (`kv_lora_rank`) caches latents and
        expands them into keys per pass, so its queries score those keys, not the cache."""
        self._read.add(id(module))
        hidden, kwargs = self._inputs.pop(id(module), (None, {}))
        if self.inputs and hidden is None:
            raise ValueError(
                f"{type(module).__name__} did not pass its input through the pass model's hook; this compressor "
                "reads layer inputs, which this model's attention layers do not expose. Use snapkv, h2o or a "
                "query-free compressor."
            )
        context = CompressionContext(
            layer_idx=module.layer_idx,
            valid=self.valid,
            model=self.model,
            module=module,
            queries=query,
            attention_keys=key if getattr(module, "kv_lora_rank", None) else None,
            scaling=float(scaling if scaling is not None else query.shape[-1] ** -0.5),
            hidden_states=hidden,
            attention_kwargs=kwargs,
        )
        if self.last is not None and self.last < query.shape[2]:
            context = context.at_positions(slice(-self.last, None))
        self._hand_over(context)

    def read_probabilities(self, module: nn.Module, probabilities: torch.Tensor) -> None:
        """A layer's (B, H_q, q, T) attention probabilities, as a layer that attends inline returns them: kept as the
        attention each key received from the real queries the capture reads, for a layer whose queries never
        reached `read`."""
        if id(module) in self._read or not self.reads_probabilities:
            return
        rows = probabilities.shape[2] if self.last is None else min(self.last, probabilities.shape[2])
        real = self.valid[:, -rows:].to(probabilities.device, probabilities.dtype)
        received = torch.einsum("bhqt,bq->bht", probabilities[:, :, -rows:].float(), real.float())
        self._hand_over(
            CompressionContext(module.layer_idx, self.valid, self.model, module, attention_received=received)
        )

    def _hand_over(self, context: CompressionContext) -> None:
        if self.on_layer is not None:
            self.on_layer(context)
        else:
            self.contexts[context.layer_idx] = context

    @property
    def reads_probabilities(self) -> bool:
        """Whether a layer that attends inline is to hand over its attention probabilities (query-scoring
        compressors that do not run code of their own on the layer)."""
        return not self.inputs

    def record_input(self, module: nn.Module, hidden_states: torch.Tensor, kwargs: dict) -> None:
        """A layer's input and attention kwargs, from the pass model's pre-hook (only kept when `inputs`)."""
        if self.inputs:
            kept = {k: v for k, v in kwargs.items() if k not in (CAPTURE_KWARG, "hidden_states")}
            self._inputs[id(module)] = hidden_states, kept

    def pop(self, layer_idx: int) -> CompressionContext | None:
        return self.contexts.pop(layer_idx, None)


@cache
def _probabilities_argument(module_type: type) -> int | None:
    """The position of `output_attentions` among an attention layer's forward arguments (after `self`), where it
    takes one itself: a layer that attends inline returns its probabilities when asked (layers that call
    transformers' attention interface take `**kwargs` instead)."""
    names = list(inspect.signature(module_type.forward).parameters)
    return names.index("output_attentions") - 1 if "output_attentions" in names else None


def _asking_for_probabilities(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    position = _probabilities_argument(type(module))
    if position is None:
        return None
    if position < len(args):
        return (*args[:position], True, *args[position + 1 :]), kwargs
    return args, {**kwargs, "output_attentions": True}


def record_probabilities(module: nn.Module, args: tuple, kwargs: dict, output):
    """Forward hook of the pass model's attention layers: hands the attention probabilities a layer that attends
    inline returns (its second output, (B, H, q, T)) to a pass's capture, and returns the output without them
    (no VeriCache pass reads attentions, and the layer above would carry them on)."""
    capture = kwargs.get(CAPTURE_KWARG) or ACTIVE_CAPTURE.get()
    if capture is None or not isinstance(output, tuple) or len(output) < 2:
        return None
    probabilities = output[1]
    hidden = output[0]
    if (
        isinstance(probabilities, torch.Tensor)
        and probabilities.dim() == 4
        and isinstance(hidden, torch.Tensor)
        and probabilities.shape[0] == hidden.shape[0]
        and probabilities.shape[2] == hidden.shape[1]
    ):
        capture.read_probabilities(module, probabilities)
        return (hidden, None, *output[2:])
    return None


def record_layer_input(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of the pass model's attention layers: hands the layer's input to a pass's capture, and asks
    a layer that returns its attention probabilities only on request for them (`record_probabilities`)."""
    capture = kwargs.get(CAPTURE_KWARG) or ACTIVE_CAPTURE.get()
    if capture is None:
        return None
    capture.record_input(module, args[0] if args else kwargs["hidden_states"], kwargs)
    return _asking_for_probabilities(module, args, kwargs) if capture.reads_probabilities else None
