"""Drafting schemes: how a drafter draws a node's children when sampling.

A verifier is lossless only for drafts made the way it assumes. A drafter declares how it
drafts when sampling with ``Drafter.drafting_scheme`` (one of DRAFTING_SCHEMES); the engine
refuses a mismatched pair before the prefill (``check_drafting_scheme``; which verifier is exact for
which scheme is each verifier's entry in flashmm.verify.registry).

"chain":               one child per node, drawn from q at its parent (a single sampled chain).
"iid":                 a node's children drawn i.i.d. from q at the node (SpecInfer trees).
"without_replacement": a node's children drawn without replacement from q at the node, in
                       sibling order (Gumbel-Top-k: RSD-C; stochastic beam search: RSD-S).
"iid_chains":          k chains drawn i.i.d. from q, each its own branch of the root (SpecTr);
                       the root's children are i.i.d., every other node has at most one child.
"deterministic":       tokens are a function of the context (greedy, top-k, lookup); q_probs None.
"""
from __future__ import annotations

DRAFTING_SCHEMES = ("chain", "iid", "without_replacement", "iid_chains", "deterministic")


def drafting_scheme_of(drafter) -> str:
    """A drafter's ``drafting_scheme``; drafters that do not declare one return q_probs None
    (every drafter but DraftModel), i.e. "deterministic"."""
    return getattr(drafter, "drafting_scheme", "deterministic")
