"""`PrefixReuse`: one `generate` call's use of a prefix store, compressed first (the paper's prefix-caching case).

A prompt's leading whole chunks (at least one token is left after them: the suffix) are its *prefix*. On a hit:
1. the compressed draft tier of exactly that prefix is fetched (one entry, 4-8x fewer tokens than the full KV,
   floats in bfloat16) and restored, so drafting starts at once;
2. a loader thread streams the full prefix chunk by chunk into the host full tier meanwhile;
3. the loop drafts the suffix and beyond on the draft tier, waits only for the chunks still missing, and its first
   verify pass is both the exact prefill of the suffix and the check of the drafts.

On a miss the loop prefills the prefix alone, and `save` queues its full chunks and compressed draft tier to the
store's writer thread, off the decode path. Anything the store gets wrong (down, slow, corrupted, evicted) costs
time, never exactness: a draft entry that fails its checks is a miss, and full chunks that do not arrive are
recomputed from the tokens, with a warning.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from dataclasses import replace

import torch
from transformers import DynamicCache

from .._threads import in_background
from ..cache.compressor import Compressor
from ..cache.vericache import VeriCache
from ..compat import cache_kwargs
from ..stats import VeriCacheStats
from .cache import PrefixCache
from .keys import fingerprint_for
from .store import PrefixStore
from .writer import write_behind

__all__ = ["PrefixReuse"]

#: Seconds per unit of pass work, last measured on each model: how a call decides before its first pass.
_SECONDS_PER_WORK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PrefixReuse:
    """Looks a prompt's prefix up in `store`, restores it into a `VeriCache`, or saves it after a prefill."""

    def __init__(
        self,
        store: PrefixStore,
        model,
        compressor: Compressor,
        stats: VeriCacheStats,
        chunk_tokens: int = 256,
        timeout: float = 60.0,
    ) -> None:
        if not compressor.restorable:
            raise ValueError(
                f"prefix_store needs a compressor whose draft tier can be stored and restored; "
                f"{type(compressor).__name__} cannot. Use a token-dropping or quantizing compressor (snapkv, "
                "streaming_llm, knorm, h2o, kivi...), or prefix_store=None."
            )
        self.prefixes = PrefixCache(store, chunk_tokens)
        self.model, self.compressor, self.stats, self.timeout = model, compressor, stats, timeout
        self.full_print = fingerprint_for(model)
        # what fingerprint_for(model, compressor) gives, without hashing the weights a second time
        self.draft_print = replace(self.full_print, compressor=repr(compressor))
        self._loader: threading.Thread | None = None
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        self._layers_done, self._load_started, self._last_layer_at = 0, 0.0, 0.0
        self._prefix_tokens = self._draft_tokens = 0
        self._bytes_per_second = 1.0
        text = model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self._weights = sum(
            p.numel() for name, p in model.named_parameters() if "embed" not in name and "lm_head" not in name
        )
        # multiply-adds per token and cached token, over the layers: scores, then values
        self._attention = 2 * text.num_hidden_layers * text.num_attention_heads * head_dim

    def boundary(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> int:
        """The prefix length to reuse or save: whole chunks, leaving at least one token; 0 when not applicable
        (prompts shorter than a chunk and one token, and batches of different prompts: a prefix is one request's;
        a batch of one prompt repeated, as `num_return_sequences` makes, shares it)."""
        batch, length = input_ids.shape
        padded = attention_mask is not None and not bool(attention_mask.all())
        if padded or not bool((input_ids == input_ids[:1]).all()):
            warnings.warn(
                f"prefix_store serves one prompt per call; this batch of {batch} different prompts decodes "
                "without it (use VeriCacheEngine or one generate call per prompt to reuse prefixes)",
                stacklevel=4,
            )
            return 0
        chunk = self.prefixes.chunk_tokens
        return (length - 1) // chunk * chunk

    # -- reuse -----------------------------------------------------------------------------------------------------
    def restore(self, cache: VeriCache, prefix_ids: torch.Tensor) -> bool:
        """Restore a stored prefix into `cache`, compressed tier first; the full tier loads behind (see
        `wait_full_tier`). False on a miss, leaving the cache untouched."""
        started = time.perf_counter()
        try:
            return self._restore(cache, prefix_ids)
        finally:
            self.stats.prefix_wait_seconds += time.perf_counter() - started

    def _restore(self, cache: VeriCache, prefix_ids: torch.Tensor) -> bool:
        ids = prefix_ids[:1]  # every row holds the same prompt
        if self.prefixes.probe(ids, self.full_print) < ids.shape[-1]:
            return False
        started = time.perf_counter()
        found = self.prefixes.load_state(ids, self.draft_print, "draft")
        if found is None:
            return False
        state, nbytes = found
        self._bytes_per_second = nbytes / max(time.perf_counter() - started, 1e-6)  # the link, as measured
        device, rows = self.model.get_input_embeddings().weight.device, prefix_ids.shape[0]
        try:
            drafts = [
                self.compressor.restore(
                    {
                        name.split(".", 2)[2]: _rows(t.to(device, _stored_type(t, self.model.dtype)), rows)
                        for name, t in state.items()
                        if _layer(name) == i
                    }
                )
                for i in range(len(cache.layers))
            ]
        except (KeyError, ValueError, RuntimeError) as error:  # checksummed but not this compressor's layout
            warnings.warn(
                f"vericache prefix store: the stored draft tier does not fit {type(self.compressor).__name__} "
                f"({type(error).__name__}: {error}); reading it as a miss",
                stacklevel=4,
            )
            return False
        like = torch.empty(0, dtype=self.model.dtype, device=device)
        cache.adopt_prefix(drafts, prefix_ids.shape[-1], like, self.timeout)
        self._prefix_tokens, self._draft_tokens = prefix_ids.shape[-1], drafts[0].num_committed
        self.stats.prefix_compressed_bytes += nbytes
        self._loader = threading.Thread(
            target=self._load_full_tier, args=(cache, prefix_ids), name="vericache-prefix-loader", daemon=True
        )
        self._load_started = time.perf_counter()  # before the thread runs: keep_drafting may ask at once
        self._loader.start()
        return True

    def _load_full_tier(self, cache: VeriCache, prefix_ids: torch.Tensor) -> None:
        """The loader thread: append each layer's prefix to its host full tier as it arrives, layer by layer, and
        tell the cache, so that a verify pass can run behind the load."""
        in_background(self.model.get_input_embeddings().weight.device)
        length, rows = prefix_ids.shape[-1], prefix_ids.shape[0]
        # this thread's own CPU time: what the load takes from drafting on a small CPU
        cpu_started = time.thread_time()
        try:
            for layer, keys, values, nbytes in self.prefixes.iter_layers(prefix_ids[:1], self.full_print):
                if self._cancel.is_set():
                    return
                cache.layers[layer].full.append(_rows(keys, rows), _rows(values, rows))
                self.stats.prefix_full_bytes += nbytes
                if keys.shape[-2] < length:  # this layer's run is short: the rest is recomputed
                    return
                cache.prefix_load.layer_loaded(layer)
                self._layers_done += 1
                self._last_layer_at = time.perf_counter()
        except BaseException as error:  # reported by wait_full_tier, on the caller's thread
            self._error = error
        finally:
            self.stats.prefix_load_seconds += time.perf_counter() - self._load_started
            self.stats.prefix_load_cpu_seconds += time.thread_time() - cpu_started
            cache.prefix_load.loading_stopped()

    def keep_drafting(self, first_pass_seconds: float, width: int, drafted: int) -> bool:
        """Whether to draft (on) while the full prefix loads: while the layers still to come take longer to arrive
        than the next pass and the verify pass will take, so that the verify pass, which reads each layer as it
        arrives, ends just after the last one and the first token is never later for drafting.

        Times are measured and scaled by the work of each pass (weights per token, attention per token and
        context): a pass's time from the draft tier's first pass over the `width` suffix tokens, or before that
        from the last call on this model; the load's from the layers that arrived, or before that from the link
        speed the compressed fetch saw."""
        if self.full_tier_ready():
            return False
        per_work = first_pass_seconds / self._work(width, self._draft_tokens) if first_pass_seconds else None
        if per_work is not None:
            _SECONDS_PER_WORK[self.model] = per_work  # the prior for the next call's first decision
        per_work = per_work or _SECONDS_PER_WORK.get(self.model)
        if per_work is None:  # nothing measured yet on this model: draft, and measure
            return True
        now = time.perf_counter()
        if self._layers_done:  # the layers to come at the pace so far, less what the next one has had
            per_layer = (self._last_layer_at - self._load_started) / self._layers_done
            left = self.full_print.num_layers - self._layers_done
            remaining = per_layer * left - min(now - self._last_layer_at, per_layer)
        else:
            remaining = self._full_bytes() / self._bytes_per_second - (now - self._load_started)
        verify = per_work * self._work(width + drafted + 1, self._prefix_tokens)
        # the next pass: the suffix block first, then one token after the suffix and the drafts so far
        next_pass = per_work * (
            self._work(1, self._draft_tokens + width + drafted)
            if drafted
            else self._work(width, self._draft_tokens)
        )
        return remaining > next_pass + verify

    def _full_bytes(self) -> int:
        fp = self.full_print
        per_token = fp.num_layers * 2 * fp.num_kv_heads * fp.head_dim * self.model.dtype.itemsize
        return self._prefix_tokens * per_token

    def _work(self, width: int, context: int) -> float:
        """Multiply-adds of a pass of `width` tokens after `context` cached ones: weights, then attention."""
        return width * (self._weights + self._attention * (context + width / 2))

    def close(self) -> None:
        """Stop a loader that is still running (decoding ended early, by an error); nothing waits for it."""
        self._cancel.set()

    def full_tier_ready(self) -> bool:
        return self._loader is None or not self._loader.is_alive()

    def wait_full_tier(self, cache: VeriCache, prefix_ids: torch.Tensor) -> None:
        """Wait for the chunks still on their way (at most `timeout`), recompute any that did not come, and let
        verify passes read the full tier."""
        if self._loader is None:
            return
        started = time.perf_counter()
        self._loader.join(self.timeout)
        if self._loader.is_alive():  # the store stalls: stop appending, and recompute what is missing
            self._cancel.set()
            self._loader.join()
        self.stats.prefix_wait_seconds += time.perf_counter() - started
        self._loader = None
        length = prefix_ids.shape[-1]
        loaded = min(layer.full.length for layer in cache.layers)
        if loaded < length:
            why = f"{type(self._error).__name__}: {self._error}" if self._error else "missing or refused"
            warnings.warn(
                f"vericache prefix store: {length - loaded} of {length} prefix tokens did not load ({why}); "
                "recomputing them",
                stacklevel=4,
            )
            self._recompute(cache, prefix_ids)
        cache.prefix_load.finish()
        self.stats.prefix_tokens_reused += loaded

    @torch.no_grad()  # not inference mode: the full tier's buffers must stay writable by later commits
    def _recompute(self, cache: VeriCache, prefix_ids: torch.Tensor) -> None:
        """The exact K/V of the prefix tokens the loader did not append, by a stock forward over them."""
        start = min(layer.full.length for layer in cache.layers)
        for layer in cache.layers:
            layer.full.truncate(start)
        device = self.model.get_input_embeddings().weight.device
        seen = [tuple(t.to(device) for t in layer.full.view()) for layer in cache.layers] if start else None
        computed = DynamicCache(ddp_cache_data=seen)
        self.model(
            input_ids=prefix_ids[:, start:].to(device),
            position_ids=torch.arange(start, prefix_ids.shape[-1], device=device)[None],
            **cache_kwargs(self.model, computed),
            use_cache=True,
            logits_to_keep=1,
        )
        for layer, kv in zip(cache.layers, computed.layers, strict=True):
            layer.full.append(kv.keys[:, :, start:], kv.values[:, :, start:])

    # -- saving ----------------------------------------------------------------------------------------------------
    def save(self, cache: VeriCache, prefix_ids: torch.Tensor) -> None:
        """Queue the prefilled prefix (full tier and compressed draft tier) for the store's writer thread."""
        length = prefix_ids.shape[-1]  # every row holds the same prompt: row 0 is saved
        full = [
            (layer.full.keys[:1, :, :length], layer.full.values[:1, :, :length]) for layer in cache.layers
        ]
        if not cache.draft_tier.held:  # the prefill deferred it: the store keeps the compressed prefix too
            cache.draft_tier.build()
        state = {}
        for i, layer in enumerate(cache.layers):
            state.update({f"layer.{i}.{name}": _narrow(t[:1]) for name, t in layer.draft.export().items()})
        ids = prefix_ids[0].detach().cpu()

        device = cache.layers[0].device

        def job() -> None:
            in_background(device)  # the store's writer thread
            self.prefixes.save(ids, full, self.full_print)
            self.prefixes.save_state(ids, state, self.draft_print, "draft")

        write_behind(self.prefixes.store, job)


def _rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A stored (1, ...) tensor for a batch of `rows` copies of one prompt (a view)."""
    return tensor.expand(rows, *tensor.shape[1:])


def _narrow(tensor: torch.Tensor) -> torch.Tensor:
    """A draft-tier tensor as stored: float32 and float64 in bfloat16. The draft tier only drafts (the full tier
    verifies), and half the bytes is half the wait before the first draft on a slow link."""
    return tensor.to(torch.bfloat16) if tensor.is_floating_point() and tensor.dtype.itemsize > 2 else tensor


def _stored_type(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The type a stored draft-tier tensor is restored in: floats in the model's, anything else its own."""
    return dtype if tensor.is_floating_point() else tensor.dtype


def _layer(name: str) -> int:
    """The layer index of a `layer.<i>.<name>` tensor of a draft entry."""
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "layer" or not parts[1].isdigit():
        raise KeyError(f"unexpected tensor {name!r} in a draft entry")
    return int(parts[1])
