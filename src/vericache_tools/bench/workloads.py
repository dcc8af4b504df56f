"""Bench workloads: long prompts of a chosen kind, context length and batch size, tokenized once.

Three kinds, all built from data that ships locally (`vericache_tools.prompts`): `code` (a HumanEval problem behind a
long stretch of real source code), `qa` (a question about a function in long library documentation) and `tool` (the
same documentation as a tool catalogue, answered with a short JSON tool call: structured output, where drafts are
often rejected and answers end early).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("code", "qa", "tool")


@dataclass
class PromptBatch:
    """One batch of prompts, left-padded: what a single `generate` call receives."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    problems: list[dict | None] = field(default_factory=list)  # the HumanEval problem of each row (code only)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class Workload:
    """All batches of one kind, context length and batch size."""

    kind: str
    context_tokens: int
    batch_size: int
    batches: list[PromptBatch]

    @property
    def name(self) -> str:
        """E.g. `code-8k-b4`; a context cut to fit the model's positions (8064 of 8192) keeps its rounded name."""
        size = (
            f"{round(self.context_tokens / 1024)}k"
            if self.context_tokens >= 1024
            else str(self.context_tokens)
        )
        return f"{self.kind}-{size}-b{self.batch_size}"

    @property
    def num_prompts(self) -> int:
        return sum(batch.batch_size for batch in self.batches)


def _texts(tokenizer: Any, kind: str, context_tokens: int, count: int, first_problem: int):
    from ..prompts import (
        humaneval_problems,
        long_code_prompt,
        long_document_qa_prompt,
        long_document_tool_prompt,
    )

    if kind == "code":
        problems = humaneval_problems()[first_problem : first_problem + count]
        return [long_code_prompt(tokenizer, p, context_tokens) for p in problems], problems
    # One document per length: shorten each further prompt a little, so rows differ.
    build = long_document_tool_prompt if kind == "tool" else long_document_qa_prompt
    texts = [build(tokenizer, context_tokens - 48 * i) for i in range(count)]
    return texts, [None] * count


#: Where rows lose tokens to match the shortest: inside the filler (source code or documentation), which starts
#: right after the chat template's header in both kinds of prompt.
TRIM_AT = 64


def tokenize_batch(tokenizer: Any, texts: list[str], problems: list[dict | None]) -> PromptBatch:
    """Token ids of `texts`, all of one length: longer rows drop a few filler tokens (at `TRIM_AT`) to match the
    shortest, so the batch needs no padding (left padding only for prompts too short to trim). Stock prefill of a
    padded batch takes sdpa's masked path, which on a CPU materializes (B, H, L, L) scores: minutes at 8k tokens."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
        shortest = min(len(row) for row in rows)
        if shortest > 2 * TRIM_AT:
            rows = [row[:TRIM_AT] + row[TRIM_AT + len(row) - shortest :] for row in rows]
        encoded = tokenizer.pad({"input_ids": rows}, return_tensors="pt")
    finally:
        tokenizer.padding_side = side
    return PromptBatch(encoded["input_ids"], encoded["attention_mask"], list(problems))


def build_workloads(
    tokenizer: Any,
    kinds: list[str],
    context_tokens: list[int],
    batch_sizes: list[int],
    num_prompts: int,
    first_problem: int = 0,
    max_positions: int | None = None,
    max_new_tokens: int = 0,
) -> list[Workload]:
    """Every (kind, context, batch size) combination; each holds `num_prompts` prompts rounded up to whole batches.

    With `max_positions` (the model's `max_position_embeddings`), a context that would leave no room for
    `max_new_tokens` is shortened to fit: SmolLM2's "8k" is 8192 positions, prompt and answer together."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"Unknown workload kind(s) {unknown}; choose from {KINDS}.")
    for name, values in (("context_tokens", context_tokens), ("batch_sizes", batch_sizes)):
        if not values or any(v < 1 for v in values):
            raise ValueError(f"{name} must be a non-empty list of positive integers, got {values!r}.")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be positive, got {num_prompts}.")
    if max_positions is not None and max_positions - max_new_tokens < 1:
        raise ValueError(
            f"max_new_tokens ({max_new_tokens}) leaves no room for a prompt within the model's {max_positions} "
            "positions; ask for fewer new tokens."
        )
    workloads = []
    for kind in kinds:
        for requested in context_tokens:
            context = requested if max_positions is None else min(requested, max_positions - max_new_tokens)
            for batch in batch_sizes:
                count = -(-num_prompts // batch) * batch
                texts, problems = _texts(tokenizer, kind, context, count, first_problem)
                batches = [
                    tokenize_batch(tokenizer, texts[i : i + batch], problems[i : i + batch])
                    for i in range(0, count, batch)
                ]
                workloads.append(Workload(kind, context, batch, batches))
    return workloads
