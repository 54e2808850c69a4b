"""Multi-token prediction modules (DeepSeek-V3, arXiv 2412.19437, section 2.2), trained post hoc on
a frozen target and drafted sequentially.

Module k (k = 1..D) at position i combines the previous depth's representation with the embedding
of token i + k, then runs one transformer block (a Llama decoder layer, causal over positions):

    u_i^k = M_k [RMSNorm(h_i^{k-1}) ; RMSNorm(E(x_{i+k}))]        (M_k: Linear 2d → d)
    h^k   = Block_k(u^k)                                         (attends to positions <= i)
    token i + k + 1 ~ LMHead(RMSNorm_k(h_i^k))                   (the target's own LM head)

h^0 is the target's final hidden state. Module k at position i needs tokens up to i + k, so with
committed tokens x_0..x_R (R: the root), module k's KV cache holds positions 0..R-k, computed from
committed tokens only; drafting runs module k at positions R-k+1..R-1, whose inputs are the tokens
modules 1..k-1 just drafted, and keeps nothing of them. Token R + k comes from module k at
position R - 1. Drafts are deterministic, verification exact.

Trees (``tree="static"``; the static tree of head_base.static_tree from the modules' measured rank
accuracies, as Hydra's). A node n at depth j (tokens d_1..d_j on its path, d_j at position R + j)
gets its children from module j + 1 at position R - 1 run on *n's own path*: module j + 1 runs at
positions R-j..R-1, reading h^j at R-j from its committed states and h^j at R-j+1..R-1 from module
j's run for n's parent (which ran on d_1..d_{j-1}), with embeddings of d_1..d_j. Those j positions
attend to module j + 1's cache (committed positions 0..R-j-1) and causally to each other, i.e. only
to n's ancestors: every node's run is its own short sequence, so the nodes of a depth run as one
batch [nodes, j] over the shared cache (no tree mask needed). The root's children come from module
1's committed state at R - 1. A chain is the tree with one child per node (the same computation).
"""
from __future__ import annotations

import torch

from ..config import SamplingParams
from ..tree.draft import Draft
from .base import SequenceStart, StepResult, register, root_only
from .head_base import HeadDrafter
from .nets.mtp_net import MTPModules


@register
class MTP(HeadDrafter):
    """MTP modules as a drafter; trained ones load with ``flashmm.drafters.load(dir)``.
    ``tree``: "chain" (a chain of D) or "static" (the static tree of ``max_draft_tokens`` nodes)."""

    name = "mtp"
    heads_class = MTPModules
    sequential = True

    def begin(self, start: SequenceStart) -> None:
        super().begin(start)
        depth = self.heads.num_heads
        dtype = next(self.heads.parameters()).dtype
        self._states = [start.hidden_states[0].to(dtype)] + [None] * depth   # h^k [positions, d] per depth
        self._caches = [None] * depth                                          # module k's committed KV
        self._fed = [0] * depth                                                # positions in module k's cache

    def observe(self, step: StepResult) -> None:
        super().observe(step)
        self._states[0] = torch.cat([self._states[0], step.hidden_states[0].to(self._states[0].dtype)])

    def _sync(self, committed: torch.Tensor) -> None:
        """Extend every module's cache over the positions its inputs now fix: module k (1-based) up to R - k."""
        root = committed.shape[1] - 1
        for k in range(self.heads.num_heads):
            prev = self._states[k]
            if prev is None:  # module k's inputs are not known yet (module k-1 has run on nothing)
                break
            start, stop = self._fed[k], min(prev.shape[0], root - k)           # 0-based k: positions <= R-(k+1)
            if stop <= start:
                continue
            embeds = self.committed_embeds(committed[0, start + k + 1:stop + k + 1], start + k + 1)  # x_{i+k+1}
            out, self._caches[k] = self.heads.run(k, prev[None, start:stop], embeds[None], start, self._caches[k])
            self._states[k + 1] = out[0] if self._states[k + 1] is None else torch.cat([self._states[k + 1], out[0]])
            self._fed[k] = stop

    def _propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                 generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("MTP drafts one sequence at a time (batches fork it per row)")
        root = committed.shape[1] - 1
        if self._lm_head is None or min(self.heads.num_heads, max_tokens, root) < 1:
            return root_only(committed)
        tree = self.planned_tree(max_tokens if self.tree == "static" else min(self.heads.num_heads, max_tokens, root))
        if tree is None or tree.num_nodes < 2 or tree.max_depth > root:
            return root_only(committed)  # the modules' caches catch up when a step drafts again
        self._sync(committed)  # one run per module over every position committed since it last drafted
        tokens = committed[0, -1:].repeat(tree.num_nodes)                      # [N]; root first
        children, ranks, parents = tree.children, tree.ranks.tolist(), tree.parents.tolist()
        paths = {0: []}                                                        # node → its drafted token ids
        runs = {0: self._states[1][root:root]}                                 # node at depth j → module j+1's run [j, d]
        level, last = [0], self._states[1][root - 1:root]                      # last [P, d]: what the children's logits read
        for j in range(tree.max_depth):                                        # children of depth-j nodes, module j+1
            if j:  # module j+1 (0-based j) at positions R-j..R-1 on each parent's own path
                committed_h = self._states[j][root - j:root - j + 1]           # h^j at R-j  [1, d]
                h_prev = torch.stack([torch.cat([committed_h, runs[parents[n]]]) for n in level])   # [P, j, d]
                embeds = self.embed(torch.stack([torch.stack(paths[n]) for n in level]))           # [P, j, d]
                out, _ = self.heads.run(j, h_prev, embeds, root - j, self._caches[j])             # [P, j, d]
                for row, n in enumerate(level):
                    runs[n] = out[row]
                last = out[:, -1]
            width = max(ranks[c] for n in level for c in children[n]) + 1
            top = self.target_ids(self.logits(self.heads.output(j, last)).topk(width, dim=-1).indices)  # [P, s]
            following = []
            for row, n in enumerate(level):
                for child in children[n]:
                    tokens[child] = top[row, ranks[child]]
                    paths[child] = paths[n] + [tokens[child]]
                    if children[child]:
                        following.append(child)
            level = following
            if not level:
                break
        return Draft(tokens=tokens[None], tree=tree, q_probs=None)
