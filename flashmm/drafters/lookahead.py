"""Lookahead decoding (Fu et al. 2024, arXiv 2402.02057): Jacobi iteration feeding an n-gram pool.

Each verification forward carries, besides the candidates, a *lookahead branch* as auxiliary
rows (Draft.aux): a window of N-1 levels × W columns of guessed tokens. Level l, column j sits
at position root + 1 + l + j and sees the root, level 0's columns 0..j, then levels 1..l of
column j: a chain of consecutive positions, so the window is a tree hung under the root. The
target's argmax at the last level's rows is one Jacobi step: it becomes the newest level (the
oldest is dropped), and each column's trajectory (level 0 .. level N-2, new token) is an
N-gram for the pool, keyed by its first token. The *verification branch* drafts up to G pool
n-grams that start with the root token, merged into one trie (shared prefixes verified once).

On a CPU every row costs: the pool is also fed the N-grams of the prompt and output (what
prompt lookup finds), and the window rides only on forwards whose candidates pay for
themselves and for it (TreeSizer with the window's rows in the cost); otherwise the step is
plain or verifies the candidates alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree.cost import AdaptiveDraftLength, price_with_target
from ..tree.draft import AuxRows
from ..tree.trie import DraftTrie, TreeSizer
from .base import Drafter, StepResult, register, root_only
from .options import DrafterOptions


@dataclass(frozen=True)
class LookaheadOptions(DrafterOptions):
    """Lookahead's options (see the class); merge: verify the candidates as one trie (shared prefixes
    once); seed: the generator of the window's first guesses."""

    window: int = 4
    ngram: int = 4
    candidates: int = 4
    pool_size: int = 8
    seed_from_context: bool = True
    always_window: bool = False
    merge: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.window < 1 or self.ngram < 2 or self.candidates < 1:
            raise ValueError(f"need window >= 1, ngram >= 2, candidates >= 1; got {self.window}, {self.ngram}, "
                             f"{self.candidates}")


@register
class Lookahead(Drafter):
    """window W, ngram N (n-gram size, N-1 window levels), candidates G (verified n-grams),
    pool_size: n-grams kept per first token (most recent first). always_window=True runs the
    window in every forward, as the paper does (also on steps without candidates).

    Options: LookaheadOptions, as keywords or ``options=``; ``cost``: the TreeSizer's cost model."""

    name = "lookahead"

    def __init__(self, cost: AdaptiveDraftLength | None = None, options: LookaheadOptions | None = None, **given):
        self._options = o = LookaheadOptions.build(type(self).__name__, given, options)
        self.window, self.ngram, self.candidates, self.pool_size = o.window, o.ngram, o.candidates, o.pool_size
        self.seed_from_context, self.merge, self.seed = o.seed_from_context, o.merge, o.seed
        self.always_window = o.always_window
        self.sizer = TreeSizer(cost=cost)
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.levels: list[list[int]] = []    # N-1 levels of W guessed tokens
        self.hits = [0.0] * o.ngram          # per depth: accepted / drafted, for candidate scores
        self.tries = [0.0] * o.ngram
        self._seen = 0
        self._drafted: list[int] = []        # depth of each drafted node (draft order, root excluded)
        self._window_on = False
        self._tree_nodes = 0

    @property
    def aux_rows(self) -> int:
        return (self.ngram - 1) * self.window

    def _fresh_tokens(self, count: int) -> list[int]:
        picks = torch.randint(len(self._context), (count,), generator=self._rng).tolist()
        return [self._context[i] for i in picks]

    def cost_models(self) -> list:
        return [self.sizer.cost]

    def bind(self, target) -> None:
        if self.pricing == "measured":
            self.cost_source = price_with_target(target, self.cost_models())

    def begin(self, start) -> None:
        self._context = start.input_ids[0].tolist()
        self._rng = torch.Generator().manual_seed(self.seed)
        self.levels = [self._fresh_tokens(self.window) for _ in range(self.ngram - 1)]
        self._seen = 0
        self.sizer.reset()
        self._add_context_ngrams(self._context)

    def _remember(self, gram: list[int]) -> None:
        key, rest = gram[0], tuple(gram[1:])
        known = self.pool.setdefault(key, [])
        if rest in known:
            known.remove(rest)
        known.insert(0, rest)
        del known[self.pool_size:]

    def _add_context_ngrams(self, ids: list[int]) -> None:
        """Pool the N-grams of committed text not pooled yet (when seed_from_context)."""
        n = self.ngram
        if self.seed_from_context:
            for i in range(max(0, self._seen - n + 1), len(ids) - n + 1):
                self._remember(ids[i : i + n])
        self._seen = len(ids)

    def propose(self, committed, max_tokens, sampling, generator):
        if committed.shape[0] != 1:
            raise NotImplementedError("Lookahead drafts one sequence at a time")
        ids = committed[0].tolist()
        self._context = ids
        self._add_context_ngrams(ids)
        self._drafted, self._window_on = [], False
        trie = DraftTrie(merge=self.merge)
        for rank, gram in enumerate(self.pool.get(ids[-1], [])[: self.candidates]):
            scores = [(self.hits[d] + 0.5 ** d) / (self.tries[d] + 1) / (1 + rank) for d in range(1, len(gram) + 1)]
            trie.add(list(gram), scores, group=rank)
        limit = max_tokens
        position = committed.shape[1]
        keep = self.sizer.choose(trie, limit, extra_rows=0 if self.always_window else self.aux_rows,
                                 position=position if self.always_window else None)
        self._window_on = bool(keep) or self.always_window
        if not keep and not self.always_window:
            keep = self.sizer.choose(trie, limit, position=position)
        if not keep and not self._window_on:
            return root_only(committed)
        draft = trie.to_draft(committed[:, -1:], keep)
        depth = draft.tree.depth.tolist()
        self._drafted = depth[1:]
        self._tree_nodes = draft.tree.num_nodes
        if self._window_on:
            draft.aux = self._window_rows(draft.tree.num_nodes, committed)
        return draft

    def _window_rows(self, n: int, committed: torch.Tensor) -> AuxRows:
        """The window as aux rows after the n tree nodes (row of level l, column j: n + l·W + j)."""
        w = self.window
        parents = []
        for level in range(self.ngram - 1):
            for col in range(w):
                if level == 0:
                    parents.append(0 if col == 0 else n + col - 1)
                else:
                    parents.append(n + (level - 1) * w + col)
        tokens = committed.new_tensor([[t for level in self.levels for t in level]])
        return AuxRows(tokens=tokens, parents=torch.tensor(parents))

    def observe(self, step: StepResult) -> None:
        self.sizer.update(step.accepted_len if self._drafted else 0, step.committed)
        accepted = step.accepted_len
        for d in self._drafted:
            self.tries[d] = 0.95 * self.tries[d] + 1
            self.hits[d] = 0.95 * self.hits[d] + (d <= accepted)
        if step.aux_logits is None:
            return
        w, last = self.window, self.ngram - 2
        guesses = step.aux_logits[0, last * w :].argmax(-1).tolist()  # the last level's Jacobi step
        for col in range(w):
            self._remember([self.levels[level][col] for level in range(self.ngram - 1)] + [guesses[col]])
        self.levels = self.levels[1:] + [guesses]
        if accepted:  # the root moved accepted + 1 positions: realign the columns by the extra ones
            self.levels = [level[accepted:] + self._fresh_tokens(min(accepted, w)) for level in self.levels]
            self.levels = [level[:w] for level in self.levels]
