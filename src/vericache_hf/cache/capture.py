"""Each attention layer's input during a prefill pass, for compressors that score tokens with queries (SnapKV).

The hooks live only inside the `with` block, and they record a forward only when the cache it was given is this
capture's own: another thread's forward on the same model (a plain `generate`, another VeriCache call) passes
through them untouched. Nothing else about the model changes.
"""

from __future__ import annotations

from torch import nn

from ..compat import passed_cache
from .compressor import CompressionContext


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder's self-attention modules: those with a `q_proj` and a `layer_idx`."""
    return [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]


class LayerInputCapture:
    """Context manager: while it is open, each attention layer's input in a forward that passes `cache` is kept as
    a `CompressionContext` until `pop(layer_idx)` takes it. `valid` is the prompt's (B, T) validity."""

    def __init__(self, model: nn.Module, cache, valid) -> None:
        self.model, self.cache, self.valid = model, cache, valid
        self.contexts: dict[int, CompressionContext] = {}
        self.handles: list = []

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if passed_cache(kwargs) is not self.cache:
            return  # another call's forward
        self.contexts[module.layer_idx] = CompressionContext(
            layer_idx=module.layer_idx,
            valid=self.valid,
            model=self.model,
            module=module,
            hidden_states=args[0] if args else kwargs["hidden_states"],
            attention_kwargs=kwargs,
        )

    def pop(self, layer_idx: int) -> CompressionContext | None:
        return self.contexts.pop(layer_idx, None)

    def __enter__(self) -> LayerInputCapture:
        modules = attention_modules(self.model)
        if len(modules) != self.model.config.num_hidden_layers:
            raise ValueError(
                "This compressor scores tokens with the layer's queries, but the model's attention modules "
                "(with q_proj and layer_idx) were not all found. Use a query-free compressor such as 'kivi' "
                "or 'streaming_llm'."
            )
        self.handles = [m.register_forward_pre_hook(self._record, with_kwargs=True) for m in modules]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.contexts.clear()  # hidden states are large: keep none past the prefill
