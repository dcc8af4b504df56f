"""`VeriCacheProposer`: a vLLM speculative proposer (`method="custom_class"`) that drafts with the served model's
own weights on a compressed KV cache. vLLM verifies every draft against its own full KV cache in its next step,
so the output is vLLM's own: greedy output is token for token that of vLLM without speculation, and sampled
output keeps its distribution (vLLM's rejection sampler, for drafts given without probabilities).

vLLM imports the class by its path and builds it with its `VllmConfig` alone, so the VeriCache settings travel in
the class name: `speculative_config(config)` names a subclass whose name carries them (URL-safe base64 of JSON),
and this module's `__getattr__` makes that subclass in whichever process imports it, the engine's included.

Where the weights come from: vLLM's CPU build repacks every linear layer's weight for its own GEMM kernels and
drops the original tensor, so the served module has no weights a transformers forward could share. The proposer
loads a transformers copy of the model from the same folder instead, in the served dtype: one more copy of the
weights in memory, per worker.

Where the draft tier comes from: when a request first reaches a decode step, its prompt's exact K/V are read from
vLLM's own paged cache (`runner_kv.py`) and compressed; only the prompt's last tokens, whose queries a compressor
such as SnapKV scores with, are computed again on the copy. Where vLLM's cache cannot be read, the copy prefills
the whole prompt once more: that prefill is then the cost a request pays before its first draft.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import asdict
from typing import Any, ClassVar

from ..compressors import build_compressor
from ..config import VeriCacheConfig
from .book import DraftBook, Pacing
from .draft import DraftState
from .runner_kv import RunnerKV

logger = logging.getLogger(__name__)

CLASS_PREFIX = "VeriCacheProposer_"
#: VeriCacheConfig fields a vLLM proposer honours; the others describe `generate`'s own loop and must stay at their
#: defaults (refused otherwise, rather than ignored).
SETTINGS = (
    "compressor",
    "compression_ratio",
    "compression_budget",
    "compressor_kwargs",
    "draft_length",
    "draft_schedule",
    "min_draft_length",
    "max_draft_length",
    "draft_dtype",
    "draft_matmul",
)


def speculative_config(
    config: VeriCacheConfig | None = None, num_speculative_tokens: int | None = None
) -> dict[str, Any]:
    """vLLM's `speculative_config` for drafting with VeriCache: `LLM(model, speculative_config=...)`.

    `num_speculative_tokens` is the most tokens a row drafts per step (vLLM reserves that many slots per request):
    `config.draft_length` under the fixed schedule, else `config.max_draft_length`, unless given.
    """
    config = config or VeriCacheConfig()
    if not isinstance(config, VeriCacheConfig):
        raise TypeError(f"config must be a vericache_hf.VeriCacheConfig, got {type(config).__name__}.")
    settings = _settings(config)
    if num_speculative_tokens is None:
        fixed = config.draft_schedule == "fixed"
        num_speculative_tokens = config.draft_length if fixed else config.max_draft_length
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be a positive int, got {num_speculative_tokens!r}.")
    encoded = base64.urlsafe_b64encode(json.dumps(settings, sort_keys=True).encode()).decode().rstrip("=")
    return {
        "method": "custom_class",
        "model": f"{__name__}.{CLASS_PREFIX}{encoded}",
        "num_speculative_tokens": num_speculative_tokens,
    }


def _settings(config: VeriCacheConfig) -> dict[str, Any]:
    """The config's proposer settings as JSON-ready values; anything else set on it is refused."""
    default = VeriCacheConfig()
    for name, value in asdict(config).items():
        if name not in SETTINGS and name not in ("stats", "timeline") and value != getattr(default, name):
            raise ValueError(
                f"VeriCacheConfig.{name} has no effect in vLLM's proposer (vLLM runs the verify pass and its own "
                f"KV cache); leave it at its default. The proposer reads {', '.join(SETTINGS)}."
            )
    settings = {name: getattr(config, name) for name in SETTINGS}
    try:
        json.dumps(settings)
    except TypeError as error:
        raise ValueError(
            "vLLM builds the proposer in its engine process from names alone, so the compressor must be given by "
            f"name (or a list of names) with JSON-ready compressor_kwargs: {error}."
        ) from None
    return settings


class VeriCacheProposer:
    """A vLLM `custom_class` proposer: each row drafts greedily on its request's compressed KV cache.

    Built by vLLM with its `VllmConfig`; `load_model` (called by vLLM's runner with the served module) loads the
    drafting copy; `propose` returns each row's drafts, empty for a row that does not draft this step.
    """

    settings: ClassVar[dict[str, Any]] = {}

    def __init__(self, vllm_config: Any) -> None:
        self.config = VeriCacheConfig(**self.settings)
        self.max_tokens = vllm_config.speculative_config.num_speculative_tokens
        model_config = vllm_config.model_config
        self.model_path, self.dtype = model_config.model, model_config.dtype
        self.max_model_len = model_config.max_model_len
        self.device = str(getattr(getattr(vllm_config, "device_config", None), "device", None) or "cpu")
        self.book: DraftBook | None = None
        self.runner_kv: RunnerKV | None = None
        self.prefilled_tokens = 0  # tokens the drafting copy computed to build draft tiers

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Load the transformers copy that drafts; vLLM's runner calls this with its own module, unused here."""
        import torch
        from transformers import AutoModelForCausalLM

        from ..drafting.draft_model import draft_model

        dtype = self.dtype if isinstance(self.dtype, torch.dtype) else getattr(torch, str(self.dtype))
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype, attn_implementation="sdpa")
        model.to(self.device).eval()
        config = self.config
        compressor = build_compressor(
            config.compressor, config.compression_ratio, config.compression_budget, **config.compressor_kwargs
        )
        drafter = draft_model(model, config.draft_dtype, config.draft_matmul)
        self.runner_kv = RunnerKV.find(model.config.get_text_config(), dtype) if args else None
        read = compressor.queries_read

        def build(tokens: list[int], row: int) -> DraftState:
            leading = None
            if self.runner_kv is not None and read is not None and len(tokens) > max(read, 1):
                # vLLM's K/V for all but the last tokens, whose queries the compressor scores with
                leading = self.runner_kv.leading(row, len(tokens) - max(read, 1))
            self.prefilled_tokens += len(tokens) - (0 if leading is None else leading[0][0].shape[2])
            return DraftState.build(model, compressor, tokens, leading=leading, drafter=drafter)

        self.book = DraftBook(build, self.pacing())

    def pacing(self) -> Pacing:
        config, most = self.config, self.max_tokens
        first = min(config.draft_length, most)
        if config.draft_schedule == "fixed":
            return Pacing(max_length=first, first_length=first, min_length=first)
        return Pacing(max_length=most, first_length=first, min_length=min(config.min_draft_length, first))

    def propose(
        self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any, **kwargs: Any
    ) -> list[list[int]]:
        """Each row's drafts. A row drafts only after its prefill is done (it sampled a token this step) and while
        its drafts fit in the model's length."""
        if self.book is None:
            self.load_model()
        rows: list[list[int] | None] = []
        for row, sampled in enumerate(sampled_token_ids):
            count = int(num_tokens_no_spec[row])
            rows.append(
                token_ids_cpu[row, :count].tolist() if sampled and count < self.max_model_len else None
            )
        drafts = self.book.propose(rows)
        room = [self.max_model_len - len(tokens) - 1 if tokens else 0 for tokens in rows]
        return [draft[: max(0, fit)] for draft, fit in zip(drafts, room, strict=True)]


def __getattr__(name: str) -> type[VeriCacheProposer]:
    """`VeriCacheProposer_<settings>`: the proposer class configured by the settings its name encodes."""
    if not name.startswith(CLASS_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    encoded = name.removeprefix(CLASS_PREFIX)
    settings = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    return type(name, (VeriCacheProposer,), {"settings": settings, "__module__": __name__})
