"""Verifiers: pure functions of (draft tokens, tree, target scores, draft probs, randomness).

Lossless: verify_greedy (greedy decoding), verify_chain, verify_tree, verify_rsd, verify_block,
verify_traversal, verify_spectr (sampling; each assumes a drafting scheme, see .schemes).
Lossy (named so): verify_typical_lossy, verify_judge_lossy (reads the target's states at the nodes).
The engine calls only ``select_verifier(...)``'s uniform callable.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..config import VERIFIERS, SamplingParams, SpecConfig
from ..sampling import probs_from_logits
from ..tree.token_tree import TokenTree
from .base import VerifyResult
from .block import verify_block
from .greedy import verify_greedy
from .judge import JudgeHead, load_judge, resolve_judge, verify_judge_lossy
from .rejection import draw_uniforms, sample_inverse_cdf, verify_chain, verify_tree
from .rsd import verify_rsd
from .schemes import COMPATIBLE_SCHEMES, DRAFTING_SCHEMES, check_drafting_scheme, drafting_scheme_of
from .spectr import verify_spectr
from .traversal import verify_traversal
from .typical import verify_typical_lossy

__all__ = [
    "VerifyResult", "Verifier", "select_verifier", "verify_greedy", "verify_chain", "verify_tree",
    "verify_typical_lossy", "draw_uniforms", "sample_inverse_cdf", "verify_rsd", "verify_block",
    "verify_traversal", "verify_spectr", "DRAFTING_SCHEMES", "COMPATIBLE_SCHEMES", "check_drafting_scheme",
    "drafting_scheme_of", "verify_judge_lossy", "JudgeHead", "load_judge",
]

# f(tokens [B, N], tree, target_logits [B, N, V], q_probs [B, N, V] | None, sampling,
#   generator, config) -> VerifyResult
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
    config = config if config is not None else SpecConfig()
    return verify_typical_lossy(tokens, tree, probs_from_logits(target_logits, sampling), generator,
                                epsilon=config.typical_epsilon, delta=config.typical_delta)


def _judge_lossy(tokens, tree, target_logits, q_probs, sampling, generator, config, hidden=None) -> VerifyResult:
    if hidden is None:
        raise ValueError("verifier='judge_lossy' needs the target's states at the draft's nodes (the engine passes them)")
    return verify_judge_lossy(tokens, tree, probs_from_logits(target_logits, sampling), hidden,
                              resolve_judge(config.judge), sampling.do_sample, generator)


_judge_lossy.needs_hidden_states = True  # the engine asks the target for its last-layer states


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
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; choose one of {VERIFIERS}")
    if name == "judge_lossy":  # lossy in greedy decoding too: it is the one rule not replaced by greedy
        return _judge_lossy
    if not do_sample:
        return _greedy_kernel if backend == "triton" else _greedy
    check_drafting_scheme(name, drafting_scheme)
    if name == "greedy":
        raise ValueError("verifier='greedy' cannot verify sampled decoding (do_sample=True); "
                         "use 'auto', 'tree' or 'chain'")
    if name == "chain" and tree is not None and not tree.is_chain:
        raise ValueError("verifier='chain' needs a chain-shaped draft; use 'tree' or 'auto' for trees")
    if backend == "triton" and name in ("auto", "tree"):
        return _tree_kernel
    if name == "auto" and drafting_scheme == "without_replacement":
        return _rsd
    if name == "traversal" and drafting_scheme == "iid":
        return _traversal_iid
    return {"auto": _auto_sampling, "chain": _chain, "tree": _tree, "typical_lossy": _typical_lossy,
            "rsd": _rsd, "block": _block, "traversal": _traversal, "spectr": _spectr}[name]
