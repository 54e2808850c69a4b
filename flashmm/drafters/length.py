"""How many tokens to draft: the choice that maximises expected tokens per unit of verify time."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveDraftLength:
    """Picks the draft length k from a running estimate of per-token acceptance α.

    Expected tokens emitted by a chain of k drafts is (1 - α^(k+1)) / (1 - α); a verification
    of k + 1 tokens costs ≈ 1 + cost_per_token · k one-token forwards (CPU: ≈ 0.1 for a 135M
    model, see DESIGN §9; GPU decoding is memory bound: ≈ 0.01). k = 0 (plain decoding) is
    chosen whenever drafting would not pay, so low acceptance never costs more than a plain step.

    α is estimated from accepted / rejected counts with exponential forgetting (``decay``) and a
    Beta(prior_accept, prior_reject) prior.
    """

    cost_per_token: float = 0.1
    decay: float = 0.9
    prior_accept: float = 1.0
    prior_reject: float = 1.0
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def alpha(self) -> float:
        a = self.accepted + self.prior_accept
        return a / (a + self.rejected + self.prior_reject)

    def choose(self, max_tokens: int, alpha: float | None = None) -> int:
        alpha = self.alpha if alpha is None else alpha
        best_k, best_rate, expected = 0, 1.0, 1.0
        for k in range(1, max_tokens + 1):
            expected += alpha ** k
            rate = expected / (1.0 + self.cost_per_token * k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def update(self, drafted: int, accepted: int) -> None:
        # Forgetting also runs on steps without a draft, so α drifts back to the prior and a
        # drafter that stopped drafting tries again later.
        if drafted == 0:
            self.accepted *= self.decay
            self.rejected *= self.decay
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1.0 if accepted < drafted else 0.0)

    def reset(self) -> None:
        self.accepted = self.rejected = 0.0
