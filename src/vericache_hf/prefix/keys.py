"""What makes stored KV valid (`KVFingerprint`) and the chained chunk keys that a prefix is stored under.

KV is only reusable by the same weights, in the same dtype, with the same layout, produced the same way: every key
includes a fingerprint of all of that, so a different model, dtype or compressor never matches. Chunk keys are chained
as in LMCache (`h_i = sha256(h_{i-1} + tokens_i + fingerprint)`), so chunk i only hits when every token before it
matches too. The hash is sha256, never Python's `hash`, which differs between processes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["KVFingerprint", "TIERS", "check_namespace", "chunk_hashes", "fingerprint_for", "tier_key"]

TIERS = ("full", "draft")
_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_EMBEDDING_BYTES = 4096
# Config fields that do not change the KV, and that paths, versions or generate() may change at run time: a
# fingerprint that drifted with them would silently never hit. The dtype is a field of its own.
_VOLATILE = (
    "_name_or_path",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "use_cache",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
)


@dataclass(frozen=True)
class KVFingerprint:
    """Everything that must agree for stored KV to be reused: model identity (config and weights), dtype, layout,
    and for a compressed (draft-tier) entry the compressor and its settings. Build one with `fingerprint_for`.
    """

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    compressor: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> bytes:
        """sha256 of a canonical JSON form: the bytes mixed into every chunk hash."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).digest()


def _tensor_bytes(tensor: torch.Tensor, limit: int | None = None) -> bytes:
    """Raw bytes of (the start of) a parameter, copying at most `limit` bytes off the device."""
    if tensor.device.type == "meta":  # offloaded or not materialised: its shape is all we can identify
        return repr((tuple(tensor.shape), str(tensor.dtype))).encode()
    flat = tensor.detach().reshape(-1)
    if limit is not None:
        flat = flat[: -(-limit // flat.element_size())]
    return flat.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _weights_identity(model: torch.nn.Module) -> str:
    """Cheap weights identity: the first and last norm weights and the first 4 KiB of the input embedding.
    Finetunes change these; hashing every weight would cost seconds on a large model."""
    digest = hashlib.sha256()
    norms = [(name, p) for name, p in model.named_parameters() if "norm" in name and name.endswith("weight")]
    for name, param in norms[:1] + norms[-1:]:
        digest.update(name.encode() + _tensor_bytes(param))
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        digest.update(_tensor_bytes(embeddings.weight, _EMBEDDING_BYTES))
    return digest.hexdigest()


def fingerprint_for(model: torch.nn.Module, compressor: Any = None) -> KVFingerprint:
    """The fingerprint of `model`'s KV; with `compressor`, of the draft tier it builds (name and settings)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        raise TypeError(
            f"model must be a transformers PreTrainedModel with a config, got {type(model).__name__}"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    fields = {
        k: v for k, v in json.loads(config.to_json_string(use_diff=False)).items() if k not in _VOLATILE
    }
    config_hash = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return KVFingerprint(
        model=f"{config_hash[:32]}-{_weights_identity(model)[:32]}",
        dtype=str(model.dtype),
        num_layers=text.num_hidden_layers,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        compressor="" if compressor is None else repr(compressor),
    )


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise ValueError(
            f"namespace must be 1-64 characters from [A-Za-z0-9._-], got {namespace!r}: pick one name per tenant"
        )
    return namespace


def check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    return tier


def token_ids_1d(token_ids: torch.Tensor) -> torch.Tensor:
    """The prompt as a 1D int64 CPU tensor; (1, T) is accepted and flattened."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype.is_floating_point:
        raise TypeError(f"token_ids must be an integer torch.Tensor, got {type(token_ids).__name__}")
    if token_ids.dim() == 2 and token_ids.shape[0] == 1:
        token_ids = token_ids[0]
    if token_ids.dim() != 1:
        raise ValueError(
            f"token_ids must be 1D (T,) or (1, T), got shape {tuple(token_ids.shape)}: pass one prompt"
        )
    return token_ids.detach().to("cpu", torch.int64)


def chunk_hashes(token_ids: torch.Tensor, chunk_tokens: int, fingerprint: KVFingerprint) -> list[str]:
    """One chained sha256 hex digest per full chunk of `token_ids` (a partial last chunk gets none)."""
    ids = token_ids_1d(token_ids)
    extra, previous, hashes = fingerprint.digest(), b"", []
    for start in range(0, ids.numel() - chunk_tokens + 1, chunk_tokens):
        chunk = ids[start : start + chunk_tokens].numpy().astype("<i8").tobytes()
        previous = hashlib.sha256(previous + chunk + extra).digest()
        hashes.append(previous.hex())
    return hashes


def tier_key(tier: str, chunk_hash: str) -> str:
    """The store key of one chunk, below the store's `vericache@<namespace>@` prefix."""
    return f"{check_tier(tier)}@{chunk_hash}"
