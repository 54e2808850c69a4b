"""The verifier registry: one entry per ``SpecConfig.verifier`` name, read by ``select_verifier``.

An entry declares the rule's uniform callables (the PyTorch one and, where there is one, its Triton
kernel variant, flashmm.kernels), whether the rule is lossless, which drafting schemes it is exact for
when sampling (flashmm.verify.schemes: a drafter declares its scheme, a mismatch is refused before the
prefill), and whether it reads the target's last-layer states at the draft's nodes. ``VERIFIERS``, the
valid names (SpecConfig validates against it), is the table's keys in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from ..sampling import SamplingParams, probs_from_logits
from ..tree.token_tree import TokenTree
from .base import VerifyResult
from .block import verify_block
from .greedy import verify_greedy
from .judge import resolve_judge, verify_judge_lossy
from .rejection import verify_chain, verify_tree
from .rsd import verify_rsd
from .schemes import DRAFTING_SCHEMES
from .spectr import verify_spectr
from .traversal import verify_traversal
from .typical import verify_typical_lossy

# f(tokens [B, N], tree, target_logits [B, N, V], q_probs [B, N, V] | None, sampling,
#   generator, config) -> VerifyResult; config: a flashmm.config.SpecConfig (which imports this module)
Verifier = Callable[[torch.Tensor, TokenTree, torch.Tensor, "torch.Tensor | None", SamplingParams,
                     "torch.Generator | None", "SpecConfig | None"], VerifyResult]


def _greedy(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    return verify_greedy(tokens, tree, target_logits)


def _chain(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    return verify_chain(tokens, tree, probs_from_logits(target_logits, sampling), q_probs, generator)


def _tree(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    return verify_tree(tokens, tree, probs_from_logits(target_logits, sampling), q_probs, generator)


def _auto_sampling(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    verify = verify_chain if tree.is_chain else verify_tree  # identical on chains; chain is cheaper
    return verify(tokens, tree, probs_from_logits(target_logits, sampling), q_probs, generator)


def _typical_lossy(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    # without a config, verify_typical_lossy's own thresholds: Medusa's, which SpecConfig's defaults are (tested)
    thresholds = {} if config is None else {"epsilon": config.typical_epsilon, "delta": config.typical_delta}
    return verify_typical_lossy(tokens, tree, probs_from_logits(target_logits, sampling), generator, **thresholds)


def _judge_lossy(tokens, tree, target_logits, q_probs, sampling, generator, config, hidden=None) -> VerifyResult:
    if hidden is None:
        raise ValueError("verifier='judge_lossy' needs the target's states at the draft's nodes (the engine passes them)")
    return verify_judge_lossy(tokens, tree, probs_from_logits(target_logits, sampling), hidden,
                              resolve_judge(config.judge), sampling.do_sample, generator)



def _rsd(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    return verify_rsd(tokens, tree, probs_from_logits(target_logits, sampling), q_probs, generator)


def _block(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    return verify_block(tokens, tree, probs_from_logits(target_logits, sampling), q_probs, generator)


def _traversal(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    return verify_traversal(tokens, tree, probs_from_logits(target_logits, sampling), q_probs, generator)


def _traversal_iid(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    return verify_traversal(tokens, tree, probs_from_logits(target_logits, sampling), q_probs, generator,
                            siblings="iid")


def _spectr(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    return verify_spectr(tokens, tree, probs_from_logits(target_logits, sampling), q_probs, generator)


def _greedy_kernel(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    from ..kernels import verify_tree_greedy  # noqa: PLC0415 (triton loads on first use)

    return verify_tree_greedy(tokens, tree, target_logits)


def _tree_kernel(tokens, tree, target_logits, q_probs, sampling, generator, config) -> VerifyResult:
    from ..kernels import verify_tree_sampling  # noqa: PLC0415

    return verify_tree_sampling(tokens, tree, probs_from_logits(target_logits, sampling), q_probs, generator)


@dataclass(frozen=True)
class VerifierEntry:
    """One verification rule.

    torch:     the uniform callable (Verifier) the rule runs as.
    triton:    its Triton kernel variant (one program per sequence; same results, same random-draw
               contract), used with backend="triton"; None where there is none.
    lossless:  the output has the target's distribution (greedy decoding: its tokens) for drafts of
               ``schemes``; False for the rules named ``*_lossy``.
    schemes:   the drafting schemes the rule is exact for when sampling; None: not checked (a rule
               that refuses sampled decoding).
    needs_hidden_states: the rule reads the target's last-layer states at the draft's nodes (the
               engine asks the target's forward for them and passes them as ``hidden``).
    by_scheme: {drafting scheme: callable} run instead of ``torch`` for drafts of that scheme.
    samples:   the rule verifies sampled decoding (do_sample=True).
    greedy_too: the rule also runs in greedy decoding; every other rule is replaced by greedy
               verification there (the exact rule for greedy decoding).
    chain_only: the rule needs a chain-shaped draft (checked when select_verifier is given the tree).
    """

    torch: Verifier
    triton: Verifier | None = None
    lossless: bool = True
    schemes: tuple[str, ...] | None = DRAFTING_SCHEMES
    needs_hidden_states: bool = False
    by_scheme: Mapping[str, Verifier] = field(default_factory=dict)
    samples: bool = True
    greedy_too: bool = False
    chain_only: bool = False


# verifier name -> its rule. A chain is every scheme's one-child case; i.i.d. chains are an i.i.d.
# tree (root children i.i.d., one child below).
REGISTRY: dict[str, VerifierEntry] = {
    # multi-round tree rejection (chain rejection on chains, the same rule draw for draw); RSD for
    # drafts without replacement
    "auto": VerifierEntry(_auto_sampling, triton=_tree_kernel, by_scheme={"without_replacement": _rsd}),
    # the exact rule for greedy decoding, which every other rule becomes when do_sample=False
    "greedy": VerifierEntry(_greedy, triton=_greedy_kernel, schemes=None, samples=False),
    "chain": VerifierEntry(_chain, schemes=("chain", "deterministic"), chain_only=True),
    "tree": VerifierEntry(_tree, triton=_tree_kernel, schemes=("chain", "iid", "iid_chains", "deterministic")),
    "typical_lossy": VerifierEntry(_typical_lossy, lossless=False),  # lossy anyway; it never uses q
    "rsd": VerifierEntry(_rsd, schemes=("chain", "without_replacement", "deterministic")),
    "block": VerifierEntry(_block, schemes=("chain", "deterministic")),
    "traversal": VerifierEntry(_traversal, schemes=("chain", "without_replacement", "iid"),
                               by_scheme={"iid": _traversal_iid}),
    "spectr": VerifierEntry(_spectr, schemes=("chain", "iid_chains")),
    "judge_lossy": VerifierEntry(_judge_lossy, lossless=False, needs_hidden_states=True, greedy_too=True),
}

#: the valid SpecConfig.verifier names
VERIFIERS = tuple(REGISTRY)


def needs_hidden_states(name: str) -> bool:
    """Whether verifier ``name`` reads the target's last-layer states at the draft's nodes."""
    return REGISTRY[name].needs_hidden_states


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
    entry = REGISTRY.get(verifier)
    allowed = None if entry is None else entry.schemes
    if allowed is not None and scheme not in allowed:
        raise ValueError(
            f"verifier={verifier!r} is not exact for drafts made by the {scheme!r} scheme (it assumes "
            f"{' / '.join(allowed)}); use verifier {_SUGGEST[scheme]}, or configure the drafter's "
            f"scheme to match (DraftModel(scheme=...))")


def select_verifier(name: str, do_sample: bool, tree: TokenTree | None = None,
                    backend: str = "torch", drafting_scheme: str | None = None) -> Verifier:
    """Map SpecConfig.verifier to a callable with the uniform signature

        f(tokens [B, N], tree, target_logits [B, N, V], q_probs [B, N, V] or None,
          sampling: SamplingParams, generator, config: SpecConfig | None) -> VerifyResult

    p = probs_from_logits(target_logits, sampling) (temperature → top-k → top-p); q_probs must
    already be warped the same way by the drafter.

    "auto":  greedy when not sampling, else multi-round tree (chain rejection on chains, which
             is the same rule draw for draw); "rsd" when drafting_scheme is "without_replacement".
    "chain", "tree", "typical_lossy": as named when sampling; with do_sample=False every
             verifier is greedy verification (the exact rule for greedy decoding).
    "rsd":   recursive rejection sampling, siblings drawn without replacement (RSD-C / RSD-S).
    "block": block verification of a chain (Sun et al. 2025): never fewer accepted tokens than
             token-level in expectation.
    "traversal": leaf-to-root traversal verification of trees drawn without replacement (or
             i.i.d. when drafting_scheme="iid"); block verification on chains.
    "spectr": SpecTr K-SEQ over k i.i.d. draft chains.
    "judge_lossy": Judge decoding, LOSSY, greedy or sampling (flashmm.verify.judge); it reads the target's
             states at the nodes (``needs_hidden_states``) and ``config.judge``.
    "greedy": greedy; with do_sample=True this raises ValueError (it would emit argmax tokens,
             not samples of the target).
    tree (optional): when given, checked now ("chain" needs a chain); otherwise verify_chain
             raises at call time on a non-chain tree.
    backend: "triton" runs greedy and tree verification as one Triton program per sequence
             (flashmm.kernels; same results, same random-draw contract), "torch" the functions here.
    drafting_scheme: how the drafter draws when sampling (flashmm.verify.schemes); a verifier
             that is not exact for it raises ValueError here, before any forward.
    """
    entry = REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown verifier {name!r}; choose one of {VERIFIERS}")
    if entry.greedy_too:  # lossy in greedy decoding too: it is the one rule not replaced by greedy
        return entry.torch
    if not do_sample:
        return _on_backend(REGISTRY["greedy"], backend)
    check_drafting_scheme(name, drafting_scheme)
    if not entry.samples:
        raise ValueError(f"verifier={name!r} cannot verify sampled decoding (do_sample=True); "
                         "use 'auto', 'tree' or 'chain'")
    if entry.chain_only and tree is not None and not tree.is_chain:
        raise ValueError(f"verifier={name!r} needs a chain-shaped draft; use 'tree' or 'auto' for trees")
    if backend == "triton" and entry.triton is not None:
        return entry.triton
    return entry.by_scheme.get(drafting_scheme, entry.torch)


def _on_backend(entry: VerifierEntry, backend: str) -> Verifier:
    return entry.triton if backend == "triton" and entry.triton is not None else entry.torch
