"""Prompt lookup decoding: draft the continuation of the latest earlier n-gram match."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree.cost import AdaptiveDraftLength, price_with_target
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .base import Drafter, StepResult, register, root_only
from .options import DrafterOptions, check_at_least


def ngram_continuation(ids: list[int], max_tokens: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """(continuation of the latest, longest n-gram match of the tail of ids, n), or ([], 0).

    The continuation is copied as an overlapping (LZ77-style) copy: when it reaches the end
    of ``ids`` it goes on copying the tokens it has just produced, so text repeating with
    period p drafts up to ``max_tokens`` tokens, not just p."""
    total = len(ids)
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        tail = ids[total - n:]
        first = tail[0]
        for start in range(total - n - 1, -1, -1):  # latest match with a non-empty continuation
            if ids[start] == first and ids[start:start + n] == tail:
                period = total - n - start
                return [ids[start + n + i % period] for i in range(max_tokens)], n
    return [], 0


class NgramIndex:
    """``ngram_continuation`` for a text that only grows, in O(new tokens) per step.

    For every n in [min_ngram, max_ngram] a dict maps each n-gram that has a following token to its
    latest start; ``sync(committed)`` appends only the tokens it has not seen (the first call, or a
    text that does not extend the one indexed, rebuilds), ``continuation`` looks the tail up in
    O(max_ngram) instead of rescanning the text."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.ids: list[int] = []
        self.starts = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def sync(self, committed: torch.Tensor) -> None:
        """Index committed [1, T] (a view of the engine's committed tokens: only the tail is read)."""
        known = len(self.ids)
        if known == 0 or committed.shape[1] < known or int(committed[0, known - 1]) != self.ids[-1]:
            self.ids, self.starts = [], {n: {} for n in self.starts}
            known = 0
        new = committed[0, known:].tolist()
        for token in new:
            self.ids.append(token)
            end = len(self.ids) - 1  # the n-gram just before the new token now has a continuation
            for n, table in self.starts.items():
                if end >= n:
                    table[tuple(self.ids[end - n:end])] = end - n

    def continuation(self, max_tokens: int) -> tuple[list[int], int]:
        ids, total = self.ids, len(self.ids)
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            start = self.starts[n].get(tuple(ids[total - n:]))
            if start is not None:
                period = total - n - start
                return [ids[start + n + i % period] for i in range(max_tokens)], n
        return [], 0


@dataclass(frozen=True)
class PromptLookupOptions(DrafterOptions):
    """max_ngram / min_ngram: the longest and shortest tail of the committed text searched for;
    max_draft_tokens: most drafted tokens per step (the continuation's length at most)."""

    max_ngram: int = 3
    min_ngram: int = 1
    max_draft_tokens: int = 10

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        check_at_least(self, 0, "max_draft_tokens")


@register
class PromptLookup(Drafter):
    """Deterministic n-gram lookup over prompt + output (Saxena 2023; HF ``prompt_lookup_num_tokens``).

    The last n committed tokens (n from max_ngram down to min_ngram) are searched for in the
    earlier text; the tokens that followed the most recent match are the draft. No match → no
    draft (a plain step). How far to trust a match is learned per matched length n: each n has
    its own acceptance estimate (AdaptiveDraftLength, prior favouring longer matches), which picks
    the draft length, or no draft when drafting would not pay for its verification.

    Options: PromptLookupOptions, as keywords or ``options=``; ``length``: the template of the
    per-n AdaptiveDraftLength (its costs and prior).
    """

    name = "prompt_lookup"

    def __init__(self, length: AdaptiveDraftLength | None = None, options: PromptLookupOptions | None = None,
                 **given):
        self._options = PromptLookupOptions.build(type(self).__name__, given, options)
        self.max_ngram, self.min_ngram = self.options.max_ngram, self.options.min_ngram
        self.max_draft_tokens = self.options.max_draft_tokens
        template = length or AdaptiveDraftLength()
        # prior acceptance 1/4 for a 1-gram match, 1/3 for 2-grams, 1/2 from 3-grams on
        self.lengths = {n: AdaptiveDraftLength(**{**template.__dict__, "prior_reject": max(1.0, 4.0 - n)})
                        for n in range(self.min_ngram, self.max_ngram + 1)}
        self._last = (0, 0)  # (matched n, drafted tokens) of the last proposal
        self._index = NgramIndex(self.max_ngram, self.min_ngram)

    def cost_models(self) -> list:
        return list(self.lengths.values())

    def bind(self, target) -> None:
        if self.pricing == "measured":
            self.cost_source = price_with_target(target, self.cost_models())

    def begin(self, start) -> None:
        for length in self.lengths.values():
            length.reset()
        self._index = NgramIndex(self.max_ngram, self.min_ngram)

    def find(self, ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        """(continuation of the latest, longest n-gram match of the tail of ids, n); see ngram_continuation."""
        return ngram_continuation(ids, max_tokens, self.max_ngram, self.min_ngram)

    def propose(self, committed, max_tokens, sampling, generator) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("PromptLookup drafts one sequence at a time")
        self._last = (0, 0)
        limit = min(max_tokens, self.max_draft_tokens)
        if limit <= 0:
            return root_only(committed)
        self._index.sync(committed)
        continuation, n = self._index.continuation(limit)
        k = self.lengths[n].choose(len(continuation)) if continuation else 0
        if k == 0:
            return root_only(committed)
        self._last = (n, k)
        tokens = torch.cat([committed[:, -1:], committed.new_tensor([continuation[:k]])], dim=1)
        values = torch.full((k + 1,), self.lengths[n].alpha).pow_(torch.arange(k + 1))  # α^depth
        return Draft(tokens=tokens, tree=TokenTree.chain(k), q_probs=None, values=values)

    def cut(self, draft: Draft, nodes: int) -> Draft:
        self._last = (self._last[0], nodes - 1)  # acceptance is learned from the tokens verified
        return draft.head(nodes)

    def observe(self, step: StepResult) -> None:
        n, drafted = self._last
        for m, length in self.lengths.items():
            length.update(drafted if m == n else 0, step.accepted_len if m == n else 0)
