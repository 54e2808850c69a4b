"""How a batch's drafts are cut before its one verification forward: each row's own count on a packed step
(``packed_cuts``), one width for every row elsewhere (``batch_width``), and a fixed batch's critical path
(``critical_cuts``); ``BatchPricing`` reprices the rows' drafters as the batch changes size."""
from __future__ import annotations

import heapq

from ..drafters.base import Drafter
from ..targets.base import Target
from ..tree.cost import batch_bucket, measured_verify_cost, price_for_batch


def batch_width(drafts: list, verify_cost) -> int:
    """The node count W every row's tree is cut to for one padded forward (each row pays for W
    nodes, whatever its own size): the W maximising the rows' expected tokens per unit of verify
    time, sum_b (1 + sum_{0 < i < min(n_b, W)} values_b[i]) / (t(W) / t(1)), with values_b a
    draft's ``values`` (its nodes' estimated chances to be accepted, in node order). A draft
    without values is never cut (W is at least its size) and counts its root only."""
    floor = max([d.tree.num_nodes for d in drafts if d.values is None], default=1)
    widest = max(d.tree.num_nodes for d in drafts)
    if floor >= widest:
        return widest
    gains = [d.values.float().cpu().cumsum(0) for d in drafts if d.values is not None]  # [n_b]
    fixed = len(drafts) - len(gains)
    best, best_rate = floor, float("-inf")
    for width in range(floor, widest + 1):
        tokens = fixed + sum(float(g[min(width, g.numel()) - 1]) for g in gains)
        rate = tokens / verify_cost.relative(width)
        if rate > best_rate + 1e-12:
            best, best_rate = width, rate
    return best


def packed_cuts(drafts: list, verify_cost) -> list[int]:
    """Each row's node count for one forward that computes every row's own nodes alone (the fused step's
    packed batch, flashmm.targets.fused): N nodes over B rows cost about what B rows of N / B nodes each do,
    t(N / B). Nodes are added most valuable first across the rows (each row's in its own order, a draft's
    ``values``), and the counts kept are those with the most expected tokens per unit of verify time,
    sum_b (sum_{i < n_b} values_b[i]) / (t(N / B) / t(1)). A draft without values is never cut and counts
    its root only."""
    rows = len(drafts)
    gains = [None if d.values is None else d.values.float().cpu().tolist() for d in drafts]
    counts = [d.tree.num_nodes if g is None else 1 for d, g in zip(drafts, gains)]
    tokens = sum(1.0 if g is None else g[0] for g in gains)

    def rate() -> float:
        return tokens / (verify_cost.seconds_at(sum(counts) / rows) / verify_cost.seconds[0])

    best, best_rate = list(counts), rate()
    ahead = [(-g[1], b) for b, g in enumerate(gains) if g is not None and len(g) > 1]
    heapq.heapify(ahead)
    while ahead:
        value, b = heapq.heappop(ahead)
        counts[b] += 1
        tokens -= value
        now = rate()
        if now > best_rate + 1e-12:
            best, best_rate = list(counts), now
        if counts[b] < len(gains[b]):
            heapq.heappush(ahead, (-gains[b][counts[b]], b))
    return best


def critical_cuts(drafts: list, critical: list[bool], verify_cost, packed: bool) -> list[int] | None:
    """Each row's node count when the batch's time is its slowest row's: a fixed batch (no row waits to take a
    finished row's place), whose step costs about the same for any number of rows (a small model on a CPU reads
    its weights once a step), so a row that finishes early saves little, and only the ``critical`` rows (the
    most tokens left to write) decide how many steps remain. They advance past a step's one token only together:
    with every critical row drafting a chain of d tokens, the steps saved per step are the expected minimum of
    their accepted counts, sum_{k <= d} prod_r values_r[k] (values_r[k]: the chance that node k is accepted,
    rows independent). The d (0: no row drafts) with the most of it per unit of verify time is kept, every other
    row verifying its root alone: eight Spec-Bench rows under prompt lookup, where some row always has no match,
    then stop paying for drafts that end no step earlier. None (not priced here) when a draft is not a chain with
    values, or a row without one is critical."""
    if any(not d.tree.is_chain or (d.values is None and d.tree.num_nodes > 1) for d in drafts):
        return None
    chances = [[1.0] if d.values is None else d.values.float().cpu().tolist() for d in drafts]
    lagging = [b for b, on in enumerate(critical) if on]
    rows, best, best_rate, saved = len(drafts), 0, 1.0, 0.0
    for depth in range(1, min(len(chances[b]) for b in lagging)):
        product = 1.0
        for b in lagging:
            product *= chances[b][depth]
        saved += product
        cost = verify_cost.seconds_at((rows + depth * len(lagging)) / rows) if packed else \
            verify_cost.seconds_at(depth + 1)
        rate = (1.0 + saved) / (cost / verify_cost.seconds[0])
        if rate > best_rate + 1e-12:
            best, best_rate = depth, rate
    return [best + 1 if on else 1 for on in critical]


class BatchPricing:
    """What a step costs with ``rows`` rows verified together, for the drafters of a batch: each
    drafter prices its drafts for its row's share (tree.cost.price_for_batch), and drafts
    with ``values`` are cut on the measured cost: each to its own count when the forward computes
    each row's own nodes (``packed``, ``packed_cuts``), else to one batch-wide width (``batch_width``),
    since every row then pays for the widest."""

    def __init__(self, target: Target, drafters: list[Drafter], packed: bool = False):
        self.target, self.bucket, self.costs = target, None, {}  # costs: bucket -> VerifyCost | None
        self.packed = packed
        self.priced(drafters)

    def priced(self, drafters: list[Drafter]) -> None:
        """Reprice ``drafters`` (the running rows') when their count changes bucket."""
        bucket = batch_bucket(len(drafters))
        if bucket != self.bucket:
            self.bucket = bucket
            price_for_batch(drafters, self.target, len(drafters))

    def fit(self, drafters: list[Drafter], drafts: list, critical: list[bool] | None = None) -> list:
        """The drafts cut to one width (only when several rows run and some draft carries values); with
        ``critical`` (a fixed batch: which rows have the most tokens left), to ``critical_cuts``' counts where it
        prices them."""
        if len(drafts) < 2 or all(d.values is None for d in drafts):
            return drafts
        if self.bucket not in self.costs:
            self.costs[self.bucket] = measured_verify_cost(self.target, self.bucket)[0]
        cost = self.costs[self.bucket]
        if cost is None:
            return drafts
        cuts = None if critical is None else critical_cuts(drafts, critical, cost, self.packed)
        if cuts is None:
            cuts = packed_cuts(drafts, cost) if self.packed else [batch_width(drafts, cost)] * len(drafts)
        return [drafter.cut(d, cut) if d.values is not None and d.tree.num_nodes > cut else d
                for drafter, d, cut in zip(drafters, drafts, cuts)]
