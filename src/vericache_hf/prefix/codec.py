"""One chunk on the wire: named tensors as safetensors bytes, and a JSON metadata entry that describes them.

A store is shared and may be written by anyone who can reach it, so nothing read from it is ever executed: the
tensors are safetensors (a JSON header and raw bytes, no pickle), the metadata is JSON, and every read is checked
against the metadata (format version, fingerprint, tier, chunk hash, token count, byte count, sha256, tensor names,
shapes and dtypes). An entry that fails any check is refused: `decode_chunk` warns, naming the key and the reason,
and returns None, which the cache treats as a miss.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .keys import KVFingerprint

__all__ = ["FORMAT_VERSION", "decode_chunk", "encode_chunk", "refuse"]

FORMAT_VERSION = 1


def refuse(key: str, reason: str) -> None:
    """Warn that the entry under `key` was refused (read as a miss), and why."""
    warnings.warn(
        f"vericache prefix store: entry {key!r} refused ({reason}); reading it as a miss", stacklevel=3
    )


def encode_chunk(
    tensors: dict[str, torch.Tensor], fingerprint: KVFingerprint, tier: str, chunk_hash: str, tokens: int
) -> tuple[bytes, bytes]:
    """(metadata JSON bytes, safetensors bytes) for one chunk's named tensors."""
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise TypeError(
            "tensors must be a non-empty dict[str, torch.Tensor], one entry per named tensor of the chunk"
        )
    payload = save_safetensors({name: t.detach().cpu().contiguous() for name, t in tensors.items()})
    meta = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint.to_dict(),
        "tier": tier,
        "hash": chunk_hash,
        "tokens": tokens,
        "nbytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "tensors": {name: {"shape": list(t.shape), "dtype": str(t.dtype)} for name, t in tensors.items()},
    }
    return json.dumps(meta, sort_keys=True).encode(), payload


def parse_meta(key: str, meta_bytes: bytes) -> dict[str, Any] | None:
    """The metadata as a dict, or None (refused) when it is not a JSON object of this format."""
    try:
        meta = json.loads(meta_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        refuse(key, f"metadata is not JSON: {error}")
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        refuse(key, f"metadata format {found!r} is not version {FORMAT_VERSION}")
        return None
    return meta


def _mismatch(
    meta: dict[str, Any], fingerprint: KVFingerprint, tier: str, chunk_hash: str, tokens: int
) -> str:
    """Why the metadata does not describe the entry the caller asked for; '' when it does."""
    if meta.get("fingerprint") != fingerprint.to_dict():
        return "fingerprint differs (another model, dtype, layout or compressor)"
    expected = {"tier": tier, "hash": chunk_hash, "tokens": tokens}
    for field, value in expected.items():
        if meta.get(field) != value:
            return f"metadata {field} is {meta.get(field)!r}, expected {value!r}"
    return ""


def _check_tensors(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    described = meta.get("tensors")
    if not isinstance(described, dict) or set(described) != set(tensors):
        return "tensor names differ from the metadata"
    for name, tensor in tensors.items():
        spec = described[name]
        if not isinstance(spec, dict) or spec.get("shape") != list(tensor.shape):
            return f"tensor {name!r} has shape {list(tensor.shape)}, metadata says {spec}"
        if spec.get("dtype") != str(tensor.dtype):
            return f"tensor {name!r} has dtype {tensor.dtype}, metadata says {spec.get('dtype')}"
    return ""


def decode_chunk(
    key: str,
    meta_bytes: bytes,
    payload: bytes,
    fingerprint: KVFingerprint,
    tier: str,
    chunk_hash: str,
    tokens: int,
) -> dict[str, torch.Tensor] | None:
    """The chunk's named tensors, or None (with a warning naming `key` and the reason) if any check fails."""
    meta = parse_meta(key, meta_bytes)
    if meta is None:
        return None
    reason = _mismatch(meta, fingerprint, tier, chunk_hash, tokens)
    if reason:
        refuse(key, reason)
        return None
    if meta.get("nbytes") != len(payload):
        refuse(key, f"kv entry has {len(payload)} bytes, metadata says {meta.get('nbytes')} (truncated?)")
        return None
    if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
        refuse(key, "sha256 checksum of the kv bytes does not match the metadata (corrupted)")
        return None
    try:
        tensors = load_safetensors(bytes(payload))
    except (
        Exception
    ) as error:  # any parse failure of untrusted bytes is a miss, never an exception into decoding
        refuse(key, f"kv bytes are not a valid safetensors file: {type(error).__name__}: {error}")
        return None
    reason = _check_tensors(meta, tensors)
    if reason:
        refuse(key, reason)
        return None
    return tensors
