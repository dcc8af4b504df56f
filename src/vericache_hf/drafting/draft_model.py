"""The module that runs draft-tier passes: the model's weights in a narrower float type (`VeriCacheConfig.draft_dtype`),
and on the CPU, linear layers in the layout measured fastest for a draft's few rows (`draft_matmul`, see
`draft_matmul.py`).

A draft step on a compressed KV cache still reads every weight, so on a machine where decoding is bound by
memory bandwidth, weights are most of its cost (on a 2-core CPU a batch-4 SmolLM2 step without context takes
80 ms in float32 and 39 ms in bfloat16). Drafting with a bfloat16 copy of the same weights halves that read; the
full tier's verify pass keeps the model's own weights and precision, so what is emitted does not change.

The copy is made once per model, dtype, device and matmul choice, and shared by every call (under a lock); the model
is never modified. It is made from the pass model (`pass_model.py`), so drafts run the same wrapped attention as
every other pass. A copy in the model's own type shares its weight tensors, costing no memory.
Its buffers (the rotary frequencies) stay in the model's precision: a bfloat16 frequency is off by up to 0.4%,
which at position 8000 turns the fastest rotation by tens of radians.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

from ..pass_model import pass_model, set_attention, shared_copy
from .draft_matmul import measurable, measure_layouts

_COPIES: weakref.WeakKeyDictionary[nn.Module, dict[tuple, nn.Module]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """`draft_dtype` as a torch float dtype (None stays None); anything else is refused with the choices."""
    if name is None:
        return None
    dtype = getattr(torch, name, None) if isinstance(name, str) else name
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(
            "draft_dtype must be None or a float type for the draft tier's weights: 'bfloat16', 'float16', "
            f"'float32' or 'float64' (or the torch dtype), got {name!r}."
        )
    return dtype


def check_narrowable(model: nn.Module, dtype: torch.dtype) -> None:
    """Refuse a model whose draft copy could not be an ordinary cast of its weights."""
    devices = _devices(model)
    if len(devices) > 1:
        raise ValueError(
            f"draft_dtype={str(dtype).removeprefix('torch.')!r} needs the model on one device, but it is split "
            f"across {sorted(map(str, devices))}; load it on one device or leave draft_dtype=None."
        )
    odd = {str(p.dtype) for p in model.parameters() if not p.dtype.is_floating_point}
    if odd:
        raise ValueError(
            f"draft_dtype needs float weights to cast, but the model holds {sorted(odd)} (a quantized model); "
            "leave draft_dtype=None."
        )


DRAFT_MATMULS = ("measured", "stock")


def draft_model(
    model: nn.Module, name: str | torch.dtype | None, matmul: str = "measured"
) -> nn.Module | None:
    """The module that runs draft-tier passes: None (the pass model itself) when nothing would differ, else the
    shared copy of `model`'s pass model, on its device (a model moved since gets a new copy), with its parameters in `name`'s type
    (`draft_dtype`; the model's own tensors when None or the model's type) and, for `matmul="measured"` on the
    CPU, measured layouts for its linear layers. Weights changed in place after a narrowed copy was made leave it
    stale: drafts then agree less often, and the output, verified by the model itself, stays the same."""
    check_draft_matmul(matmul)
    dtype = resolve_dtype(name)
    narrow = dtype is not None and dtype != model.dtype
    measured = matmul == "measured" and len(_devices(model)) <= 1
    if not narrow and not measured:
        return None
    source = pass_model(model)  # drafts run the passes' attention too
    key = (dtype if narrow else None, str(model.device), measured, id(source))
    with _LOCK:
        copies = _COPIES.setdefault(model, {})
        # built once: the per-call path is this lookup (None kept for a model not measurable)
        if key not in copies:
            if narrow:
                check_narrowable(model, dtype)
            # copies on a device the model left, or of a pass model made again since
            for stale in [k for k in copies if k[1:2] + k[3:] != key[1:2] + key[3:]]:
                del copies[stale]
            drafter = (
                _narrowed(source, dtype) if narrow else shared_copy(source) if measurable(source) else None
            )
            if drafter is not None and measured and measurable(drafter):
                measure_layouts(drafter)
            copies[key] = drafter
        return copies[key]


def check_draft_matmul(matmul: str) -> None:
    """Refuse a `draft_matmul` that is not one of `DRAFT_MATMULS`, naming them."""
    if matmul not in DRAFT_MATMULS:
        raise ValueError(f"draft_matmul must be one of {DRAFT_MATMULS}, got {matmul!r}.")


def _devices(model: nn.Module) -> set:
    """The devices of a model split by `device_map` (empty for a model loaded whole)."""
    return set(getattr(model, "hf_device_map", {}).values())


def _narrowed(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    # deepcopy's memo hands it the cast parameters, so the full-precision weights are never copied (tied weights
    # stay tied: one memo entry per parameter object)
    # the buffers (rotary frequencies) stay the model's own tensors, in its precision
    memo = {id(p): nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in model.parameters()}
    narrowed = shared_copy(model, memo)
    if narrowed.device.type == "cpu" and dtype.itemsize == 2:
        # sdpa's CPU kernel runs a one-token half-precision query 5-7x slower than a float32 one (2.6 against 0.4
        # ms a layer, 1k tokens, batch 4), which ate the weights' saving: a bfloat16 draft step took 0.19 s against
        # float32's 0.15 in the bench. Eager attention's matmuls take 0.6 ms. The copy's config is its own.
        set_attention(narrowed, "eager")
    return narrowed
