"""The decoding methods a bench compares, each behind one call: `method.generate(model, batch, new_tokens)`.

- `full`: stock greedy `generate` on the full cache, the reference every other output is compared with;
- `lossy`: greedy decoding on the compressed cache alone (`vericache_tools.lossy.compressed_only_generate`);
- `vericache`: draft on the compressed cache, verify against the full one; with `proposer="prompt_lookup"`, the
  composed method (hierarchical drafting: prompt lookup proposes, the draft tier checks, the full tier verifies);
- `prompt_lookup` and `early_exit`: transformers' own lossless speculative methods, which run in the same process
  with the same model (prompt-lookup decoding; assisted decoding with the model's first layers as its draft). HF's
  assisted decoding is batch-1 only, so both are skipped (n/a) at larger batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_hf import VeriCacheConfig, VeriCacheStats
from vericache_hf.compressors import build_compressor

from .workloads import PromptBatch

FAMILIES = ("full", "lossy", "vericache", "prompt_lookup", "early_exit")


@dataclass
class Generation:
    """What one `generate` call produced: the new tokens (B, T) and, for VeriCache, its stats."""

    new_tokens: torch.Tensor
    stats: VeriCacheStats | None = None


@dataclass(frozen=True)
class Method:
    """One decoding method with its settings. `name` is unique within a bench and used in tables and plots."""

    family: str
    compressor: str | None = None
    compression_ratio: float | None = None
    draft_length: int = 8
    draft_schedule: str | None = None  # None: VeriCacheConfig's default
    proposer: str | None = None  # VeriCache's proposer ("prompt_lookup"), None: the draft tier alone
    draft_dtype: str | None = None  # VeriCache's draft-tier float type ("bfloat16"), None: the model's own
    draft_matmul: str = "measured"  # VeriCache's draft-tier products: "measured" layouts or "stock" linear
    lookup_tokens: int = 10
    early_exit_layers: int = 8

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"Unknown method family {self.family!r}; choose from {FAMILIES}.")
        needs_compressor = self.family in ("lossy", "vericache")
        if needs_compressor and (self.compressor is None or self.compression_ratio is None):
            raise ValueError(f"A {self.family} method needs a compressor and a compression_ratio.")
        if self.proposer is not None and (self.family != "vericache" or self.proposer not in PROPOSERS):
            raise ValueError(f"Only VeriCache takes a proposer, one of {PROPOSERS}; got {self.proposer!r}.")
        if self.draft_dtype is not None and self.family != "vericache":
            raise ValueError(
                f"Only VeriCache takes a draft_dtype; got {self.draft_dtype!r} for {self.family}."
            )
        if self.draft_matmul != "measured" and self.family != "vericache":
            raise ValueError(
                f"Only VeriCache takes a draft_matmul; got {self.draft_matmul!r} for {self.family}."
            )

    @property
    def name(self) -> str:
        if self.family == "lossy":
            return f"{self.compressor}@{self.compression_ratio:g} only (lossy)"
        if self.family == "vericache":
            schedule = f" [{self.draft_schedule}]" if self.draft_schedule else ""
            proposer = " + prompt lookup" if self.proposer else ""
            dtype = f", {self.draft_dtype} drafts" if self.draft_dtype else ""
            matmul = f", {self.draft_matmul} matmuls" if self.draft_matmul != "measured" else ""
            return (
                f"VeriCache {self.compressor}@{self.compression_ratio:g}{dtype}{matmul}{proposer}{schedule}"
            )
        if self.family == "prompt_lookup":
            return f"HF prompt lookup ({self.lookup_tokens})"
        if self.family == "early_exit":
            return f"HF early-exit assist ({self.early_exit_layers} layers)"
        return "full cache"

    @property
    def lossless(self) -> bool:
        return self.family != "lossy"

    def supports(self, batch_size: int) -> bool:
        """HF assisted decoding (prompt lookup, early exit) is batch-1 only."""
        return batch_size == 1 or self.family not in ("prompt_lookup", "early_exit")

    def generate(self, model, batch: PromptBatch, max_new_tokens: int, streamer=None) -> Generation:
        """Greedy decoding of `batch`; `streamer` gets the prompt, then each new token, as `generate` gives them
        (not taken by compressed-only decoding)."""
        ids, mask = batch.input_ids, batch.attention_mask
        prompt = ids.shape[-1]
        common = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer)
        if self.family == "lossy":
            if streamer is not None:
                raise ValueError(f"{self.name} takes no streamer: it is not HF generate.")
            from ..lossy import compressed_only_generate

            out = compressed_only_generate(
                model,
                ids,
                self.compressor,
                max_new_tokens,
                attention_mask=mask,
                compression_ratio=self.compression_ratio,
            )
            return Generation(out[:, prompt:])
        if self.family == "vericache":
            stats = VeriCacheStats()
            config = VeriCacheConfig(
                compressor=self.compressor,
                compression_ratio=self.compression_ratio,
                draft_length=self.draft_length,
                proposer=self.proposer,
                proposal_length=self.lookup_tokens,
                draft_dtype=self.draft_dtype,
                draft_matmul=self.draft_matmul,
                stats=stats,
                **({"draft_schedule": self.draft_schedule} if self.draft_schedule else {}),
            )
            out = model.generate(ids, generation_mode="vericache", vericache_config=config, **common)
            return Generation(out[:, prompt:], stats)
        if self.family == "prompt_lookup":
            common["prompt_lookup_num_tokens"] = self.lookup_tokens
        elif self.family == "early_exit":
            common["assistant_early_exit"] = self.early_exit_layers
        return Generation(model.generate(ids, **common)[:, prompt:])


PEERS = ("prompt_lookup", "early_exit")
#: VeriCache's proposers in a bench; "none" is VeriCache alone.
PROPOSERS = ("prompt_lookup",)


def check_pairs(compressors: list[str], ratios: list[float]) -> None:
    """Build every compressor at every ratio before any model work, so that a pair a compressor cannot meet
    (bnb at 0.875 would need 2-bit storage) fails at once with the reasons, not after an hour of the grid."""
    failures = []
    for compressor in compressors:
        for ratio in ratios:
            try:
                build_compressor(compressor, ratio)
            except (ValueError, TypeError) as error:
                failures.append(f"  {compressor}@{ratio}: {error}")
    if failures:
        raise ValueError(
            "The bench cannot run these compressor and ratio pairs:\n" + "\n".join(failures) + "\nRun those "
            "compressors in a bench of their own with --ratios they support."
        )


def build_methods(
    compressors: list[str],
    ratios: list[float],
    peers: bool | list[str] = True,
    draft_length: int = 8,
    draft_schedules: list[str] | None = None,
    proposers: list[str] | None = None,
    lossy: bool = True,
    draft_dtypes: list[str] | None = None,
    draft_matmuls: list[str] | None = None,
) -> list[Method]:
    """Full cache first (the reference), then compressed-only (unless `lossy` is False: a run that measures only
    whether VeriCache is ever slower needs no lossy baseline) and VeriCache for each compressor and ratio (one
    VeriCache per schedule in `draft_schedules`, None: the config's default; and per entry of `proposers`, "none"
    being VeriCache alone, None: ["none"]; and per entry of `draft_dtypes`, "model" drafting with the model's own
    weights, None: ["model"]; and per entry of `draft_matmuls`, None: ["measured"]), then the HF peers (`True`:
    all of `PEERS`, or a list of their names)."""
    chosen = list(PEERS) if peers is True else list(peers or [])
    unknown = [name for name in chosen if name not in PEERS]
    if unknown:
        raise ValueError(f"Unknown peer method(s) {unknown}; choose from {PEERS}.")
    for name in draft_schedules or []:
        try:
            VeriCacheConfig(draft_schedule=name)  # the config knows its schedules
        except ValueError as error:
            raise ValueError(f"Unknown draft schedule {name!r} in draft_schedules: {error}") from None
    unknown = [name for name in proposers or [] if name != "none" and name not in PROPOSERS]
    if unknown:
        raise ValueError(f"Unknown proposer(s) {unknown}; choose from {('none', *PROPOSERS)}.")
    for name in draft_dtypes or []:
        if name != "model":
            VeriCacheConfig(draft_dtype=name)  # the config refuses a type that is not a float
    for name in draft_matmuls or []:
        VeriCacheConfig(draft_matmul=name)  # the config refuses an unknown one with the choices
    check_pairs(compressors, ratios)
    methods = [Method("full")]
    for compressor in compressors:
        for ratio in ratios:
            if lossy:
                methods.append(Method("lossy", compressor, ratio))
            for schedule in draft_schedules or [None]:
                for dtype in draft_dtypes or ["model"]:
                    for matmul in draft_matmuls or ["measured"]:
                        for proposer in proposers or ["none"]:
                            methods.append(
                                Method(
                                    "vericache",
                                    compressor,
                                    ratio,
                                    draft_length,
                                    schedule,
                                    None if proposer == "none" else proposer,
                                    None if dtype == "model" else dtype,
                                    matmul,
                                )
                            )
    return methods + [Method(name) for name in chosen]
