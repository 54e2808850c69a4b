"""The on-disk verify-cost cache never makes flashmm fail or slow: an unwritable directory costs one
warning, an entry that is damaged (a key missing, NaN) or another machine's is measured again and
overwritten, the entry's key names the machine, and in each case ``wrap`` works and drafting happens.

The timing itself (flashmm.targets.verify_cost._measure) is replaced by a counting stand-in with a fixed,
cheap cost curve, so each test sees exactly when a measurement runs; tests/test_pricing.py times real
forwards."""
from __future__ import annotations

import json
import math
import threading
import warnings

import pytest
import torch

import flashmm
from flashmm import disk_cache
from flashmm.targets import verify_cost
from flashmm.targets.verify_cost import measure_verify_cost
from flashmm.tree import cost as cost_model
from flashmm.tree.cost import VerifyCost, VerifyCostUnmeasurable

from text_models import tiny_lm


def cheap(grid) -> tuple[float, ...]:
    """Seconds of a verify cost under which drafting pays: 2% more per extra node."""
    return tuple(0.01 * (1 + 0.02 * (n - 1)) for n in grid)


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The batch sizes measured so far (one entry per measurement); the cache lives in tmp_path."""
    monkeypatch.setenv("FLASHMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(verify_cost, "_unstored", {})
    monkeypatch.setattr(verify_cost, "_checked", set())
    monkeypatch.setattr(verify_cost, "_slower_than_now", lambda *args: False)   # (stand-in entries are not timings)
    monkeypatch.setattr(disk_cache, "_warned", set())
    calls = []

    def stand_in(model, grid, prefix_len, repeats, linear, batch):
        calls.append(batch)
        return VerifyCost(tuple(grid), cheap(grid))
    monkeypatch.setattr(verify_cost, "_measure", stand_in)
    return calls


@pytest.fixture(scope="module")
def target():
    return tiny_lm("llama", seed=0)


def repetitive_prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    seg = torch.randint(3, 128, (10,), generator=g)
    return torch.cat([seg, seg, seg[:4]])[None]


def assert_drafts_exactly(target, sm) -> None:
    """sm decodes as target.generate does, and drafts while doing it (a cost that switched drafting
    off would draft nothing)."""
    ids = repetitive_prompt()
    out = sm.generate(ids, do_sample=False, max_new_tokens=12)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=12))
    assert sm.drafter.cost_source == "measured" and sm.last_stats.drafted_tokens > 0


def the_entry(directory):
    (entry,) = directory.glob("verify_cost_*.json")
    return entry


def test_an_unwritable_cache_directory_costs_one_warning_not_an_error(target, measured, tmp_path, monkeypatch):
    """Read-only (simulated: tests run as root, so the temporary file cannot be created): every wrap
    works, the cost is measured once per process, and one warning names the directory."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))
    monkeypatch.setattr(disk_cache.tempfile, "mkstemp", refuse)
    with pytest.warns(RuntimeWarning, match=f"cache directory {tmp_path} cannot be written") as caught:
        first = flashmm.wrap(target, "prompt_lookup")
        second = flashmm.wrap(target, "prompt_lookup")
        cost_model.price_for_batch([first.drafter], first.target, rows=2)
        cost_model.price_for_batch([first.drafter], first.target, rows=2)
    assert sum("cannot be written" in str(w.message) for w in caught) == 1
    assert measured == [1, 2]                       # batch 1 once for both wraps, batch 2 once
    assert not list(tmp_path.glob("verify_cost_*")) and not list(tmp_path.glob(".verify_cost_*.tmp"))
    assert_drafts_exactly(target, second)


def test_a_measurement_under_way_is_waited_for_and_read_not_repeated(target, measured, monkeypatch):
    """Two wraps timing the same model at once (threads here; processes lock the same way): the second
    waits for the first's entry and reads it, so the model is timed once, not twice at half speed."""
    inside, release = threading.Event(), threading.Event()
    stand_in = verify_cost._measure

    def slow(*args):
        inside.set()
        assert release.wait(30)
        return stand_in(*args)
    monkeypatch.setattr(verify_cost, "_measure", slow)
    costs = {}
    first = threading.Thread(target=lambda: costs.setdefault("first", measure_verify_cost(target)))
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=lambda: costs.setdefault("second", measure_verify_cost(target)))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second measurement must wait for the first"
    release.set()
    first.join(30)
    second.join(30)
    assert measured == [1] and costs["first"] == costs["second"]


def test_the_lock_orders_holders_and_an_unwritable_directory_runs_unlocked(tmp_path, monkeypatch):
    """A second holder of the same entry's lock enters after the first leaves; where no lock file can be
    made, the block runs anyway, with the directory's one warning."""
    entry, order = tmp_path / "entry", []

    def wait_then_enter():
        with disk_cache.exclusive(entry):
            order.append("waiter")
    with disk_cache.exclusive(entry):
        waiter = threading.Thread(target=wait_then_enter)
        waiter.start()
        waiter.join(0.3)
        order.append("holder")
    waiter.join(30)
    assert order == ["holder", "waiter"]

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))
    monkeypatch.setattr(disk_cache, "_warned", set())
    monkeypatch.setattr(disk_cache.os, "open", refuse)
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        with disk_cache.exclusive(tmp_path / "other"):
            order.append("unlocked")
    assert order[-1] == "unlocked"


def drop_seconds(entry: dict) -> None:
    del entry["seconds"]


def nan_seconds(entry: dict) -> None:
    entry["seconds"] = [math.nan] * len(entry["seconds"])


def another_machines(entry: dict) -> None:
    """Another machine's timings under this machine's name (copied, or a hash collision), steep
    enough that no draft would pay under them."""
    entry["identity"]["machine"]["cpu"] = "Other CPU @ 1.0GHz"
    entry["seconds"] = [1.0 + 50.0 * (n - 1) for n in entry["nodes"]]


def not_json(entry: dict) -> None:
    raise ValueError("replaced below")


@pytest.mark.parametrize("damage", [drop_seconds, nan_seconds, another_machines, not_json],
                         ids=["missing key", "NaN", "another machine", "not JSON"])
def test_an_invalid_entry_is_measured_again_and_overwritten(target, measured, tmp_path, damage):
    flashmm.wrap(target, "prompt_lookup")
    assert measured == [1]
    entry = the_entry(tmp_path)
    data = json.loads(entry.read_text())
    if damage is not_json:
        entry.write_text(entry.read_text()[:40])
    else:
        damage(data)
        entry.write_text(json.dumps(data))
    with pytest.warns(RuntimeWarning, match=f"{entry} is invalid.*measuring again"):
        sm = flashmm.wrap(target, "prompt_lookup")
    assert measured == [1, 1]
    rebuilt = json.loads(entry.read_text())
    assert rebuilt["seconds"] == list(cheap(rebuilt["nodes"]))
    assert rebuilt["identity"]["machine"]["cpu"] != "Other CPU @ 1.0GHz"
    assert all(model.verify_cost.seconds == cheap(model.verify_cost.nodes) for model in sm.drafter.cost_models())
    assert_drafts_exactly(target, sm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # the rewritten entry is read with no warning
        flashmm.wrap(target, "prompt_lookup")
    assert measured == [1, 1]


def test_an_entry_timed_under_load_is_measured_again_and_a_faster_one_stands(tmp_path, monkeypatch):
    """A process spot-checks an entry once (its 1- and 8-node forwards timed now): one whose forwards took ten
    times longer than they do now (timed while other work held the cores) is measured again and replaced; one
    faster than now (this process is the loaded one) stands, and is not timed again in this process."""
    monkeypatch.setenv("FLASHMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(verify_cost, "_unstored", {})
    model = tiny_lm("llama", seed=0)
    timers = []
    real_timer = verify_cost._timer
    monkeypatch.setattr(verify_cost, "_timer", lambda *args: timers.append(args[1]) or real_timer(*args))
    monkeypatch.setattr(verify_cost, "_checked", set())
    first = measure_verify_cost(model)
    entry = the_entry(tmp_path)
    data = json.loads(entry.read_text())
    assert tuple(data["seconds"]) == first.seconds and len(timers) == 1

    data["seconds"] = [10 * t for t in first.seconds]                           # timed under load
    entry.write_text(json.dumps(data))
    monkeypatch.setattr(verify_cost, "_checked", set())                         # (a new process)
    again = measure_verify_cost(model)
    assert timers[1:] == [(1, 8), tuple(first.nodes)]                           # spot check, then measured
    assert again.seconds[0] < 5 * first.seconds[0] and json.loads(entry.read_text())["seconds"] == list(again.seconds)

    data["seconds"] = [t / 10 for t in first.seconds]                           # faster than anything now
    entry.write_text(json.dumps(data))
    monkeypatch.setattr(verify_cost, "_checked", set())
    kept = measure_verify_cost(model)
    assert kept.seconds == tuple(data["seconds"]) and json.loads(entry.read_text()) == data
    assert timers[3:] == [(1, 8)]
    assert measure_verify_cost(model).seconds == kept.seconds and timers[4:] == []   # checked once a process


def test_the_key_identifies_the_machine(target, measured, tmp_path, monkeypatch):
    """The same model on a machine with another CPU (or torch, or thread count) gets its own entry:
    it is measured, not read from this machine's."""
    flashmm.wrap(target, "prompt_lookup")
    here = json.loads(the_entry(tmp_path).read_text())["identity"]
    assert here["machine"]["threads"] == torch.get_num_threads() and here["machine"]["torch"] == torch.__version__
    assert here["machine"]["cpu"] and here["machine"]["cpus"]
    monkeypatch.setattr(verify_cost, "_cpu_model", lambda: "Other CPU @ 1.0GHz")
    sm = flashmm.wrap(target, "prompt_lookup")
    assert measured == [1, 1] and len(list(tmp_path.glob("verify_cost_*.json"))) == 2
    identities = [json.loads(p.read_text())["identity"] for p in tmp_path.glob("verify_cost_*.json")]
    assert sorted(i["machine"]["cpu"] for i in identities) == sorted([here["machine"]["cpu"], "Other CPU @ 1.0GHz"])
    assert_drafts_exactly(target, sm)


def test_a_cost_must_be_finite_and_positive():
    with pytest.raises(ValueError, match="finite and positive"):
        VerifyCost((1, 2), (0.01, math.nan))
    with pytest.raises(ValueError, match="finite and positive"):
        VerifyCost((1, 2), (0.01, math.inf))


def test_only_a_model_that_refuses_the_forward_is_priced_by_constants(tmp_path):
    """A model that cannot take a cached multi-token forward raises VerifyCostUnmeasurable (and its
    drafts keep the constants); a failure after the model has run every size once is not that, and
    propagates instead of being read as "not measurable"."""
    model = tiny_lm("llama", seed=0)
    forwards = []

    def refuse_multi_token(module, args, kwargs):
        forwards.append(kwargs["input_ids"].shape[1])
        if len(forwards) > 1 and kwargs["input_ids"].shape[1] > 1:
            raise RuntimeError("this model takes one token at a time after its prefix")
    hook = model.register_forward_pre_hook(refuse_multi_token, with_kwargs=True)
    try:
        with pytest.raises(VerifyCostUnmeasurable, match="refuses a cached multi-token forward.*one token at a time"):
            measure_verify_cost(model, grid=(1, 2), prefix_len=8, repeats=1, directory=tmp_path)
    finally:
        hook.remove()
    model_bug = []

    def fail_in_a_timed_round(module, args, kwargs):
        model_bug.append(1)
        if len(model_bug) == 4:                                # prefix, warm-up (2 sizes), then a timed forward
            raise RuntimeError("a bug in a timed round")
    hook = model.register_forward_pre_hook(fail_in_a_timed_round, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="a bug in a timed round") as caught:
            measure_verify_cost(model, grid=(1, 2), prefix_len=8, repeats=1, directory=tmp_path / "other")
    finally:
        hook.remove()
    assert not isinstance(caught.value, VerifyCostUnmeasurable)


def test_one_model_read_from_two_places_is_timed_once(measured):
    """The entry's key leaves out where the model was read from and a GGUF's quantization note (its weights are
    dequantized on loading), and keeps any other quantization: SmolLM2 read from its GGUF and from the folder
    converted from it share one measurement."""
    model = tiny_lm("llama", seed=0)
    measure_verify_cost(model)
    model.config._name_or_path = "/somewhere/else"
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "model.Q4_1.gguf", "dequantize": False}
    measure_verify_cost(model)
    assert measured == [1]
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    measure_verify_cost(model)
    assert measured == [1, 1]


def test_a_cpu_batch_is_timed_up_to_its_arithmetic_bound_then_once_past_it():
    """On a CPU, sizes of up to BATCH_TOKENS_TIMED tokens a step and then one at twice that (the line the
    planner extends); one row, or a GPU, the whole grid."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert verify_cost.default_grid(1, cpu) == verify_cost.DEFAULT_GRID == verify_cost.default_grid(4, gpu)
    assert verify_cost.default_grid(4, cpu) == (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 16, 32)
    assert verify_cost.default_grid(8, cpu) == (1, 2, 3, 4, 5, 6, 7, 8, 16)
    assert verify_cost.default_grid(3, cpu)[-2:] == (19, 48)
    for batch in range(2, 200):
        grid = verify_cost.default_grid(batch, cpu)
        assert grid[0] == 1 and len(grid) >= 2 and list(grid) == sorted(set(grid))
        assert set(grid) <= set(verify_cost.DEFAULT_GRID) and grid[-1] * batch >= 2 * verify_cost.BATCH_TOKENS_TIMED
        assert all(n == 1 or n * batch <= verify_cost.BATCH_TOKENS_TIMED for n in grid[:-1])
