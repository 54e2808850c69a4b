"""How many tokens to draft: the choice that maximises expected tokens per unit of verify time."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveDraftLength:
    """Picks the draft length k from a running estimate of per-token acceptance α.

    A chain of k drafts emits (1 - α^(k+1)) / (1 - α) tokens in expectation; verifying it costs
    ≈ 1 + step_cost + token_cost · k one-token forwards (k ≥ 1). The defaults are CPU figures
    for a ~100M model (SmolLM2-135M, 1-2 threads: a 2-token forward costs ~1.2x a 1-token one,
    each further token ~0.06x more); on a GPU both are near 0.01. k = 0 (a plain step) is
    chosen whenever drafting would not pay, so low acceptance never costs more than plain decoding.

    α is estimated from accepted / rejected counts with exponential forgetting and a
    Beta(prior_accept, prior_reject) prior: ``decay`` applies per drafted step, ``idle_decay``
    per step without a draft (so a drafter that stopped slowly drifts back to its prior and
    tries again).
    """

    step_cost: float = 0.15
    token_cost: float = 0.06
    decay: float = 0.9
    idle_decay: float = 0.98
    prior_accept: float = 1.0
    prior_reject: float = 1.0
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def alpha(self) -> float:
        a = self.accepted + self.prior_accept
        return a / (a + self.rejected + self.prior_reject)

    def cost(self, k: int) -> float:
        """Verify cost of k drafted tokens, in one-token forwards."""
        return 1.0 if k == 0 else 1.0 + self.step_cost + self.token_cost * k

    def choose(self, max_tokens: int, alpha: float | None = None) -> int:
        alpha = self.alpha if alpha is None else alpha
        best_k, best_rate, expected = 0, 1.0, 1.0
        for k in range(1, max_tokens + 1):
            expected += alpha ** k
            rate = expected / self.cost(k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            self.accepted *= self.idle_decay
            self.rejected *= self.idle_decay
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1.0 if accepted < drafted else 0.0)

    def reset(self) -> None:
        self.accepted = self.rejected = 0.0
