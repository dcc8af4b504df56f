"""`VeriCacheConfig`: every knob of VeriCache decoding in one checked dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .checks import check_budget, check_int, check_ratio, check_seconds
from .drafting.draft_model import check_draft_matmul, resolve_dtype
from .verify_attention import check_kernel

DRAFT_SCHEDULES = ("auto", "cost_aware", "adaptive", "fixed")


@dataclass
class VeriCacheConfig:
    """How VeriCache drafts and verifies.

    Parameters:
        compressor: the lossy method that builds the draft tier. A name (`"streaming_llm"`, `"snapkv"`, `"kivi"`,
            see `vericache_hf.compressors.available_compressors()`), a `Compressor` instance, a kvpress press, or a
            list of these applied in order (token dropping first, e.g. `["snapkv", "kivi"]`). A dict gives one by
            name and settings, as a saved config writes it: `{"compressor": "kivi", "bits": 2}` for a compressor of
            the library, `{"kvpress": "SnapKVPress", "compression_ratio": 0.5}` for a kvpress press.
        compression_ratio: the fraction of the KV cache removed, as in kvpress (0.75 keeps a quarter of the
            tokens; a quantizer maps it to a bit width relative to 16-bit storage: 0.75 is 4-bit).
        compression_budget: tokens kept per layer by a token-dropping compressor given by name (or a press),
            instead of the ratio. None uses the ratio.
        compressor_kwargs: extra arguments for a compressor given by name (e.g. `{"bits": 2}` for `"kivi"`).
        draft_length: tokens drafted in the first round; with the fixed schedule, in every round. cost_aware
            drafts at most 4 in its first drafted round, as its probes do: it drafts to price drafting, and a call
            where drafting does not pay should lose little finding out.
        draft_schedule: how the draft length changes from round to round (never the output, only the speed).
            `"cost_aware"` times draft steps and verify passes as it goes and drafts the length with the most
            expected tokens per second, which is 0 (a plain full-cache step) when drafting does not pay, as on a
            CPU at short context with early rejections. `"adaptive"` doubles the draft while rounds are fully
            accepted and shortens it after early rejections. `"fixed"` keeps `draft_length`. `"auto"` is
            cost_aware under greedy decoding and adaptive under sampling, where a length that follows the clock
            would make a seeded run unrepeatable.
        min_draft_length / max_draft_length: bounds of the changing schedules (cost_aware may also choose 0).
        chunk_tokens: the granule, in tokens, by which each layer's host full tier grows (it doubles, in whole
            granules).
        staging_buffers: pieces of the full tier that may be on an accelerator at once (2: one copies while one is
            read), each a layer or a chunk of one (`staging_chunk_tokens`).
        staging_chunk_tokens: the most tokens a staging buffer holds. A layer whose full tier and verified block
            fit is staged whole and attended as one tensor (its buffer a quarter longer, up to this size); a longer
            one streams through buffers of this fixed size chunk by chunk, and the verify pass's attention merges the chunks by their log-sum-exp (flash attention's
            online softmax), so device memory for the full tier is `staging_buffers` chunks whatever the context.
            None stages whole layers: `staging_buffers` layers of a quarter more than the context, which grows with
            it (at 8B Llama shapes, 128k tokens and batch 8, two such buffers hold about 10 GiB; two chunks of 3072
            tokens, 192 MiB). Admission (`VeriCacheEngine`'s device_memory_budget) counts whichever is set.
        verify_attention: the verify pass's attention kernel (`vericache_hf.verify_attention`): `"auto"` (the
            fastest measured on the device: the model's own sdpa, grouped-query on a CPU), `"sdpa"`,
            `"lower_right"` (sdpa with a lower-right causal bias, no materialized mask), `"flex"` (FlexAttention
            with a block mask) or `"flash"` (flash-attn's KV-cache kernel, where installed). Each is exact; one that
            cannot serve a pass (a row with masked slots, a family's softcapping) leaves it to the model's own.
        transfer_timeout: seconds any wait on a full-tier transfer may take before it raises.
        stage_on_cpu: when a layer's device is the CPU, its full tier is already in that memory, so the verify pass
            reads it in place (no copy, no transfer thread). True copies it through the staging buffers and the
            transfer thread anyway, as on an accelerator: the same results, slower; it runs the accelerator's
            transfer path on a CPU-only machine.
        refresh: a `vericache_hf.cache.refresh.RefreshPolicy` that rebuilds the draft tier from the full tier every
            N committed tokens or when acceptance drops (K/V-only compressors), or its settings as a dict. Each call
            counts towards it on its own. None never refreshes.
        proposer: hierarchical drafting's proposer: `"prompt_lookup"` (n-grams of the prefix, no second model; a match
            of two tokens or more, up to `max_matching_ngram_size`, 3 if unset, proposes) or an assistant model that
            shares the tokenizer. The draft tier checks its proposals many tokens per pass and the full tier verifies
            as always, so the output is unchanged. `generate`'s own `prompt_lookup_num_tokens` and `assistant_model`
            kwargs do the same. None drafts with the draft tier alone.
        proposal_length: most tokens one proposal offers (`prompt_lookup_num_tokens` overrides it). How many the draft
            tier checks is chosen as it goes, from the measured pass time and how many it keeps, 0 when they do not
            pay (always `proposal_length` under the fixed draft schedule).
        draft_dtype: the float type of the draft tier's weights and K/V (`"bfloat16"`, `"float16"`, or the torch
            dtype). Draft steps then run on a copy of the model's weights cast to it, made once per model and shared
            by every call: where decoding is bound by memory bandwidth they read half the bytes of a float32 step.
            The verify pass keeps the model's own weights and precision, so the output is unchanged; only how many
            drafts agree with it can. None drafts with the model itself.
        draft_matmul: how draft-tier passes multiply their few rows by the weights on the CPU. `"measured"` times
            `linear` against the same product with the weight first (`(W @ x.T).T`, a single row padded to two),
            in turn on each weight, per weight shape and row count, and keeps the faster: PyTorch's CPU BLAS takes a
            slow path for a handful of rows, and SmolLM2's float32 draft step spends 2-3x less in its linears this
            way here. The drafting copy shares the model's weights (no memory), and the verify pass keeps `linear`,
            so the output is unchanged. `"stock"` drafts with `linear` as the model does. No effect on an
            accelerator.
        prefix_store: a `vericache_hf.prefix` store (`DiskStore`, `RedisStore`) that prompt prefixes are saved to
            and reused from: a prompt whose leading chunks were stored starts drafting on their compressed KV at once
            while the exact KV streams in behind, and its first verify pass prefills the rest of the prompt exactly.
            One request per call (batch 1, or `VeriCacheEngine`). None stores nothing.
        prefix_chunk_tokens: tokens per stored chunk (256, as LMCache); a prefix is a whole number of chunks.
        emulated_link_bytes_per_s: benchmarks only, never needed for use: staging copies of the full tier take the
            time they would take on a link of this many bytes per second (they sleep, costing no CPU). With
            `stage_on_cpu`, it lets a CPU-only machine study what overlapping transfers buys. None: the real link.
        stats: a `VeriCacheStats` to fill in, besides the one attached to dict outputs.
        timeline: a `Timeline` to record prefill, draft, transfer and verify spans in (per request in the engine),
            to plot how requests stagger. None: nothing is recorded.
    """

    compressor: Any = "snapkv"
    compression_ratio: float = 0.75
    compression_budget: int | None = None
    compressor_kwargs: dict[str, Any] = field(default_factory=dict)
    draft_length: int = 8
    draft_schedule: str = "auto"
    min_draft_length: int = 2
    max_draft_length: int = 64
    chunk_tokens: int = 2048
    staging_buffers: int = 2
    staging_chunk_tokens: int | None = 3072
    verify_attention: str = "auto"
    transfer_timeout: float = 60.0
    stage_on_cpu: bool = False
    refresh: Any = None
    proposer: Any = None
    proposal_length: int = 10
    draft_dtype: Any = None
    draft_matmul: str = "measured"
    prefix_store: Any = None
    prefix_chunk_tokens: int = 256
    emulated_link_bytes_per_s: float | None = None
    stats: Any = field(default=None, repr=False, compare=False)
    timeline: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        from .cache.refresh import RefreshPolicy
        from .compressors import check_compressor_spec
        from .compressors.naming import spec_from_json

        if isinstance(self.refresh, dict):  # as saved in a generation config
            self.refresh = RefreshPolicy(**self.refresh)
        if self.refresh is not None and not isinstance(self.refresh, RefreshPolicy):
            raise TypeError(
                "refresh must be a vericache_hf.cache.refresh.RefreshPolicy, its settings as a dict, or None, got "
                f"{type(self.refresh).__name__}."
            )
        # a compressor or press given by name and settings (as saved) is built here, so the config holds objects
        self.compressor = spec_from_json(self.compressor)
        check_ratio("compression_ratio", self.compression_ratio)
        check_budget("compression_budget", self.compression_budget)
        # The compressor is checked, not built: a bad name or list entry is refused here rather than at generate.
        check_compressor_spec(self.compressor, self.compression_budget, self.compressor_kwargs)
        if self.draft_schedule not in DRAFT_SCHEDULES:
            raise ValueError(f"draft_schedule must be one of {DRAFT_SCHEDULES}, got {self.draft_schedule!r}.")
        check_seconds("transfer_timeout", self.transfer_timeout)
        if not (self.proposer in (None, "prompt_lookup") or hasattr(self.proposer, "generate")):
            raise ValueError(
                f"proposer must be None, 'prompt_lookup' or an assistant model (a transformers causal LM), "
                f"got {self.proposer!r}."
            )
        check_draft_matmul(self.draft_matmul)
        check_kernel(self.verify_attention)
        if self.staging_chunk_tokens is not None:
            check_int("staging_chunk_tokens", self.staging_chunk_tokens, why=" (or None: whole layers)")
        if self.draft_dtype is not None:  # kept as its name, so that the config saves as JSON
            self.draft_dtype = str(resolve_dtype(self.draft_dtype)).removeprefix("torch.")
        if self.prefix_store is not None:
            from .prefix.store import PrefixStore

            if not isinstance(self.prefix_store, PrefixStore):
                raise TypeError(
                    "prefix_store must be a vericache_hf.prefix store (DiskStore, RedisStore) or None, "
                    f"got {type(self.prefix_store).__name__}."
                )
        if self.emulated_link_bytes_per_s is not None and not (
            isinstance(self.emulated_link_bytes_per_s, int | float) and self.emulated_link_bytes_per_s > 0
        ):
            raise ValueError(
                "emulated_link_bytes_per_s must be a positive number of bytes per second (e.g. 32e9) or None, "
                f"got {self.emulated_link_bytes_per_s!r}."
            )
        if not isinstance(self.stage_on_cpu, bool):
            raise TypeError(f"stage_on_cpu must be True or False, got {self.stage_on_cpu!r}.")
        for name in (
            "draft_length",
            "min_draft_length",
            "max_draft_length",
            "chunk_tokens",
            "staging_buffers",
            "proposal_length",
            "prefix_chunk_tokens",
        ):
            check_int(name, getattr(self, name))
        if self.min_draft_length > self.max_draft_length:
            raise ValueError(
                f"min_draft_length ({self.min_draft_length}) must not exceed max_draft_length "
                f"({self.max_draft_length})."
            )
        if self.draft_schedule != "fixed" and not (
            self.min_draft_length <= self.draft_length <= self.max_draft_length
        ):
            raise ValueError(
                f"draft_length ({self.draft_length}) must lie within [min_draft_length, max_draft_length] = "
                f"[{self.min_draft_length}, {self.max_draft_length}] for the {self.draft_schedule} schedule."
            )

    @classmethod
    def from_any(cls, value: VeriCacheConfig | dict[str, Any] | None) -> VeriCacheConfig:
        """Accept a config, a plain dict (as `to_dict` writes it, and a `GenerationConfig` stores it) or None
        (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {item.name for item in fields(cls)})
            if unknown:
                raise ValueError(
                    f"Unknown VeriCacheConfig settings {unknown}; the settings are those of "
                    "vericache_hf.VeriCacheConfig (a saved config may come from another version: save it again)."
                )
            return cls(**value)
        raise TypeError(f"vericache_config must be a VeriCacheConfig or a dict, got {type(value).__name__}.")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict, for saving inside `generation_config`, that `from_any` reads back into an equal
        config: compressors and presses by name and settings, the refresh policy by its settings. Raises
        `ValueError` for what JSON cannot name (an assistant model, a prefix store, a compressor object of one's
        own, a compressor_kwargs value that is not plain JSON)."""
        from .compressors.naming import is_plain, spec_to_json

        if self.proposer not in (None, "prompt_lookup"):
            raise ValueError(
                "A VeriCacheConfig whose proposer is an assistant model cannot be saved in a generation config; "
                "save it with proposer=None and pass assistant_model= to generate."
            )
        if self.prefix_store is not None:
            raise ValueError(
                "A VeriCacheConfig with a prefix_store cannot be saved in a generation config (a store is a live "
                "connection); save it with prefix_store=None and pass the store in the config at generate time."
            )
        if not is_plain(self.compressor_kwargs):
            raise ValueError(
                f"compressor_kwargs {self.compressor_kwargs!r} cannot be saved in a generation config: every value "
                "must be plain JSON (numbers, strings, booleans, None, lists). Save plain values, or pass "
                "vericache_config= to each generate call instead."
            )
        data = {
            item.name: getattr(self, item.name)
            for item in fields(self)
            if item.name not in ("stats", "timeline")
        }  # stats and timeline are live objects of the caller's: not saved
        data["compressor"] = spec_to_json(self.compressor)
        data["compressor_kwargs"] = dict(self.compressor_kwargs)
        data["refresh"] = self.refresh.to_dict() if self.refresh is not None else None
        return data
