"""A `VeriCacheProposer` with faults injected for chosen requests, and its counts written to a file after every
step, for tests/test_vllm.py (it runs inside vLLM's engine process, so it is imported by name).

`VERICACHE_TEST_FAULTS` names a JSON file: `{"settings": {...}, "build": [[ids...]], "draft": [[ids...]],
"stats": "<path>"}`. A request whose tokens start with a `build` prefix fails when its draft tier is built; one
with a `draft` prefix fails at its first drafting round, and so does any batched round it is part of.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vericache_hf.vllm.proposer import VeriCacheProposer

FAULTS = json.loads(Path(os.environ["VERICACHE_TEST_FAULTS"]).read_text())


def _starts(tokens: list[int], prefixes: list[list[int]]) -> bool:
    return any(tokens[: len(prefix)] == prefix for prefix in prefixes)


class FaultyProposer(VeriCacheProposer):
    settings = FAULTS["settings"]

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        book = self.book
        build, draft_rows, self.built = book.build, book.draft_rows, 0
        faulty: set[int] = set()  # the states of `draft` requests

        def faulty_build(tokens, row):
            if _starts(tokens, FAULTS["build"]):
                raise RuntimeError("injected build fault")
            state = build(tokens, row)
            self.built += 1
            if _starts(tokens, FAULTS["draft"]):
                faulty.add(id(state))
            return state

        def faulty_draft_rows(states, rows, lengths):
            if any(id(state) in faulty for state in states):
                raise RuntimeError("injected draft fault")
            return draft_rows(states, rows, lengths)

        book.build, book.draft_rows = faulty_build, faulty_draft_rows

    def propose(self, *args, **kwargs):
        drafts = super().propose(*args, **kwargs)
        book = self.book
        stats = {
            "built": self.built,
            "failed_rows": book.failed_rows,
            "rounds": book.rounds,
            "drafted": book.drafted,
            "kept": book.kept,
            "prefilled_tokens": self.prefilled_tokens,
            "runner_kv": self.runner_kv is not None and self.runner_kv.usable,
        }
        with open(FAULTS["stats"] + ".tmp", "w") as file:
            json.dump(stats, file)
        os.replace(FAULTS["stats"] + ".tmp", FAULTS["stats"])
        return drafts
