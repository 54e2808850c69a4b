"""Frozen, validated configuration for speculative generation."""
from __future__ import annotations

from dataclasses import dataclass

VERIFIERS = ("auto", "greedy", "chain", "tree", "typical_lossy")


@dataclass(frozen=True)
class SamplingParams:
    """How the target samples. ``do_sample=False`` is greedy (temperature etc. ignored).

    The same transformation (temperature → top-k → top-p, HF's order) is applied to the
    target distribution p and the draft distribution q before any acceptance rule.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0 when do_sample=True, got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative int or None, got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings shared by all drafters.

    verifier: "auto" (greedy when not sampling, else tree multi-round, which equals chain
      rejection sampling on a chain), "greedy", "chain", "tree", or "typical_lossy"
      (Medusa typical acceptance: NOT lossless; output distribution differs from the target).
    max_draft_tokens: upper bound on drafted tokens (tree nodes excluding the root) per step.
    typical_epsilon / typical_delta: the lossy rule accepts x iff p(x) > min(epsilon, delta·exp(−H(p)));
      defaults are Medusa's (posterior_threshold 0.09, posterior_alpha 0.3).
    """

    verifier: str = "auto"
    max_draft_tokens: int = 16
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3

    def __post_init__(self):
        if self.verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {self.verifier!r}; choose one of {VERIFIERS}")
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
