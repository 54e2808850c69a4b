"""How many tokens to draft: the choice that maximises expected tokens per unit of verify time.

The verify cost of N tree nodes is either measured on this machine (``measure_verify_cost``:
the target's forward of N new tokens after a cached prefix, through the linear backend its tree
forwards use, timed once per model, machine, device, dtype, thread count and backend, cached on
disk) or,
without a measurement, the linear model ``1 + step_cost + token_cost * k`` whose defaults are CPU
figures for SmolLM2-135M. Drafters with ``budget = "auto"`` (the default) take the measurement at
``bind`` (``price_with_target``); ``budget = "constants"`` keeps the linear model.

Why it matters: on the 2-core EPYC these benchmarks run on, MKL's fp32 sgemm makes a 2- or 3-row
forward of SmolLM2 *slower* than a 4-row one (103 / 119 / 92 ms against 64 ms for one row),
while oneDNN, which flashmm's tree forwards use, costs 47 / 58 / 62 / 57 ms. A cost measured on
the other backend, or the constants, misprice every small draft.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from .. import cache as kv
from ..onednn import OneDNNLinears, packs, routable_layers
from . import disk_cache
from .disk_cache import cache_dir  # noqa: F401 (re-exported: flashmm.drafters.length.cache_dir)

# every size up to 8 and the neighbours of 12 and 18: a CPU's sgemm works in blocks of rows (6 on
# AVX2), so the time is a staircase, not a line, and a grid that skips steps misprices them
DEFAULT_GRID = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 16, 18, 19, 24, 32, 48, 64)


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
    """The model cannot be timed by ``measure_verify_cost``: its state cannot be cropped back to the
    prefix (recurrent layers), or it refuses a cached multi-token forward. Drafts are then priced
    by the constants."""


# what a model's forward raises when it cannot take flashmm's cache or a cached multi-token forward
# (a recurrent mixer indexing layers a DynamicCache lacks, a mask of the wrong size, a NotImplemented path)
_REFUSALS = (AttributeError, IndexError, NotImplementedError, RuntimeError, TypeError, ValueError)
_COST_FORMAT = "verify-cost-2"   # the entry's layout and the timing method (rounds over sizes, staircase kept)
# costs measured in this process whose entry could not be written (an unwritable cache directory):
# without them every wrap and every batch size change would time the model again
_unstored: dict[Path, VerifyCost] = {}


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what platform reports)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("model name", "Hardware", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_identity(device: torch.device) -> dict:
    """What a forward's time depends on besides the model: the CPU model and core count, the
    accelerator ``device`` is on, torch's version and its intra-op threads."""
    ident = {"cpu": _cpu_model(), "arch": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
             "threads": torch.get_num_threads(), "device": device.type}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        ident["device"] = f"cuda {torch.cuda.get_device_name(device)} (sm {major}.{minor})"
    return ident


def _cost_identity(model: torch.nn.Module, grid: Sequence[int], prefix_len: int, linear: str, batch: int) -> dict:
    """Everything a measurement depends on: the model (class, config, dtype), the machine, the
    grid, prefix, linear backend and batch. JSON-shaped, stored in the entry and compared on read."""
    param = next(model.parameters())
    config = model.config.to_json_string(use_diff=False) if hasattr(model, "config") else type(model).__name__
    return {"format": _COST_FORMAT, "model": type(model).__name__, "config": config, "dtype": str(param.dtype),
            "machine": machine_identity(param.device), "grid": [int(n) for n in grid], "prefix_len": prefix_len,
            "linear": linear, "batch": batch}


def _cost_path(directory: Path, identity: dict) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return directory / f"verify_cost_{digest}.json"


def _read_cost(path: Path, identity: dict) -> tuple[VerifyCost | None, str]:
    """(the cost in entry ``path``, "") when it is a valid entry for ``identity``, else (None, why
    not): unreadable, not JSON, a key missing, another machine's or model's, or timings that are
    not finite positive seconds, none below the one-token forward's (as measure_verify_cost writes)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"unreadable: {type(err).__name__}: {err}"
    if not isinstance(data, dict) or not {"identity", "nodes", "seconds"} <= set(data):
        return None, f"expected an object with identity, nodes and seconds, got {str(data)[:80]!r}"
    if data["identity"] != identity:
        return None, "written for another machine, model or setting"
    nodes, seconds = data["nodes"], data["seconds"]
    if nodes != identity["grid"] or not isinstance(seconds, list) or len(seconds) != len(nodes):
        return None, f"nodes {nodes} do not match the grid {identity['grid']} or the seconds {seconds}"
    if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in seconds):
        return None, f"seconds must be finite positive numbers, got {seconds}"
    if min(seconds) < seconds[0]:
        return None, f"a size timed below the one-token forward ({seconds}), which the measurement never writes"
    return VerifyCost(tuple(nodes), tuple(float(t) for t in seconds)), ""


@torch.no_grad()
def measure_verify_cost(model: torch.nn.Module, grid: Sequence[int] = DEFAULT_GRID, prefix_len: int = 128,
                        repeats: int = 5, directory: Path | None = None, linear: str = "torch",
                        batch: int = 1) -> VerifyCost:
    """Time ``model``'s forward of N new tokens after a ``prefix_len``-token cache for N in grid:
    the fastest of ``repeats`` rounds over every size (after one warm-up round), never below the
    one-token forward's.

    batch: rows forwarded together (each N new tokens after its own prefix); the seconds returned
    are per row, a batch forward's time / batch, so ``seconds[0]`` is one row's share of a plain
    batched decoding step and ``relative(n)`` what drafting n - 1 tokens in every row costs.
    Measured once per (model class, config and dtype, machine: CPU model, core count, accelerator,
    torch version and threads; grid, prefix, linear backend, batch) and cached as JSON under
    ``directory`` (default ``cache_dir()``); later calls read the file. An entry that is not valid
    for this identity (unreadable, a key missing, non-finite or non-positive seconds, another
    machine's) is measured again and overwritten, with a warning; an unwritable directory leaves
    the cost in this process only (flashmm.drafters.disk_cache warns once). ``linear="onednn"``
    times the forwards with the model's linears on oneDNN (flashmm.onednn), as a text target's tree
    forwards run them; ``linear="fused"`` times the model's fused step (flashmm.targets.fused), which a
    target of the Llama families verifies on.
    Raises VerifyCostUnmeasurable when the model cannot be timed this way (a recurrent state, a
    model that refuses a cached multi-token forward).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    directory = Path(directory) if directory is not None else disk_cache.cache_dir()
    packed = linear == "onednn" and packs(routable_layers(model))  # (packing itself waits for a measurement)
    identity = _cost_identity(model, grid, prefix_len, linear + "-packed" * packed, batch)
    path = _cost_path(directory, identity)
    if path in _unstored:
        return _unstored[path]
    if path.is_file():
        cost, problem = _read_cost(path, identity)
        if cost is not None:
            return cost
        warnings.warn(f"verify-cost cache entry {path} is invalid ({problem}); measuring again and overwriting it",
                      RuntimeWarning, stacklevel=3)   # (2 is torch.no_grad's wrapper)
    cost = _measure(model, grid, prefix_len, repeats, linear, batch)
    entry = json.dumps({"identity": identity, "nodes": list(cost.nodes), "seconds": list(cost.seconds)})
    if not disk_cache.store(path, lambda fh: fh.write(entry.encode())):
        _unstored[path] = cost
    return cost


def _measure(model: torch.nn.Module, grid: Sequence[int], prefix_len: int, repeats: int, linear: str,
             batch: int) -> VerifyCost:
    """measure_verify_cost's timing, without the cache."""
    from ..targets.recurrent import is_recurrent  # noqa: PLC0415 (targets import drafters' types)

    if hasattr(model, "config") and is_recurrent(model):
        raise VerifyCostUnmeasurable(f"{type(model).__name__} has recurrent layers: their state cannot be cropped "
                                     "back to the prefix between timed forwards")
    param = next(model.parameters())
    head = model.get_output_embeddings()
    if head is None:
        raise VerifyCostUnmeasurable(f"{type(model).__name__} has no output embeddings to size its inputs by")
    vocab = head.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(vocab, (batch, prefix_len), generator=gen).to(param.device)
    # flashmm's own full-length cache, as the targets and drafters use (a model's default cache may
    # evict sliding-window rows, and then cannot be cropped back to the prefix)
    cache = kv.new_cache()
    argument = {kv.cache_argument(model): cache}
    if linear == "fused":
        from ..targets.fused import FusedForward  # noqa: PLC0415 (targets import drafters' types)

        routing = FusedForward(model)
    else:
        routing = OneDNNLinears(model) if linear == "onednn" else nullcontext()
    feeds = [torch.randint(vocab, (batch, n), generator=gen).to(param.device) for n in grid]

    def timed(n: int, feed: torch.Tensor) -> float:
        kv.crop(cache, prefix_len)
        _synchronize(param.device)
        start = time.perf_counter()
        with routing:
            model(input_ids=feed, use_cache=True, logits_to_keep=n, **argument)
        _synchronize(param.device)
        return time.perf_counter() - start

    # the prefix and a warm-up round over every size, never counted: where the model cannot take
    # flashmm's cache or a cached multi-token forward, it fails here, and only here is that read as
    # "not measurable" (a failure in a later round is a bug, and propagates)
    try:
        with routing:  # (the fused step then writes later forwards behind the prefix's rows, as in a decode)
            model(input_ids=prefix, use_cache=True, **argument)
        for n, feed in zip(grid, feeds):
            timed(n, feed)
    except _REFUSALS as err:
        raise VerifyCostUnmeasurable(f"{type(model).__name__} refuses a cached multi-token forward: "
                                     f"{type(err).__name__}: {err}") from err
    # each round times every size once, so a slow spell of a shared machine lands on all sizes alike
    # instead of on one size's repeats
    best = [float("inf")] * len(grid)
    for _ in range(repeats):
        for i, (n, feed) in enumerate(zip(grid, feeds)):
            best[i] = min(best[i], timed(n, feed))
    # no forward is cheaper than the one-token one (a one-token step timed slow once made 3 nodes
    # read 0.59 of a step, and trees of 16 looked free); a larger size timed below a smaller one
    # (2 rows dearer than 4) is the kernel's staircase, and drafts are priced on it as it is
    seconds = [max(b, best[0]) / batch for b in best]
    return VerifyCost(tuple(int(n) for n in grid), tuple(seconds))


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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class AdaptiveDraftLength:
    """Picks the draft length k from a running estimate of per-token acceptance α.

    A chain of k drafts emits (1 - α^(k+1)) / (1 - α) tokens in expectation; verifying it costs
    ``cost(k)`` one-token forwards: with a measured ``verify_cost`` (budget="auto" in the
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
        self.verify_cost = verify_cost


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


def best_tree_budget(accept: Sequence[float], verify_cost: VerifyCost, max_nodes: int,
                     max_depth: int | None = 8, draft_token_cost: float = 0.0):
    """The node count n (root included) and Sequoia tree maximising expected tokens per second:
    (1 + expected accepted of the best n-node tree) / (t(n) / t(1) + draft_token_cost * (n - 1)).

    accept: positional acceptance vector (flashmm.tree.shapes). Returns (n, tree, tokens per forward-unit).
    """
    from ..tree.shapes import sequoia_tree  # noqa: PLC0415 (shapes imports tree, a sibling of drafters)

    best = (1, None, 1.0)
    for n in range(1, max_nodes + 1):
        value, tree = sequoia_tree(accept, n, max_depth)
        rate = (1.0 + value) / (verify_cost.relative(n) + draft_token_cost * (n - 1))
        if rate > best[2] + 1e-12 or best[1] is None:
            best = (n, tree, rate)
    return best


def sequoia_rank_paths(accept: Sequence[float], budget: int, depth: int | None,
                       verify_cost: VerifyCost | None) -> list[tuple[int, ...]]:
    """Rank paths of the Sequoia tree for ``accept`` with at most ``budget`` drafted nodes: with a
    measured ``verify_cost``, the node count maximising expected tokens per unit of verify time
    (best_tree_budget; possibly no node), else all ``budget`` of them."""
    from ..tree.shapes import sequoia_tree  # noqa: PLC0415 (shapes imports tree, a sibling of drafters)

    if verify_cost is not None:
        _, tree, _ = best_tree_budget(accept, verify_cost, budget + 1, depth)
    else:
        _, tree = sequoia_tree(accept, budget + 1, depth)
    return tree.rank_paths()
