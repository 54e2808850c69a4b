"""How many tokens to draft: the choice that maximises expected tokens per unit of verify time.

The verify cost of N tree nodes is either measured on this machine (``VerifyCost``, timed by the
target: flashmm.targets.verify_cost.measure_verify_cost, through the linear backend its tree
forwards use, once per model, machine, device, dtype, thread count and backend, cached on disk) or,
without a measurement, the linear model ``1 + step_cost + token_cost * k`` whose defaults are CPU
figures for SmolLM2-135M. Drafters with ``pricing = "measured"`` (the default) take the measurement
at ``bind`` (``price_with_target``); ``pricing = "constants"`` keeps the linear model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .shapes import sequoia_tree


@dataclass(frozen=True)
class VerifyCost:
    """Measured seconds of one target forward of N new tokens (after a cached prefix).

    nodes:   ascending node counts, nodes[0] == 1.
    seconds: the fastest of a few timed forwards at each count.
    """

    nodes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        if not self.nodes or self.nodes[0] != 1 or list(self.nodes) != sorted(set(self.nodes)):
            raise ValueError(f"nodes must ascend from 1 without repeats, got {self.nodes}")
        if len(self.seconds) != len(self.nodes) or not all(math.isfinite(t) and t > 0 for t in self.seconds):
            raise ValueError(f"seconds must be finite and positive, one per node count, got {self.seconds}")
        # relative(n) for every n on the grid's span, read by the drafters' sizing loops each step
        object.__setattr__(self, "_table", [self._relative(n) for n in range(self.nodes[-1] + 1)])

    def seconds_at(self, n: int) -> float:
        """Seconds for n nodes: linear between grid points, the last slope beyond the grid, never
        below the one-token forward. A dip after a smaller size is planned on: the forward of a
        draft of n nodes has exactly n rows, so a kernel that runs 3-6 rows faster than 2 (oneDNN's
        sgemm on the 2-core EPYC: 39 ms for 4 rows, 47 for 2, 38 for 1) makes 4-node drafts
        nearly free, and pricing them at the 2-row time made the drafters pick 12-node trees."""
        nodes, secs = self.nodes, [max(s, self.seconds[0]) for s in self.seconds]
        if n <= nodes[0]:
            return secs[0]
        for i in range(1, len(nodes)):
            if n <= nodes[i]:
                t = (n - nodes[i - 1]) / (nodes[i] - nodes[i - 1])
                return secs[i - 1] + t * (secs[i] - secs[i - 1])
        slope = (secs[-1] - secs[-2]) / (nodes[-1] - nodes[-2]) if len(nodes) > 1 else 0.0
        return secs[-1] + max(slope, 0.0) * (n - nodes[-1])

    def relative(self, n: int) -> float:
        """Cost of verifying n nodes in one-token forwards (t(n) / t(1))."""
        return self._table[n] if 0 <= n < len(self._table) else self._relative(n)

    def _relative(self, n: int) -> float:
        return self.seconds_at(n) / self.seconds[0]


class VerifyCostUnmeasurable(RuntimeError):
    """The model cannot be timed by ``measure_verify_cost`` (flashmm.targets.verify_cost): its state
    cannot be cropped back to the prefix (recurrent layers), or it refuses a cached multi-token
    forward. Drafts are then priced by the constants."""


def price_with_target(target, lengths: Iterable["AdaptiveDraftLength"]) -> str:
    """Give each AdaptiveDraftLength without a verify cost the target's measured one
    (``target.verify_cost()``: its forward of N tree tokens on this machine, measured once and
    cached on disk). Returns how the drafts are priced: "measured", or "constants (...)" naming
    why the target could not be timed (a recurrent state that cannot be cropped, a model that
    refuses a cached multi-token forward); the lengths then keep their linear cost model."""
    pending = [length for length in lengths if length.verify_cost is None]
    if not pending:
        return "given"
    cost, source = measured_verify_cost(target)
    if cost is None:
        return f"constants ({source})"
    for length in pending:
        length.verify_cost = cost
    return source


def measured_verify_cost(target, batch: int = 1) -> tuple["VerifyCost | None", str]:
    """(``target.verify_cost(batch=batch)``, "measured"), or (None, why it could not be timed: a
    recurrent state that cannot be cropped, a model that refuses a cached multi-token forward)."""
    try:
        return target.verify_cost(batch=batch), "measured"
    except VerifyCostUnmeasurable as err:
        return None, f"verify cost not measurable: {err}"


#: the longest pause of a drafter's own passes (``next_pause``), in steps
PAUSE_CAP = 32


def next_pause(last: int, paid: bool) -> int:
    """The steps a drafter's own passes (a head's, a block drafter's, FLASH's net) skip after a drafted step: none
    when its drafting paid, else twice the pause before (1, 2, 4, .. PAUSE_CAP), so a drafter whose drafts keep
    not repaying their passes tries again less and less often, and one that pays drafts every step."""
    return 0 if paid else min(PAUSE_CAP, max(1, 2 * last))


@dataclass
class AdaptiveDraftLength:
    """Picks the draft length k from a running estimate of per-token acceptance α.

    A chain of k drafts emits (1 - α^(k+1)) / (1 - α) tokens in expectation; verifying it costs
    ``cost(k)`` one-token forwards: with a measured ``verify_cost`` (pricing="measured" in the
    drafters) t(k + 1) / t(1) + draft_token_cost · k + draft_step_cost, else 1 + step_cost +
    (token_cost + draft_token_cost) · k + draft_step_cost (the draft costs are 0 unless the drafter
    prices its own work: per drafted token, or per drafting step for PARD's one forward), whose
    defaults are CPU figures for a ~100M model (SmolLM2-135M, 1-2 threads: a 2-token forward
    costs ~1.2x a 1-token one, each further token ~0.06x more); on a GPU both are near 0.01.
    k = 0 (a plain step) is chosen whenever drafting would not pay, so low acceptance never costs
    more than plain decoding.

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
    verify_cost: VerifyCost | None = None
    draft_token_cost: float = 0.0
    draft_step_cost: float = 0.0
    #: the one-token forward drafts were first priced in (a lone row's), in the current one's units: t1 then / t1
    #: now, above 1 in a batch, where a row's share of a step costs less. A drafter that states its own work in
    #: lone-row forwards (a head pass: the weights it reads over the target's) multiplies it by this
    lone_forward: float = 1.0

    @property
    def alpha(self) -> float:
        a = self.accepted + self.prior_accept
        return a / (a + self.rejected + self.prior_reject)

    def cost(self, k: int) -> float:
        """Verify cost of k drafted tokens (k + 1 nodes), in one-token forwards."""
        if k == 0:
            return 1.0
        if self.verify_cost is not None:
            return self.verify_cost.relative(k + 1) + self.draft_token_cost * k + self.draft_step_cost
        return 1.0 + self.step_cost + (self.token_cost + self.draft_token_cost) * k + self.draft_step_cost

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

    def reprice(self, verify_cost: VerifyCost) -> None:
        """Price drafts with ``verify_cost`` from now on (a measured one replacing a measured one,
        e.g. the target's per-row cost at the batch size decoding now runs at). The drafter's own
        costs are kept in units of the new one-token forward: a draft forward that cost 0.5 of a
        lone row's step costs 0.5 · t1_old / t1_new of a row's share of a batched step."""
        if self.verify_cost is None:
            raise ValueError("reprice replaces a measured verify cost; this length uses the constants")
        scale = self.verify_cost.seconds[0] / verify_cost.seconds[0]
        self.draft_token_cost *= scale
        self.draft_step_cost *= scale
        self.lone_forward *= scale
        self.verify_cost = verify_cost


def observed_evidence(evidence: list[float], accepted: float, predicted: float) -> list[float]:
    """A drafter's forgetting sums [accepted, predicted tokens] after a step: when the step's draft predicted
    ``predicted`` tokens, both decay by 0.95 and take the step's counts; after a step that drafted nothing they
    decay by 0.995, slowly back to the prior, so a drafter that stopped tries again."""
    if predicted:
        return [0.95 * evidence[0] + accepted, 0.95 * evidence[1] + predicted]
    return [0.995 * e for e in evidence]


def calibration_of(evidence: list[float]) -> float:
    """Accepted over predicted tokens from a drafter's forgetting sums, with a prior of 2 steps as predicted:
    what its own probability estimates are multiplied by."""
    return (evidence[0] + 2.0) / (evidence[1] + 2.0)


def batch_bucket(rows: int) -> int:
    """The batch size verify costs are measured at for ``rows`` rows: the next power of two (the
    per-row cost curve changes slowly with the batch, and each size measured is a disk entry)."""
    return 1 << max(0, rows - 1).bit_length()


def price_for_batch(drafters, target, rows: int) -> None:
    """Price each drafter's drafts for verification among ``rows`` rows (batched decoding; called
    again as rows finish): every drafter priced by measurement (cost_source "measured") is
    repriced (``Drafter.reprice``) with the target's per-row verify cost at ``batch_bucket(rows)``. On a CPU a batched forward is
    compute-bound, so a draft that paid for itself alone may not in a batch: the lengths then
    draft less, or nothing. Drafters priced otherwise keep their prices."""
    measured = [d for d in drafters if d.cost_source == "measured"]
    if measured:
        cost = target.verify_cost(batch=batch_bucket(rows))
        for drafter in measured:
            drafter.reprice(cost)


def best_paying_sequoia_tree(accept: Sequence[float], verify_cost: VerifyCost, max_nodes: int,
                     max_depth: int | None = 8, draft_token_cost: float = 0.0):
    """The node count n (root included) and Sequoia tree maximising expected tokens per second:
    (1 + expected accepted of the best n-node tree) / (t(n) / t(1) + draft_token_cost * (n - 1)).

    accept: positional acceptance vector (flashmm.tree.shapes). Returns (n, tree, tokens per forward-unit).
    """
    best = (1, None, 1.0)
    for n in range(1, max_nodes + 1):
        value, tree = sequoia_tree(accept, n, max_depth)
        rate = (1.0 + value) / (verify_cost.relative(n) + draft_token_cost * (n - 1))
        if rate > best[2] + 1e-12 or best[1] is None:
            best = (n, tree, rate)
    return best


def sequoia_rank_paths(accept: Sequence[float], max_tokens: int, depth: int | None,
                       verify_cost: VerifyCost | None) -> list[tuple[int, ...]]:
    """Rank paths of the Sequoia tree for ``accept`` with at most ``max_tokens`` drafted nodes: with a
    measured ``verify_cost``, the node count maximising expected tokens per unit of verify time
    (best_paying_sequoia_tree; possibly no node), else all ``max_tokens`` of them."""
    if verify_cost is not None:
        _, tree, _ = best_paying_sequoia_tree(accept, verify_cost, max_tokens + 1, depth)
    else:
        _, tree = sequoia_tree(accept, max_tokens + 1, depth)
    return tree.rank_paths()
