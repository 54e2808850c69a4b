"""Hydra (Ankner et al. 2024, arXiv 2402.05109): sequentially dependent draft heads.

Head k (k = 1..K) reads the target feature h_t *and* the input embeddings of the tokens before the
one it predicts: the root (token t + 1, the target's own choice) and the tokens heads 1..k-1
drafted on the same path. Hydra's MLP form:

    x_k = [h ; E(root) ; E(d_1) ; ... ; E(d_{k-1})]        [(k + 1) d]
    z_k = h + U_k x_k                                       (U_k zero at init)
    s_k = z_k + SiLU(W_k z_k + b_k)                         → the target's LM head → token t + k + 1

Tree drafting uses the same static tree as Medusa (head_base.static_tree from measured rank
accuracies), but every node's children come from head k run on *that node's own path*, so siblings
under different parents differ (one batched head call per depth). Hydra++'s teacher-distillation
objective is a training option (flashmm.train.heads, ``--objective distill``); deterministic drafts,
so verification is exact with every verifier (``typical_lossy`` is the lossy one).

Hydra++ prefix attention (``HydraHeads(..., prefix_layer={...})``, off by default): one extra Llama
decoder layer over the target's final hidden states of the whole committed prefix (causal, with its
own KV cache of those states) whose output at the root's parent replaces h as the feature every
head reads. Its cache only grows: the engine hands over the states of accepted nodes, each step's
positions right after the last ones fed. Trained with the heads (o_proj and down_proj start at
zero, so an untrained layer is the identity and the heads start as plain Hydra's).

Heads trained with zankner/Hydra's own code (its MLP heads, each with its own LM head) draft through this
class as PublishedHydra (flashmm.drafters.published_hydra), which scores head k with head k's LM head.
"""
from __future__ import annotations

import torch

from ..config import SamplingParams
from ..tree.draft import Draft
from .base import SequenceStart, StepResult, register, root_only
from .head_base import HeadDrafter
from .nets.hydra_net import HydraHeads


@register
class Hydra(HeadDrafter):
    """Hydra heads as a drafter; trained ones load with ``flashmm.drafters.load(dir)``.
    ``tree``: "chain" (a chain of K) or "static" (the static tree of ``max_draft_tokens`` nodes)."""

    sequential = True

    name = "hydra"
    heads_class = HydraHeads

    def begin(self, start: SequenceStart) -> None:
        super().begin(start)
        self._prefix_cache, self._fed = None, 0
        if self.heads.prefix_layer is not None:
            self._feed(start.hidden_states[0])

    def observe(self, step: StepResult) -> None:
        super().observe(step)
        if self.heads.prefix_layer is not None:
            self._feed(step.hidden_states[0])

    @torch.no_grad()
    def _feed(self, states: torch.Tensor) -> None:
        """Extend the prefix layer's cache by the target states [T, d] of the next T positions; the
        feature becomes the layer's output at the last of them."""
        out, self._prefix_cache = self.heads.prefix(states[None], self._fed, self._prefix_cache)
        self._fed += states.shape[0]
        self._feature = out[0, -1]

    def head_logits(self, k: int, states: torch.Tensor) -> torch.Tensor:
        """Head k's logits [..., Vd] for its states [..., d]: flashmm's heads all read the target's LM head
        (PublishedHydra's heads have their own)."""
        return self.logits(states)

    def _propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                 generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("Hydra drafts one sequence at a time (batches fork it per row)")
        tree = self.planned_tree(max_tokens)
        if tree is None or self._feature is None:
            return root_only(committed)
        tokens = committed[0, -1:].repeat(tree.num_nodes)                      # [N]; root first
        path_embeds = {0: self.embed(tokens[:1])}                               # node → [depth + 1, d]
        ranks, children = tree.ranks.tolist(), tree.children
        level = [0]
        for k in range(tree.max_depth):
            parents = [node for node in level if children[node]]
            embeds = torch.stack([path_embeds[node] for node in parents])       # [P, k + 1, d]
            states = self.heads.head(k, self._feature.expand(len(parents), -1), embeds)  # [P, d]
            width = max(ranks[c] for node in parents for c in children[node]) + 1
            top = self.target_ids(self.head_logits(k, states).topk(width, dim=-1).indices)  # [P, s]
            level = []
            for row, node in enumerate(parents):
                for child in children[node]:
                    tokens[child] = top[row, ranks[child]]
                    level.append(child)
            if k + 1 < tree.max_depth:
                new = self.embed(tokens[level])                                 # [L, d]
                for j, child in enumerate(level):
                    path_embeds[child] = torch.cat([path_embeds[tree.parents[child].item()], new[j:j + 1]])
        return Draft(tokens=tokens[None], tree=tree, q_probs=None)
