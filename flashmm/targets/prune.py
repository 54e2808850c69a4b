"""ProPD (Zhong et al., 2024): prune a draft tree with the target's early-layer logits before the
remaining layers run. ``flashmm.wrap(model, drafter, prune="propd", prune_layer=l, prune_top_k=k)``.

The tree forward is split (flashmm.targets.layers): layers [0, l) run on all N nodes; the final norm
and LM head on their layer-l states give early logits; node i survives iff its parent survives and
its token is among the top-k early tokens at its parent. Layers [l, L) then run on the M surviving
nodes only (the cost saved: (L − l)/L of a step's layer work on N − M nodes, less the early LM head,
which runs on the nodes with children and on pruned leaves only); the first l layers' cache rows are compacted to the survivors first.
The verifier sees the surviving subtree: pruned nodes are simply not verified, so greedy output is
unchanged, and so is the sampled distribution for deterministic children (the candidate set is a
function of the context, as any drafter's is). Drafts with sampled children (q_probs) while
sampling, drafts with aux rows, and drafters that need hidden states are verified unpruned.

The drafter then observes the step in its own tree's indexing: the path mapped back, and logits
whose pruned rows are the early logits (so ``node_topk`` at a pruned node is the early top-k).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .base import TargetOutput
from .layers import LayerRunner, check_supported
from .session import Scored, SequenceSession

def check_prunable(target) -> None:
    """Raise ValueError unless ProPD can split ``target``'s forward (a Llama-like text LM, PyTorch path)."""
    if not hasattr(target, "lends_cache") or getattr(target, "recurrent", False) or getattr(target, "backend", "torch") != "torch":
        raise ValueError("prune='propd' splits the target's forward layer by layer: it needs a text causal LM "
                         "verified through the PyTorch path (attention='torch'), not a recurrent or Triton target")
    if getattr(target, "cuda_graphs", False):
        raise ValueError("prune='propd' runs the target's layers one by one, which CUDA-graph verification "
                         "replays whole: wrap without cuda_graphs")
    check_supported(target.model)


@dataclass
class PrunedOutput(TargetOutput):
    """The target's output over the surviving nodes, and what the drafter's own tree needs.

    kept:         LongTensor [M]; indices of the surviving nodes in the original tree (0 = root).
    early_logits: FloatTensor [1, N, V]; layer-l logits at the pruned nodes (rows of kept nodes: unused).
    """

    kept: torch.Tensor | None = None
    early_logits: torch.Tensor | None = None
    pending: tuple | None = None  # (pruned leaves, their layer-l states [1, P, d], runner): early logits on demand


def surviving_nodes(tree: TokenTree, tokens: torch.Tensor, early_topk: torch.Tensor) -> list[int]:
    """Nodes whose every ancestor-to-node token is in the early top-k at its parent.
    tokens [N]; early_topk [N, k] (the ids of the k largest early logits at each node)."""
    parents = tree.parents.tolist()
    alive = [True] * len(parents)
    for i in range(1, len(parents)):
        p = parents[i]
        alive[i] = alive[p] and bool((early_topk[p] == tokens[i]).any())
    return [i for i, a in enumerate(alive) if a]


def subtree(tree: TokenTree, kept: list[int]) -> TokenTree:
    """The tree restricted to ``kept`` (closed under parents, BFS order kept), renumbered 0 .. M-1."""
    index = {node: j for j, node in enumerate(kept)}
    parents = tree.parents.tolist()
    return TokenTree.from_parents([-1] + [index[parents[node]] for node in kept[1:]])


def score_draft(target, seq, draft: Draft, want_hidden, spec, sampling) -> tuple[Draft, TargetOutput]:
    """(the draft the verifier sees, the target's output over it) after ``seq``'s cache (a SequenceCache);
    unpruned unless spec.prune says so and the draft qualifies (see the module docstring)."""
    if (spec.prune == "none" or draft.tree.num_nodes <= 2 or draft.aux is not None or want_hidden
            or (sampling.do_sample and draft.q_probs is not None)):
        return draft, target.forward_tree(seq, *draft.forward_layout(), want_hidden)
    runner = LayerRunner(target.model)
    split = spec.prune_layer or max(1, runner.num_layers // 4)
    if not 1 <= split < runner.num_layers:
        raise ValueError(f"prune_layer must be in [1, {runner.num_layers - 1}], got {split}")
    cache, tree, tokens = seq.kv, draft.tree, draft.tokens
    prefix = seq.length
    with torch.no_grad(), target.linears():
        hidden = runner.run(runner.embed(tokens), 0, split, cache, target.tree_attention_mask(tree, prefix),
                            target.tree_position_ids(tree, prefix, 1))  # [1, N, d]
        # the early LM head runs only where a decision needs it: at nodes with children
        internal = sorted(set(tree.parents.tolist()[1:]))
        early_internal = runner.logits(hidden[:, internal])  # [1, I, V]
        early_topk = tokens.new_full((tree.num_nodes, spec.prune_top_k), -1)
        early_topk[internal] = early_internal[0].topk(spec.prune_top_k, dim=-1).indices
        kept = surviving_nodes(tree, tokens[0], early_topk)
        early, pending = None, None
        if len(kept) < tree.num_nodes:
            # what the drafter observes at pruned nodes: early logits (the pruned leaves' only if it asks)
            early = hidden.new_zeros(1, tree.num_nodes, early_internal.shape[-1])
            early[:, internal] = early_internal
            leaves = sorted(set(range(tree.num_nodes)) - set(kept) - set(internal))
            pending = (leaves, hidden[:, leaves], runner)
            index = torch.tensor(kept, device=hidden.device)
            for layer in cache.layers[:split]:  # compact the first layers' tree rows to the survivors
                rows = torch.cat([torch.arange(prefix, device=hidden.device), prefix + index])
                layer.keys, layer.values = layer.keys[:, :, rows], layer.values[:, :, rows]
            hidden, tree, tokens = hidden[:, index], subtree(tree, kept), tokens[:, index]
        hidden = runner.run(hidden, split, runner.num_layers, cache, target.tree_attention_mask(tree, prefix),
                            target.tree_position_ids(tree, prefix, 1))
        logits = runner.logits(hidden)
    q_probs = draft.q_probs[:, kept] if draft.q_probs is not None else None
    verified = Draft(tokens=tokens, tree=tree, q_probs=q_probs)
    if early is None:  # nothing pruned
        return verified, TargetOutput(logits, None)
    return verified, PrunedOutput(logits, None, kept=torch.tensor(kept), early_logits=early, pending=pending)


def unprune(scored: TargetOutput, path: torch.Tensor, want_logits: bool = True) -> tuple[torch.Tensor, TargetOutput]:
    """(path [1, L] in the drafter's own tree, output over its N nodes: real logits at the verified nodes,
    early logits at the pruned ones, computed at pruned leaves only when ``want_logits``: the drafter reads
    them, Drafter.score_topk); unpruned outputs pass through."""
    if not isinstance(scored, PrunedOutput):
        return path, scored
    kept = scored.kept.to(path.device)
    logits = scored.early_logits.clone()
    leaves, states, runner = scored.pending
    if want_logits and leaves:
        with torch.no_grad():
            logits[:, leaves] = runner.logits(states)
    logits[:, scored.kept.to(logits.device)] = scored.logits
    return kept[path], TargetOutput(logits, None)


class PrunedScored(Scored):
    """A pruned row's forward: the drafter observes it in its own tree's indexing (``unprune``)."""

    def for_drafter(self, path: torch.Tensor, want_logits: bool) -> tuple[torch.Tensor, TargetOutput]:
        return unprune(self.output, path, want_logits)


class PruningSession:
    """A single-sequence session (flashmm.targets.session) whose tree forwards ProPD prunes first."""

    def __init__(self, inner: SequenceSession, spec, sampling):
        self.inner, self.spec, self.sampling = inner, spec, sampling
        self.prefix = None  # the cache's rows before the step's (pruned) tree

    def score(self, drafts: list[Draft], want_hidden, argmax_only: bool = False) -> list[Scored]:
        # (its early exits read the target's scores: the tree forward stays exact)
        (draft,) = drafts
        self.prefix = self.inner.seq.length
        verified, output = score_draft(self.inner.target, self.inner.seq, draft, want_hidden, self.spec,
                                       self.sampling)
        return [PrunedScored(verified, output, pruned=draft.tree.num_nodes - verified.tree.num_nodes)]

    def keep(self, paths: list[torch.Tensor]) -> None:
        (path,) = paths
        self.inner.target.commit(self.inner.seq, path, self.prefix)

    def select(self, rows: list[int]) -> None:
        self.inner.select(rows)
