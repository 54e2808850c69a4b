"""Verifiers: pure functions of (draft tokens, tree, target scores, draft probs, randomness).

Lossless: verify_greedy (greedy decoding), verify_chain, verify_tree, verify_rsd, verify_block,
verify_traversal, verify_spectr (sampling; each assumes a drafting scheme, see .schemes).
Lossy (named so): verify_typical_lossy, verify_judge_lossy (reads the target's states at the nodes).
Which name runs which rule, and what each rule assumes, is one table (.registry); the engine calls
only ``select_verifier(...)``'s uniform callable.
"""
from .base import VerifyResult
from .block import verify_block
from .greedy import verify_greedy
from .judge import JudgeHead, load_judge, verify_judge_lossy
from .registry import (REGISTRY, VERIFIERS, Verifier, VerifierEntry, check_drafting_scheme, needs_hidden_states,
                       select_verifier)
from .rejection import draw_uniforms, sample_inverse_cdf, verify_chain, verify_tree
from .rsd import verify_rsd
from .schemes import DRAFTING_SCHEMES, drafting_scheme_of
from .spectr import verify_spectr
from .traversal import verify_traversal
from .typical import verify_typical_lossy

__all__ = [
    "VerifyResult", "Verifier", "select_verifier", "verify_greedy", "verify_chain", "verify_tree",
    "verify_typical_lossy", "draw_uniforms", "sample_inverse_cdf", "verify_rsd", "verify_block",
    "verify_traversal", "verify_spectr", "DRAFTING_SCHEMES", "check_drafting_scheme",
    "drafting_scheme_of", "verify_judge_lossy", "JudgeHead", "load_judge",
    "REGISTRY", "VERIFIERS", "VerifierEntry", "needs_hidden_states",
]
