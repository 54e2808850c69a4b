"""Frozen, validated configuration for speculative generation."""
from __future__ import annotations

from dataclasses import dataclass

from .sampling import SamplingParams  # noqa: F401 (re-exported: flashmm.config.SamplingParams)
from .verify.registry import VERIFIERS

#: SpecConfig.prune: none, or ProPD's early-layer tree pruning (flashmm.targets.prune)
PRUNE_MODES = ("none", "propd")


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings shared by all drafters.

    verifier: "auto" (greedy when not sampling, else tree multi-round, which equals chain
      rejection sampling on a chain, or "rsd" for drafts without replacement), "greedy", "chain", "tree", or "typical_lossy"
      (Medusa typical acceptance: NOT lossless; output distribution differs from the target);
      exact rules that need a matching drafting scheme (flashmm.verify.schemes): "rsd" (siblings
      drawn without replacement), "block" (chains), "traversal" (trees without replacement, chains),
      "spectr" (k i.i.d. chains). "judge_lossy" (Judge decoding, flashmm.verify.judge: NOT lossless, greedy
      or sampling) takes a drafted token the target would not have chosen when ``judge`` (a JudgeHead or a
      judge directory) says it is acceptable.
    max_draft_tokens: upper bound on drafted tokens (tree nodes excluding the root) per step.
    batching: "auto" verifies every row of a batch in one target forward per step (text causal
      LMs; other targets, and drafters that draft on the target's own cache such as layerskip, decode
      rows one after another); "rows" always decodes one row after another.
    typical_epsilon / typical_delta: the lossy rule accepts x iff p(x) > min(epsilon, delta·exp(−H(p)));
      defaults are Medusa's (posterior_threshold 0.09, posterior_alpha 0.3).
    prune: "propd" prunes each draft tree with the target's early-layer logits before its remaining layers
      run (flashmm.targets.prune; exact): a node survives iff its token is in the top ``prune_top_k`` of the
      logits after layer ``prune_layer`` (0: a quarter of the layers) at its parent. "none" (default).
    """

    verifier: str = "auto"
    max_draft_tokens: int = 16
    batching: str = "auto"
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    prune: str = "none"
    prune_layer: int = 0
    prune_top_k: int = 8
    judge: object = None

    def __post_init__(self):
        if self.verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {self.verifier!r}; choose one of {VERIFIERS}")
        if self.batching not in ("auto", "rows"):
            raise ValueError(f"batching must be 'auto' (rows verified together) or 'rows' (one after another), "
                             f"got {self.batching!r}")
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        if (self.verifier == "judge_lossy") != (self.judge is not None):
            raise ValueError("verifier='judge_lossy' needs judge= (a JudgeHead or a judge directory), and a judge is "
                             f"only read by that verifier (got verifier={self.verifier!r}, judge={self.judge!r})")
        if self.prune not in PRUNE_MODES:
            raise ValueError(f"prune must be 'none' or 'propd' (ProPD early-layer tree pruning), got {self.prune!r}")
        if self.prune_layer < 0 or self.prune_top_k < 1:
            raise ValueError(f"prune_layer must be >= 0 (0: a quarter of the layers) and prune_top_k >= 1, "
                             f"got {self.prune_layer}, {self.prune_top_k}")
