"""The verify cost of a model on this machine: its forward of N new tokens after a cached prefix,
timed once per model, machine, device, dtype, thread count and linear backend, and cached on disk
(flashmm.disk_cache). Targets time their own forwards with it (``Target.verify_cost``), draft models
theirs; the planner reads the result as a ``VerifyCost`` (flashmm.tree.cost).

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
from pathlib import Path
from typing import Sequence

import torch

from .. import disk_cache
from ..paths import cache_dir
from ..tree.cost import VerifyCost, VerifyCostUnmeasurable
from . import cache as kv
from ..kernels import blocks as block_kernel
from .fused import FusedForward, fused_step
from .onednn import OneDNNLinears, packs, routable_layers
from .recurrent import is_recurrent

# every size up to 8 and the neighbours of 12 and 18: a CPU's sgemm works in blocks of rows (6 on
# AVX2), so the time is a staircase, not a line, and a grid that skips steps misprices them
DEFAULT_GRID = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 16, 18, 19, 24, 32, 48, 64)
#: on a CPU a batch's forward of more tokens than this is bound by arithmetic (oneDNN's fp32 matmuls run at
#: the same ~220 GFLOP/s from 78 to 1,858 rows on the 2-core EPYC): its time grows linearly with the nodes
BATCH_TOKENS_TIMED = 64


def default_grid(batch: int, device: torch.device) -> tuple[int, ...]:
    """The node counts a batch of ``batch`` rows is timed at: DEFAULT_GRID, and on a CPU with several rows only
    its sizes up to BATCH_TOKENS_TIMED tokens a step, then one at twice that or more, so the last slope
    (``VerifyCost.seconds_at`` extends it linearly) is measured over a doubling where the time is already a
    line. A batch of 4 then times 119 nodes a row a round instead of 355 (SmolLM2 on the 2-core EPYC: 5.7 s
    instead of 10.4 at a first wrap), and prices its drafts by the same staircase up to 16 nodes a row."""
    if batch == 1 or device.type != "cpu":
        return DEFAULT_GRID
    kept = [n for n in DEFAULT_GRID if n == 1 or n * batch <= BATCH_TOKENS_TIMED]   # (one token a row: a plain step)
    beyond = [n for n in DEFAULT_GRID if n > kept[-1] and n * batch >= 2 * BATCH_TOKENS_TIMED]
    return tuple(kept + beyond[:1])


# what a model's forward raises when it cannot take flashmm's cache or a cached multi-token forward
# (a recurrent mixer indexing layers a DynamicCache lacks, a mask of the wrong size, a NotImplemented path)
_REFUSALS = (AttributeError, IndexError, NotImplementedError, RuntimeError, TypeError, ValueError)
_COST_FORMAT = "verify-cost-3"   # the entry's layout, the timing method (rounds over sizes, staircase kept) and the
# step it times (3: the fused step's folded grouped attention)
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
    config = _config_identity(model.config) if hasattr(model, "config") else type(model).__name__
    return {"format": _COST_FORMAT, "model": type(model).__name__, "config": config, "dtype": str(param.dtype),
            "machine": machine_identity(param.device), "grid": [int(n) for n in grid], "prefix_len": prefix_len,
            "linear": linear, "batch": batch}


def _config_identity(config) -> str:
    """``config`` as JSON without what does not change the computation: where the model was read from
    (``_name_or_path``), and a GGUF file's quantization note (transformers dequantizes a GGUF as it loads it,
    so the weights are the dtype's like any other): SmolLM2 read from its GGUF and from the folder converted
    from it are one model, timed once."""
    data = config.to_dict()
    data.pop("_name_or_path", None)
    if (data.get("quantization_config") or {}).get("quant_method") == "gguf":
        data.pop("quantization_config")
    return json.dumps(data, sort_keys=True, default=str)


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
def measure_verify_cost(model: torch.nn.Module, grid: Sequence[int] | None = None, prefix_len: int = 128,
                        repeats: int = 3, directory: Path | None = None, linear: str = "torch",
                        batch: int = 1) -> VerifyCost:
    """Time ``model``'s forward of N new tokens after a ``prefix_len``-token cache for N in grid:
    the fastest of ``repeats`` rounds over every size (after one warm-up round), never below the
    one-token forward's. (Three rounds: SmolLM2's fused step measured twice each way on the 2-core machine,
    the relative costs at 4, 8, 16 and 32 nodes moved as much between two 5-round measurements as between
    two 3-round ones, up to 10-15 %; the first wrap at batch 1 pays 4-5 s instead of 8.)

    grid: the node counts timed; default ``default_grid(batch, device)``.
    batch: rows forwarded together (each N new tokens after its own prefix); the seconds returned
    are per row, a batch forward's time / batch, so ``seconds[0]`` is one row's share of a plain
    batched decoding step and ``relative(n)`` what drafting n - 1 tokens in every row costs.
    Measured once per (model class, config and dtype, machine: CPU model, core count, accelerator,
    torch version and threads; grid, prefix, linear backend, batch) and cached as JSON under
    ``directory`` (default ``cache_dir()``); later calls read the file, once a process spot-checking it against
    two forwards timed now (``_slower_than_now``: an entry timed under load is measured again, and replaced by
    the faster of the two measurements). An entry that is not valid
    for this identity (unreadable, a key missing, non-finite or non-positive seconds, another
    machine's) is measured again and overwritten, with a warning; an unwritable directory leaves
    the cost in this process only (flashmm.disk_cache warns once). ``linear="onednn"``
    times the forwards with the model's linears on oneDNN (flashmm.targets.onednn), as a text target's tree
    forwards run them (``"onednn-bf16"``: in bfloat16, as a draft LM drafts); ``linear="fused"`` times the model's fused step (flashmm.targets.fused), which a
    target of the Llama families verifies on.
    Raises VerifyCostUnmeasurable when the model cannot be timed this way (a recurrent state, a
    model that refuses a cached multi-token forward).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    directory = Path(directory) if directory is not None else cache_dir()
    grid = tuple(grid) if grid is not None else default_grid(batch, next(model.parameters()).device)
    packed = linear == "onednn" and packs(routable_layers(model))  # (packing itself waits for a measurement)
    # block codes multiply at other costs, and each version of their kernel at its own
    blocks = f"-blocks-{block_kernel.version()}" if linear == "fused" and fused_step(model).blocks else ""
    identity = _cost_identity(model, grid, prefix_len, linear + "-packed" * packed + blocks, batch)
    path = _cost_path(directory, identity)
    if path in _unstored:
        return _unstored[path]
    # processes wrapping the same model at once (multi-process captioning's workers) time it once: the others
    # wait and read the entry, instead of each timing forwards slowed by the others' timing
    with disk_cache.exclusive(path):
        if path.is_file():
            cost, problem = _read_cost(path, identity)
            if cost is not None:
                if path in _checked or not _slower_than_now(cost, model, prefix_len, linear, batch):
                    _checked.add(path)
                    return cost
                fresh = _measure(model, grid, prefix_len, repeats, linear, batch)
                _checked.add(path)
                if fresh.seconds[0] >= cost.seconds[0]:     # (this process is the loaded one: the entry stands)
                    return cost
                cost = fresh
            else:
                warnings.warn(f"verify-cost cache entry {path} is invalid ({problem}); measuring again and "
                              "overwriting it", RuntimeWarning, stacklevel=3)   # (2 is torch.no_grad's wrapper)
                cost = _measure(model, grid, prefix_len, repeats, linear, batch)
        else:
            cost = _measure(model, grid, prefix_len, repeats, linear, batch)
        _checked.add(path)
        entry = json.dumps({"identity": identity, "nodes": list(cost.nodes), "seconds": list(cost.seconds)})
        if not disk_cache.store(path, lambda fh: fh.write(entry.encode())):
            _unstored[path] = cost
    return cost


#: how much faster than an entry a spot check must time a forward for the entry to be measured again
#: (``_slower_than_now``): well past a quiet machine's noise (a few percent) and the slowdown of a run beside
#: another, so that processes sharing a machine keep sharing one entry, and within reach of an entry timed
#: while a test run held the cores (2.1x the quiet one-token forward)
SPOT_MARGIN = 0.6
#: the entries this process has spot-checked, or measured itself
_checked: set[Path] = set()


def _slower_than_now(cost: VerifyCost, model: torch.nn.Module, prefix_len: int, linear: str, batch: int) -> bool:
    """Whether a cached entry was timed slower than the forwards run now: its 1-node and 8-node forwards (the
    fastest of three after one warm-up, as the measurement times them) take under SPOT_MARGIN of the entry's.
    An entry measured while other work held the cores (a test run beside a benchmark) priced every draft
    against forwards two to three times slower than the step it drafts for (SmolLM2's block step: 16.2 ms
    for one token where it runs 6.8, and drafted nodes at a tenth of a step where they cost a quarter), and
    every later process read it. The check costs a few forwards once per entry and process; an entry is
    only ever replaced by a faster measurement, so a loaded process never overwrites a quiet one's."""
    sizes = (1, 8) if cost.nodes[-1] >= 8 else (1,)
    timed = _timer(model, sizes, prefix_len, linear, batch)
    best = [min(timed(i) for _ in range(3)) / batch for i in range(len(sizes))]
    return any(now < SPOT_MARGIN * cost.seconds_at(n) for n, now in zip(sizes, best))


def _measure(model: torch.nn.Module, grid: Sequence[int], prefix_len: int, repeats: int, linear: str,
             batch: int) -> VerifyCost:
    """measure_verify_cost's timing, without the cache."""
    timed = _timer(model, grid, prefix_len, linear, batch)
    # each round times every size once, so a slow spell of a shared machine lands on all sizes alike
    # instead of on one size's repeats
    best = [float("inf")] * len(grid)
    for _ in range(repeats):
        for i in range(len(grid)):
            best[i] = min(best[i], timed(i))
    # no forward is cheaper than the one-token one (a one-token step timed slow once made 3 nodes
    # read 0.59 of a step, and trees of 16 looked free); a larger size timed below a smaller one
    # (2 rows dearer than 4) is the kernel's staircase, and drafts are priced on it as it is
    seconds = [max(b, best[0]) / batch for b in best]
    return VerifyCost(tuple(int(n) for n in grid), tuple(seconds))


def _timer(model: torch.nn.Module, grid: Sequence[int], prefix_len: int, linear: str, batch: int):
    """``timed(i)``: the seconds of one forward of grid[i] new tokens in each of ``batch`` rows after a
    ``prefix_len``-token cache, through the ``linear`` backend; the prefix and one warm-up round over the
    grid already run."""
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
        routing = FusedForward(model)
    else:
        routing = OneDNNLinears(model, bf16=linear == "onednn-bf16") if linear.startswith("onednn") else nullcontext()
    feeds = [torch.randint(vocab, (batch, n), generator=gen).to(param.device) for n in grid]

    def timed(i: int) -> float:
        n, feed = grid[i], feeds[i]
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
        for i in range(len(grid)):
            timed(i)
    except _REFUSALS as err:
        raise VerifyCostUnmeasurable(f"{type(model).__name__} refuses a cached multi-token forward: "
                                     f"{type(err).__name__}: {err}") from err
    return timed


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
