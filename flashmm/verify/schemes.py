"""Drafting schemes, and which verifier is exact for which.

A verifier is lossless only for drafts made the way it assumes. A drafter declares how it
drafts when sampling with ``Drafter.drafting_scheme`` (one of DRAFTING_SCHEMES); the engine
refuses a mismatched pair before the prefill (``check_drafting_scheme``).

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

# verifier name -> drafting schemes it is exact for when sampling. A chain is every scheme's
# one-child case; i.i.d. chains are an i.i.d. tree (root children i.i.d., one child below).
COMPATIBLE_SCHEMES = {
    "auto": DRAFTING_SCHEMES,  # picks "rsd" for without-replacement drafts, multi-round otherwise
    "tree": ("chain", "iid", "iid_chains", "deterministic"),
    "chain": ("chain", "deterministic"),
    "typical_lossy": DRAFTING_SCHEMES,  # lossy anyway; it never uses q
    "judge_lossy": DRAFTING_SCHEMES,
    "rsd": ("chain", "without_replacement", "deterministic"),
    "block": ("chain", "deterministic"),
    "traversal": ("chain", "without_replacement", "iid"),
    "spectr": ("chain", "iid_chains"),
}

# what to use instead, named in the refusal
_SUGGEST = {
    "iid": "'tree' (multi-round) or 'traversal'",
    "without_replacement": "'rsd' or 'traversal'",
    "iid_chains": "'spectr' or 'tree'",
    "deterministic": "'tree', 'rsd' or 'block' (chains)",
    "chain": "any verifier",
}


def check_drafting_scheme(verifier: str, scheme: str | None) -> None:
    """Raise ValueError when ``verifier`` is not exact for drafts made by ``scheme`` (sampling).

    scheme None (a drafter that does not say) is accepted: it is verified as before.
    """
    if scheme is None:
        return
    if scheme not in DRAFTING_SCHEMES:
        raise ValueError(f"unknown drafting scheme {scheme!r}; choose one of {DRAFTING_SCHEMES}")
    allowed = COMPATIBLE_SCHEMES.get(verifier)
    if allowed is not None and scheme not in allowed:
        raise ValueError(
            f"verifier={verifier!r} is not exact for drafts made by the {scheme!r} scheme (it assumes "
            f"{' / '.join(allowed)}); use verifier {_SUGGEST[scheme]}, or configure the drafter's "
            f"scheme to match (DraftModel(scheme=...))")


def drafting_scheme_of(drafter) -> str:
    """A drafter's ``drafting_scheme``; drafters that do not declare one return q_probs None
    (every drafter but DraftModel), i.e. "deterministic"."""
    return getattr(drafter, "drafting_scheme", "deterministic")
