"""`PrefixCache`: save a prompt's KV to a `PrefixStore` chunk by chunk, and load the longest leading run that hits.

The prompt is cut into chunks of `chunk_tokens` (256, as LMCache); a partial last chunk is not stored. Every entry
is two store values, `<key>:meta` (JSON, `codec`) and `<key>:kv` (safetensors), checked against each other on read;
an entry that fails a check is refused (a miss, with a warning) and deleted, so a later save writes it again.

- The full tier (`save` / `load` / `iter_layers`, per-layer `(keys, values)` each (1, H_kv, T, D)) is stored one
  entry per chunk and layer, `full@<chunk hash>/<layer>`, so that a loader reads it layer by layer, one round trip a
  layer, and a verify pass can start on the first layers while the last ones are still on their way (vLLM's
  `wait_for_layer_load`). The next layer's round trip is in flight while a layer is checked and decoded.
- A draft tier (`save_state` / `load_state`, any named tensors) is one entry for a whole prefix, under the key of
  its last chunk: a compressor's state depends on every token it saw, so it is stored for exactly that prefix. Its
  fingerprint carries the compressor's name and settings, so a different compressor never matches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .._threads import in_background
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
        """The key of every full chunk of `token_ids` (a full-tier entry adds `/<layer>`; `:meta`/`:kv` follow)."""
        _check_fingerprint(fingerprint)
        return [tier_key(tier, h) for h in chunk_hashes(token_ids, self.chunk_tokens, fingerprint)]

    def layer_keys(self, token_ids: torch.Tensor, fingerprint: KVFingerprint, layer: int) -> list[str]:
        """The full-tier entry of every full chunk of `token_ids` for one layer."""
        hashes = chunk_hashes(token_ids, self.chunk_tokens, fingerprint)
        return _layer_keys(hashes, layer)

    def probe(self, token_ids: torch.Tensor, fingerprint: KVFingerprint) -> int:
        """How many leading tokens the full tier has every layer of, by metadata alone: cheap (no tensor bytes
        move), not a promise."""
        last = self.layer_keys(
            token_ids, fingerprint, fingerprint.num_layers - 1
        )  # each chunk's last written
        return _leading(self.store.exists_many([key + ":meta" for key in last])) * self.chunk_tokens

    def save(
        self,
        token_ids: torch.Tensor,
        per_layer_kv: Sequence[LayerKV],
        fingerprint: KVFingerprint,
        tier: str = "full",
    ) -> int:
        """Store every full chunk of the prompt's KV (`per_layer_kv[i] = (keys, values)`, each (1, H_kv, T, D) with
        T >= len(token_ids)); entries already stored are skipped. The number of chunks written to."""
        if check_tier(tier) != "full":
            raise ValueError("save stores the full tier; a draft tier is stored with save_state")
        count = token_ids_1d(token_ids).numel() // self.chunk_tokens
        _check_kv(per_layer_kv, fingerprint, count * self.chunk_tokens)
        hashes = chunk_hashes(token_ids, self.chunk_tokens, fingerprint)[:count]
        layers = range(fingerprint.num_layers)
        names = [[_layer_entry(chunk_hash, layer) for layer in layers] for chunk_hash in hashes]
        stored = self.store.exists_many([tier_key("full", name) + ":meta" for row in names for name in row])
        written = 0
        for i, row in enumerate(names):
            span = slice(i * self.chunk_tokens, (i + 1) * self.chunk_tokens)
            items: list[tuple[str, bytes]] = []
            for layer, name in enumerate(row):
                if stored[i * len(layers) + layer]:
                    continue
                keys, values = per_layer_kv[layer]
                tensors = {"keys": keys[:, :, span], "values": values[:, :, span]}
                meta, payload = encode_chunk(tensors, fingerprint, "full", name, self.chunk_tokens)
                base = tier_key("full", name)
                items += [(base + ":kv", payload), (base + ":meta", meta)]  # bytes first, metadata last
            if items:
                self.store.put_many(items)
                written += 1
        return written

    def iter_layers(
        self, token_ids: torch.Tensor, fingerprint: KVFingerprint
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, int]]:
        """Layer by layer, one round trip each: (layer, keys, values, bytes read) of the leading run of chunks that
        are stored and pass every check, keys/values (1, H_kv, run, D). Layer 0 sets the run; a later layer whose
        run is shorter is yielded shorter (the caller keeps the common part); an empty one ends the iteration."""
        _check_fingerprint(fingerprint)
        expected = (1, fingerprint.num_kv_heads, self.chunk_tokens, fingerprint.head_dim)
        hashes = chunk_hashes(token_ids, self.chunk_tokens, fingerprint)

        def read(layer: int, hashes: list[str]) -> list[bytes | None]:
            bases = _layer_keys(hashes, layer)
            return self.store.get_many([base + part for base in bases for part in (":meta", ":kv")])

        # one read ahead: the next layer is on its way while this one is checked, decoded and used
        ahead = _ReadAhead(read, 0, hashes)
        for layer in range(fingerprint.num_layers):
            found = ahead.result()
            if layer + 1 < fingerprint.num_layers:
                ahead = _ReadAhead(read, layer + 1, hashes)
            names = [_layer_entry(chunk_hash, layer) for chunk_hash in hashes]
            bases = [tier_key("full", name) for name in names]
            found = found[: 2 * len(names)]  # read before an earlier layer shortened the run
            run: list[dict[str, torch.Tensor]] = []
            nbytes = 0
            for name, base, meta, payload in zip(names, bases, found[::2], found[1::2], strict=True):
                tensors = self._decode(base, meta, payload, fingerprint, "full", name, self.chunk_tokens)
                reason = "" if tensors is None else _layout_mismatch(tensors, expected, fingerprint.dtype)
                if reason:
                    refuse(base, reason)
                    self._drop(base)
                if tensors is None or reason:
                    break
                run.append(tensors)
                nbytes += len(payload)
            if not run:
                return
            hashes = hashes[: len(run)]
            keys = torch.cat([t["keys"] for t in run], dim=2)
            yield layer, keys, torch.cat([t["values"] for t in run], dim=2), nbytes

    def load(
        self, token_ids: torch.Tensor, fingerprint: KVFingerprint, num_layers: int | None = None
    ) -> tuple[int, list[LayerKV] | None]:
        """(hit tokens, per-layer (keys, values) each (1, H_kv, hit, D)) for the longest leading hit, or (0, None)."""
        _check_fingerprint(fingerprint)
        if num_layers is not None and num_layers != fingerprint.num_layers:
            raise ValueError(
                f"num_layers={num_layers} disagrees with the fingerprint's {fingerprint.num_layers}"
            )
        layers = [(keys, values) for _, keys, values, _ in self.iter_layers(token_ids, fingerprint)]
        if len(layers) < fingerprint.num_layers:
            return 0, None
        hit = min(keys.shape[2] for keys, _ in layers)
        return hit, [(keys[:, :, :hit], values[:, :, :hit]) for keys, values in layers]

    def save_state(
        self, token_ids: torch.Tensor, tensors: dict[str, torch.Tensor], fingerprint: KVFingerprint, tier: str
    ) -> bool:
        """Store one entry describing the whole of `token_ids` (whole chunks), under its last chunk's key: the
        compressed draft tier of exactly that prefix. False when it is already stored."""
        ids, chunk_hash, base = self._state_key(token_ids, fingerprint, tier)
        if self.store.exists(base + ":meta"):
            return False
        meta, payload = encode_chunk(tensors, fingerprint, tier, chunk_hash, ids.numel())
        self.store.put_many([(base + ":kv", payload), (base + ":meta", meta)])  # bytes first, metadata last
        return True

    def load_state(
        self, token_ids: torch.Tensor, fingerprint: KVFingerprint, tier: str
    ) -> tuple[dict[str, torch.Tensor], int] | None:
        """(named tensors, bytes read) of the entry `save_state` wrote for exactly `token_ids`, or None."""
        ids, chunk_hash, base = self._state_key(token_ids, fingerprint, tier)
        meta, payload = self.store.get_many([base + ":meta", base + ":kv"])
        tensors = self._decode(base, meta, payload, fingerprint, tier, chunk_hash, ids.numel())
        return None if tensors is None else (tensors, len(payload))

    def _decode(self, base, meta, payload, fingerprint, tier, name, tokens) -> dict[str, torch.Tensor] | None:
        """The entry's tensors; None when it is absent (or half written) or refused, and then deleted."""
        if meta is None or payload is None:
            return None
        tensors = decode_chunk(base, meta, payload, fingerprint, tier, name, tokens)
        if tensors is None:
            self._drop(base)
        return tensors

    def _state_key(
        self, token_ids: torch.Tensor, fingerprint: KVFingerprint, tier: str
    ) -> tuple[torch.Tensor, str, str]:
        """(token ids, last chunk's hash, store key) of the state entry for exactly `token_ids` (whole chunks)."""
        ids = token_ids_1d(token_ids)
        if not ids.numel() or ids.numel() % self.chunk_tokens:
            raise ValueError(
                f"a state entry covers whole chunks: got {ids.numel()} tokens, chunks of {self.chunk_tokens}"
            )
        chunk_hash = chunk_hashes(ids, self.chunk_tokens, fingerprint)[-1]
        return ids, chunk_hash, tier_key(tier, chunk_hash)

    def _drop(self, base: str) -> None:
        self.store.delete(base + ":meta")
        self.store.delete(base + ":kv")


class _ReadAhead:
    """`read(*args)` on a daemon thread (one that never keeps the process alive on a stalled store); `result`
    waits for it and raises, on the caller's thread, what it raised."""

    def __init__(self, read: Callable[..., list[bytes | None]], *args: object) -> None:
        self._value: list[bytes | None] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(read, args), name="vericache-prefix-read", daemon=True
        )
        self._thread.start()

    def _run(self, read: Callable[..., list[bytes | None]], args: tuple) -> None:
        in_background()  # reads for a loader, which decides by its own device whether it runs alone
        try:
            self._value = read(*args)
        except BaseException as error:  # raised again by result()
            self._error = error

    def result(self) -> list[bytes | None]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _layer_entry(chunk_hash: str, layer: int) -> str:
    """The name of one layer's entry of a full-tier chunk (its store key is `tier_key("full", name)`)."""
    return f"{chunk_hash}/{layer}"


def _layer_keys(hashes: Sequence[str], layer: int) -> list[str]:
    """The store key of one layer's entry of each of these full-tier chunks."""
    return [tier_key("full", _layer_entry(chunk_hash, layer)) for chunk_hash in hashes]


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


def _layout_mismatch(tensors: dict[str, torch.Tensor], shape: tuple, dtype: str) -> str:
    if set(tensors) != {"keys", "values"}:
        return "tensor names are not keys and values"
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shape or str(tensor.dtype) != dtype:
            return f"{name} is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}"
    return ""
