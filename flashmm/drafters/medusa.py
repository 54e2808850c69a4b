"""Medusa-1 (Cai et al. 2024, arXiv 2401.10774): K heads on the frozen target's final hidden state.

Head k (k = 1..K) is a residual SiLU block, z_k = h + SiLU(W_k h + b_k) (W_k zero at init, so an
untrained head repeats the LM head's guess), read by the target's own LM head; it predicts token
t + k + 1 from h_t. All heads run once per step on the feature of the last accepted node.
Candidates are the product of each head's top-s tokens pruned to a static sparse tree chosen from
the heads' measured rank accuracies (head_base.static_tree); a chain (``tree="chain"``) takes each
head's top-1.

Drafts are deterministic functions of the context (q_probs None), so every exact verifier applies:
greedy verification when decoding greedily, multi-round rejection when sampling. Medusa's own
typical acceptance is ``flashmm.wrap(model, medusa, verifier="typical_lossy")``: faster on
sampled text and LOSSY (the output no longer has the target's distribution).
"""
from __future__ import annotations

import torch

from ..config import SamplingParams
from ..tree.draft import Draft
from .base import register, root_only
from .head_base import HeadDrafter
from .nets.medusa_net import MedusaHeads


@register
class Medusa(HeadDrafter):
    """Medusa-1 heads as a drafter; trained ones load with ``flashmm.drafters.load(dir)``.

    Options: ``tree`` ("chain": a chain of K; "static": the static tree), ``max_draft_tokens`` (its
    drafted nodes), ``top_s`` (ranks per head the default tree guess considers when no accuracy was
    measured).
    """

    name = "medusa"
    heads_class = MedusaHeads

    def _propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                 generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("Medusa drafts one sequence at a time (batches fork it per row)")
        tree = self.planned_tree(max_tokens)
        if tree is None or self._feature is None:
            return root_only(committed)
        states = self.heads(self._feature)[:tree.max_depth]                     # [D, d]
        # heads with their own LM heads (published Medusa-1) score with those, else with the target's
        logits = self.heads.head_logits(states) if self.heads.has_lm_heads else self.logits(states)  # [D, V]
        top = logits.topk(int(tree.ranks.max()) + 1, dim=-1).indices          # [D, s]
        depth, ranks = tree.depth[1:].to(top.device), tree.ranks[1:].to(top.device)  # [N-1]
        drafted = self.target_ids(top[depth - 1, ranks])                        # [N-1]
        tokens = torch.cat([committed[0, -1:], drafted.to(committed.device)])[None]
        return Draft(tokens=tokens, tree=tree, q_probs=None)
