"""Proposers for hierarchical drafting: a cheap source of candidate tokens that the draft tier checks many at a time.

Classic speculative decoding's proposers, wrapped per row so that rows of a batch may keep different numbers of
tokens (transformers' own assisted decoding is batch 1 only): prompt lookup (n-gram matches in the prefix, no second
model) and an assistant model sharing the tokenizer. Both reuse transformers' candidate generators. A proposer is
built per `generate` call and is never shared between calls or threads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from transformers import GenerationConfig
from transformers.generation.candidate_generator import (
    AssistedCandidateGenerator,
    PromptLookupCandidateGenerator,
)


class Proposer(ABC):
    """Suggests up to `limit` tokens to follow a row's prefix. Proposals are a deterministic function of the
    prefix, which is what keeps sampling exact (see `verify.proposal_accept`)."""

    #: Most tokens one proposal offers.
    max_tokens: int

    @abstractmethod
    def propose(self, row: int, prefix: torch.Tensor, limit: int) -> torch.Tensor:
        """Up to `limit` (>= 1) token ids (1-D) to follow `prefix` (1-D, the row's tokens without padding)."""


class PromptLookupProposer(Proposer):
    """transformers' prompt lookup: the tokens that followed the last n-gram's earlier occurrence in the prefix.

    Only a match of at least `MIN_NGRAM_SIZE` tokens proposes: on the embedded model's code and QA prompts (2k
    tokens, greedy continuations), a one-token match kept 0.2-0.4 of its 10 tokens where a two-token match kept 3-4,
    and at batch > 1 a row's junk proposals widen the whole pass. Without `max_matching_ngram_size`, matches of up to
    `DEFAULT_MAX_NGRAM_SIZE` tokens are tried first (more kept than transformers' 2, in both kinds)."""

    MIN_NGRAM_SIZE = 2
    DEFAULT_MAX_NGRAM_SIZE = 3

    def __init__(
        self, num_tokens: int, max_ngram_size: int | None, eos_token_id: torch.Tensor | None
    ) -> None:
        self.max_tokens = num_tokens
        max_ngram_size = max_ngram_size or self.DEFAULT_MAX_NGRAM_SIZE
        self.min_ngram_size = min(self.MIN_NGRAM_SIZE, max_ngram_size)
        self.lookup = PromptLookupCandidateGenerator(
            eos_token_id=eos_token_id,
            num_output_tokens=num_tokens,
            max_matching_ngram_size=max_ngram_size,
            max_length=2**62,  # the loop bounds every proposal by the room left
        )

    def propose(self, row: int, prefix: torch.Tensor, limit: int) -> torch.Tensor:
        if not self._matches_earlier(prefix, self.min_ngram_size):
            return prefix.new_empty(0)
        self.lookup.num_output_tokens = min(limit, self.max_tokens)
        candidates, _ = self.lookup.get_candidates(prefix[None])
        return candidates[0, prefix.shape[-1] :]

    @staticmethod
    def _matches_earlier(prefix: torch.Tensor, size: int) -> bool:
        """Whether the prefix's last `size` tokens occur earlier with a token after them, that is, whether
        transformers' lookup will match at least `size` tokens (it falls back to shorter matches otherwise)."""
        if prefix.shape[-1] <= size:
            return False
        windows = prefix[:-1].unfold(0, size, 1)  # every window that a token follows
        return bool((windows == prefix[-size:]).all(-1).any())


class AssistantProposer(Proposer):
    """A small causal LM drafting greedily, through one transformers `AssistedCandidateGenerator` per row, each with
    its own cache. Greedy proposals are a function of the prefix, so sampling stays exact."""

    def __init__(self, assistant_model, num_tokens: int, generation_config: GenerationConfig) -> None:
        self.assistant_model = assistant_model
        self.max_tokens = num_tokens
        self.generation_config = GenerationConfig(  # greedy proposals, whatever the call samples
            do_sample=False,
            min_length=0,
            max_length=2**62,  # the loop bounds every proposal by the room left
            eos_token_id=generation_config.eos_token_id,
            pad_token_id=generation_config.pad_token_id,
        )
        self.rows: dict[int, AssistedCandidateGenerator] = {}
        self.seen: dict[int, torch.Tensor] = {}  # the tokens each row's assistant cache was built from

    def propose(self, row: int, prefix: torch.Tensor, limit: int) -> torch.Tensor:
        prefix = prefix.to(self.assistant_model.device)
        generator = self.rows.get(row)
        if generator is None:
            generator = self.rows[row] = AssistedCandidateGenerator(
                input_ids=prefix[None],
                assistant_model=self.assistant_model,
                generation_config=self.generation_config,
                model_kwargs={},
            )
        else:
            self._forget_divergence(generator, self.seen[row], prefix)
        generator.num_assistant_tokens = min(limit, self.max_tokens)
        candidates, _ = generator.get_candidates(prefix[None])
        self.seen[row] = candidates[0]
        return candidates[0, prefix.shape[-1] :]

    @staticmethod
    def _forget_divergence(
        generator: AssistedCandidateGenerator, seen: torch.Tensor, prefix: torch.Tensor
    ) -> None:
        """transformers' generator trusts its cache up to two tokens before the new prefix ends, which holds in
        assisted decoding; here a draft the full tier rejected may sit earlier, so crop where the prefixes part."""
        cache = generator.assistant_kwargs.get("cache")
        if cache is None:
            return
        shared = min(seen.shape[-1], prefix.shape[-1])
        differs = (seen[:shared] != prefix[:shared]).nonzero()
        common = int(differs[0, 0]) if differs.numel() else shared
        if (extra := cache.get_seq_length() - common) > 0:
            cache.crop(-extra)


def build_proposer(
    proposer, num_tokens: int, generation_config: GenerationConfig, assistant_model=None
) -> Proposer | None:
    """The proposer a call asked for: `assistant_model`, `prompt_lookup_num_tokens`, or `VeriCacheConfig.proposer`
    ("prompt_lookup", or an assistant model). None drafts with the draft tier alone."""
    lookup_tokens = generation_config.prompt_lookup_num_tokens
    asked = [
        name
        for name, given in (
            ("assistant_model", assistant_model is not None),
            ("prompt_lookup_num_tokens", lookup_tokens is not None),
            ("VeriCacheConfig.proposer", proposer is not None),
        )
        if given
    ]
    if len(asked) > 1:
        raise ValueError(
            f"Hierarchical drafting takes one proposer, but {' and '.join(asked)} were both given; keep one of them."
        )
    if lookup_tokens is not None or proposer == "prompt_lookup":
        return PromptLookupProposer(
            lookup_tokens or num_tokens,
            generation_config.max_matching_ngram_size,
            generation_config._eos_token_tensor,
        )
    assistant = assistant_model if assistant_model is not None else proposer
    if assistant is None:
        return None
    if not hasattr(assistant, "generate"):
        raise TypeError(
            f"VeriCacheConfig.proposer must be 'prompt_lookup' or an assistant model (a transformers causal LM), "
            f"got {assistant!r}."
        )
    return AssistantProposer(assistant, num_tokens, generation_config)
