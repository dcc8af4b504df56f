"""A control proposer for the sampling check: every row that sampled a token gets the same drafts, given in the
JSON list `VERICACHE_TEST_FIXED_DRAFTS`. Its drafts come from no model and no cache, so whether vLLM keeps the
sampled distribution under it is vLLM's own rejection sampling, with nothing of VeriCache in it."""

from __future__ import annotations

import json
import os
from typing import Any


class FixedDrafts:
    def __init__(self, vllm_config: Any) -> None:
        drafts = json.loads(os.environ["VERICACHE_TEST_FIXED_DRAFTS"])
        self.drafts = drafts[: vllm_config.speculative_config.num_speculative_tokens]

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass

    def propose(self, sampled_token_ids: list[list[int]], *args: Any, **kwargs: Any) -> list[list[int]]:
        return [list(self.drafts) if sampled else [] for sampled in sampled_token_ids]
