"""Prompt lookup decoding: draft the continuation of the latest earlier n-gram match."""
from __future__ import annotations

import torch

from ..tree import TokenTree
from .base import Draft, Drafter, StepResult, register, root_only
from .length import AdaptiveDraftLength


@register
class PromptLookup(Drafter):
    """Deterministic n-gram lookup over prompt + output (Saxena 2023; HF ``prompt_lookup_num_tokens``).

    The last ``n`` committed tokens (n from max_ngram down to min_ngram) are searched for in
    the earlier text; the tokens that followed the most recent match are the draft. No match →
    no draft (a plain step). The length adapts to recent acceptance (AdaptiveDraftLength), and
    a longer matched n-gram is trusted more (its α gets a bonus per matched token).
    """

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft_tokens: int = 10,
                 cost_per_token: float = 0.1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_draft_tokens = max_draft_tokens
        self.length = AdaptiveDraftLength(cost_per_token=cost_per_token)
        self._last_drafted = 0

    def begin(self, start) -> None:
        self.length.reset()

    def find(self, ids: torch.Tensor, max_tokens: int) -> tuple[list[int], int]:
        """ids LongTensor [T] → (continuation of the latest longest n-gram match, n)."""
        seq = ids.tolist()
        total = len(seq)
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            tail = seq[total - n:]
            # latest earlier occurrence whose continuation is non-empty
            for start in range(total - n - 1, -1, -1):
                if seq[start:start + n] == tail:
                    return seq[start + n:start + n + max_tokens], n
        return [], 0

    def propose(self, committed, max_tokens, sampling, generator) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("PromptLookup drafts one sequence at a time")
        limit = min(max_tokens, self.max_draft_tokens)
        self._last_drafted = 0
        if limit <= 0:
            return root_only(committed)
        continuation, n = self.find(committed[0], limit)
        if not continuation:
            return root_only(committed)
        # A longer match is stronger evidence: shrink the distance to α = 1 per extra matched token.
        alpha = 1.0 - (1.0 - self.length.alpha) * 0.7 ** (n - 1)
        k = min(self.length.choose(len(continuation), alpha), len(continuation))
        if k == 0:
            return root_only(committed)
        self._last_drafted = k
        tokens = torch.cat([committed[:, -1:], committed.new_tensor([continuation[:k]])], dim=1)
        return Draft(tokens=tokens, tree=TokenTree.chain(k), q_probs=None)

    def observe(self, step: StepResult) -> None:
        self.length.update(self._last_drafted, step.accepted_len)
