"""VeriCache in vLLM: a speculative proposer that drafts on a compressed KV cache; vLLM verifies against its own.

    from vllm import LLM
    from vericache_hf import VeriCacheConfig
    from vericache_hf.vllm import speculative_config

    llm = LLM(model, speculative_config=speculative_config(VeriCacheConfig(compressor="snapkv")))

Importing this package does not import vLLM; vLLM imports `proposer.py` in its engine process.
"""

from .book import DraftBook, Pacing
from .draft import DraftState
from .proposer import VeriCacheProposer, speculative_config

__all__ = ["DraftBook", "DraftState", "Pacing", "VeriCacheProposer", "speculative_config"]
