"""A drafter that knows the reference continuation, for exactness tests of tree verification."""
from __future__ import annotations

import torch

from flashmm.drafters import Drafter, SequenceStart
from flashmm.drafters.base import root_only
from flashmm.tree.draft import Draft
from flashmm.tree.token_tree import TokenTree


class OracleTree(Drafter):
    """Knows the reference continuation and drafts 3-wide trees whose correct token is the
    middle child at every depth, so accepted paths run through non-first branches; every third
    step the depth-2 level is wrong, so a partial path is accepted. Optionally asks for hidden
    states (to exercise prompt_features inside the engine) and records what it was told."""

    def __init__(self, reference: torch.Tensor, depth: int = 3, needs_hidden: bool = False):
        self.reference = reference[0].tolist()
        self.depth = depth
        self.needs_hidden_states = needs_hidden
        self.vocab = None
        self.starts: list[SequenceStart] = []
        self.steps = 0

    def bind(self, target):
        self.vocab = target.vocab_size

    def begin(self, start):
        self.starts.append(start)

    def propose(self, committed, max_tokens, sampling, generator) -> Draft:
        truth = self.reference[committed.shape[1]:committed.shape[1] + self.depth]
        self.steps += 1
        if not truth:
            return root_only(committed)
        parents, tokens, node = [-1], [int(committed[0, -1])], 0
        for d, token in enumerate(truth):
            if d == 1 and self.steps % 3 == 0:
                token = (token + 3) % self.vocab  # poisoned level: accept stops here
            children = [(token + 1) % self.vocab, token, (token + 2) % self.vocab]
            for child in children:
                parents.append(node)
                tokens.append(child)
            node = len(tokens) - 2  # continue below the middle child
        return Draft(tokens=committed.new_tensor([tokens]), tree=TokenTree.from_parents(parents))
