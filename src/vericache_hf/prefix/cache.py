"""`PrefixCache`: save a prompt's KV to a `PrefixStore` chunk by chunk, and load the longest leading run that hits.

The prompt is cut into chunks of `chunk_tokens` (256, as LMCache); a partial last chunk is not stored. Chunk i is
stored under its chained hash (`keys.chunk_hashes`) as two entries: `<tier>@<hash>:meta` (JSON, `codec`) and
`<tier>@<hash>:kv` (safetensors). A load reads every chunk's metadata in one batch, then the bytes of the leading
run whose metadata is there, and stops at the first chunk that is missing or refused. A refused entry is deleted, so
a later save writes it again.

Two levels:
- `save` / `load` take and return per-layer `(keys, values)`, each (1, H_kv, T, D), as the model computes them;
  every chunk is checked against the fingerprint's layout and dtype. This is the full tier.
- `save_chunks` / `load_chunks` take and return any named tensors per chunk (`dict[str, Tensor]`), checked only
  against their own metadata. The draft tier stores a compressor's state through these: its fingerprint carries the
  compressor's name and settings, so a different compressor never matches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..checks import check_int
from .codec import decode_chunk, encode_chunk, refuse
from .keys import KVFingerprint, check_tier, chunk_hashes, tier_key, token_ids_1d
from .store import PrefixStore

__all__ = ["PrefixCache"]

LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PrefixCache:
    """Prompt prefixes in `store`, in chunks of `chunk_tokens` tokens."""

    store: PrefixStore
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.store, PrefixStore):
            raise TypeError(
                f"store must be a PrefixStore (DiskStore, RedisStore...), got {type(self.store).__name__}"
            )
        check_int("chunk_tokens", self.chunk_tokens)

    def chunk_keys(
        self, token_ids: torch.Tensor, fingerprint: KVFingerprint, tier: str = "full"
    ) -> list[str]:
        """The store key (without `:meta` / `:kv`) of every full chunk of `token_ids`."""
        _check_fingerprint(fingerprint)
        return [tier_key(tier, h) for h in chunk_hashes(token_ids, self.chunk_tokens, fingerprint)]

    def probe(self, token_ids: torch.Tensor, fingerprint: KVFingerprint, tier: str = "full") -> int:
        """How many leading tokens the store has metadata for: cheap (no tensor bytes move), not a promise."""
        found = self.store.exists_many([k + ":meta" for k in self.chunk_keys(token_ids, fingerprint, tier)])
        return _leading(found) * self.chunk_tokens

    def save_chunks(
        self,
        token_ids: torch.Tensor,
        chunks: Sequence[dict[str, torch.Tensor]],
        fingerprint: KVFingerprint,
        tier: str = "full",
    ) -> int:
        """Store `chunks[i]` (any named tensors) for full chunk i of `token_ids`; the number of chunks written."""
        return self._save(token_ids, fingerprint, tier, len(chunks), lambda i: chunks[i])

    def save(
        self,
        token_ids: torch.Tensor,
        per_layer_kv: Sequence[LayerKV],
        fingerprint: KVFingerprint,
        tier: str = "full",
    ) -> int:
        """Store every full chunk of the prompt's KV (`per_layer_kv[i] = (keys, values)`, each (1, H_kv, T, D) with
        T >= len(token_ids)); chunks already stored are skipped. The number of chunks written."""
        count = token_ids_1d(token_ids).numel() // self.chunk_tokens
        _check_kv(per_layer_kv, fingerprint, count * self.chunk_tokens)

        def chunk(i: int) -> dict[str, torch.Tensor]:
            span = slice(i * self.chunk_tokens, (i + 1) * self.chunk_tokens)
            named = {}
            for layer, (keys, values) in enumerate(per_layer_kv):
                named[f"layer.{layer}.keys"] = keys[:, :, span]
                named[f"layer.{layer}.values"] = values[:, :, span]
            return named

        return self._save(token_ids, fingerprint, tier, count, chunk)

    def _save(
        self,
        token_ids: torch.Tensor,
        fingerprint: KVFingerprint,
        tier: str,
        count: int,
        chunk: Callable[[int], dict[str, torch.Tensor]],
    ) -> int:
        hashes = chunk_hashes(token_ids, self.chunk_tokens, fingerprint)
        check_tier(tier)
        if count > len(hashes):
            raise ValueError(
                f"got {count} chunks but token_ids has only {len(hashes)} full chunks of {self.chunk_tokens} tokens"
            )
        bases = [tier_key(tier, h) for h in hashes[:count]]
        present = self.store.exists_many([base + ":meta" for base in bases])
        items: list[tuple[str, bytes]] = []
        for i in (i for i in range(count) if not present[i]):
            meta, payload = encode_chunk(chunk(i), fingerprint, tier, hashes[i], self.chunk_tokens)
            items += [(bases[i] + ":kv", payload), (bases[i] + ":meta", meta)]  # bytes first, metadata last
        self.store.put_many(items)
        return len(items) // 2

    def iter_chunks(
        self,
        token_ids: torch.Tensor,
        fingerprint: KVFingerprint,
        tier: str = "full",
        limit: int | None = None,
    ) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
        """(named tensors, bytes read) of each chunk in order, one round trip each, stopping at the first chunk
        that is missing or refused (or after `limit` chunks): a loader can use each chunk as it arrives."""
        hashes = chunk_hashes(token_ids, self.chunk_tokens, fingerprint)[:limit]
        for chunk_hash in hashes:
            base = tier_key(tier, chunk_hash)
            meta, payload = self.store.get_many([base + ":meta", base + ":kv"])
            if meta is None or payload is None:  # absent, or evicted between writes: a plain miss
                return
            tensors = decode_chunk(base, meta, payload, fingerprint, tier, chunk_hash, self.chunk_tokens)
            if tensors is None:
                self._drop(base)
                return
            yield tensors, len(payload)

    def load_chunks(
        self, token_ids: torch.Tensor, fingerprint: KVFingerprint, tier: str = "full"
    ) -> list[dict[str, torch.Tensor]]:
        """The named tensors of the longest leading run of chunks that are stored and pass every check."""
        return [tensors for tensors, _ in self.iter_chunks(token_ids, fingerprint, tier)]

    def iter_layers(
        self, token_ids: torch.Tensor, fingerprint: KVFingerprint, limit: int | None = None
    ) -> Iterator[tuple[list[LayerKV], int]]:
        """Per chunk, (per-layer (keys, values) each (1, H_kv, chunk_tokens, D), bytes read) of the full tier, in
        order, stopping at the first chunk that is missing or refused (a wrong layout is refused too)."""
        _check_fingerprint(fingerprint)
        expected = (1, fingerprint.num_kv_heads, self.chunk_tokens, fingerprint.head_dim)
        bases = self.chunk_keys(token_ids, fingerprint)
        chunks = self.iter_chunks(token_ids, fingerprint, "full", limit)
        for base, (tensors, nbytes) in zip(bases, chunks, strict=False):
            reason = _layout_mismatch(tensors, fingerprint.num_layers, expected, fingerprint.dtype)
            if reason:
                refuse(base, reason)
                self._drop(base)
                return
            layers = range(fingerprint.num_layers)
            yield [(tensors[f"layer.{i}.keys"], tensors[f"layer.{i}.values"]) for i in layers], nbytes

    def load(
        self,
        token_ids: torch.Tensor,
        fingerprint: KVFingerprint,
        tier: str = "full",
        num_layers: int | None = None,
    ) -> tuple[int, list[LayerKV] | None]:
        """(hit tokens, per-layer (keys, values) each (1, H_kv, hit, D)) for the longest leading hit, or (0, None)."""
        _check_fingerprint(fingerprint)
        check_tier(tier)
        if num_layers is not None and num_layers != fingerprint.num_layers:
            raise ValueError(
                f"num_layers={num_layers} disagrees with the fingerprint's {fingerprint.num_layers}"
            )
        chunks = [layers for layers, _ in self.iter_layers(token_ids, fingerprint)]
        if not chunks:
            return 0, None
        joined = [
            (torch.cat([c[i][0] for c in chunks], dim=2), torch.cat([c[i][1] for c in chunks], dim=2))
            for i in range(fingerprint.num_layers)
        ]
        return len(chunks) * self.chunk_tokens, joined

    def save_state(
        self, token_ids: torch.Tensor, tensors: dict[str, torch.Tensor], fingerprint: KVFingerprint, tier: str
    ) -> bool:
        """Store one entry describing the whole of `token_ids` (whole chunks), under its last chunk's key: the
        compressed draft tier of exactly that prefix. False when it is already stored."""
        ids = self._whole_chunks(token_ids)
        chunk_hash = chunk_hashes(ids, self.chunk_tokens, fingerprint)[-1]
        base = tier_key(tier, chunk_hash)
        if self.store.exists(base + ":meta"):
            return False
        meta, payload = encode_chunk(tensors, fingerprint, tier, chunk_hash, ids.numel())
        self.store.put_many([(base + ":kv", payload), (base + ":meta", meta)])  # bytes first, metadata last
        return True

    def load_state(
        self, token_ids: torch.Tensor, fingerprint: KVFingerprint, tier: str
    ) -> tuple[dict[str, torch.Tensor], int] | None:
        """(named tensors, bytes read) of the entry `save_state` wrote for exactly `token_ids`, or None."""
        ids = self._whole_chunks(token_ids)
        chunk_hash = chunk_hashes(ids, self.chunk_tokens, fingerprint)[-1]
        base = tier_key(tier, chunk_hash)
        meta, payload = self.store.get_many([base + ":meta", base + ":kv"])
        if meta is None or payload is None:
            return None
        tensors = decode_chunk(base, meta, payload, fingerprint, tier, chunk_hash, ids.numel())
        if tensors is None:
            self._drop(base)
            return None
        return tensors, len(payload)

    def _whole_chunks(self, token_ids: torch.Tensor) -> torch.Tensor:
        ids = token_ids_1d(token_ids)
        if not ids.numel() or ids.numel() % self.chunk_tokens:
            raise ValueError(
                f"a state entry covers whole chunks: got {ids.numel()} tokens, chunks of {self.chunk_tokens}"
            )
        return ids

    def _drop(self, base: str) -> None:
        self.store.delete(base + ":meta")
        self.store.delete(base + ":kv")


def _leading(found: Sequence[bool]) -> int:
    run = 0
    while run < len(found) and found[run]:
        run += 1
    return run


def _check_fingerprint(fingerprint: object) -> None:
    if not isinstance(fingerprint, KVFingerprint):
        raise TypeError(
            f"fingerprint must be a KVFingerprint (see fingerprint_for), got {type(fingerprint).__name__}"
        )


def _check_kv(per_layer_kv: Sequence[LayerKV], fingerprint: KVFingerprint, tokens: int) -> None:
    """Saving KV under a fingerprint that does not describe it would poison the store: refuse loudly."""
    _check_fingerprint(fingerprint)
    if len(per_layer_kv) != fingerprint.num_layers:
        raise ValueError(
            f"per_layer_kv has {len(per_layer_kv)} layers, the fingerprint says {fingerprint.num_layers}"
        )
    for layer, kv in enumerate(per_layer_kv):
        if not isinstance(kv, tuple | list) or len(kv) != 2:
            raise TypeError(f"per_layer_kv[{layer}] must be a (keys, values) pair of tensors")
        for name, t in zip(("keys", "values"), kv, strict=True):
            ok = isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[0] == 1 and t.shape[2] >= tokens
            ok = ok and (t.shape[1], t.shape[3]) == (fingerprint.num_kv_heads, fingerprint.head_dim)
            if not ok or str(t.dtype) != fingerprint.dtype:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"per_layer_kv[{layer}] {name} must be (1, {fingerprint.num_kv_heads}, >= {tokens}, "
                    f"{fingerprint.head_dim}) in {fingerprint.dtype} to match the fingerprint, got {shape} "
                    f"{getattr(t, 'dtype', '')}"
                )


def _layout_mismatch(tensors: dict[str, torch.Tensor], num_layers: int, shape: tuple, dtype: str) -> str:
    names = {f"layer.{i}.{part}" for i in range(num_layers) for part in ("keys", "values")}
    if set(tensors) != names:
        return f"tensor names are not layer.0..{num_layers - 1}.keys/values"
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shape or str(tensor.dtype) != dtype:
            return f"{name} is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}"
    return ""
