"""Every eval speed table reports each method over both baselines, plain ``generate`` (×plain) and
plain ``generate`` on oneDNN linears (×plain_onednn), from the raw numbers of the same run: the
summaries of eval/batch_speed(_mm).py, eval/judge_decoding.py, eval/cascade_drafts.py and
eval/verify_bench.py recomputed by hand on synthetic records (eval/text_speed.py's and
eval/mm_speed.py's: tests/test_text_speed_resume.py, tests/test_mm_speed_smoke.py)."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    sys.path.insert(0, str(ROOT / "eval"))  # the scripts import their sibling common.py
    spec = importlib.util.spec_from_file_location(name, ROOT / "eval" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_legend_names_both_baselines_and_a_missing_one():
    common = script("common")
    legend = common.baseline_legend()
    assert "×plain =" in legend and "×plain_onednn =" in legend and "missing" not in legend
    assert "\n" not in legend  # one line
    assert "missing from this table" in common.baseline_legend("no oneDNN here")
    assert common.over(3.0, 2.0) == 1.5 and common.over(3.0, None) is None
    lines = common.speedup_lines({"plain_onednn": {"speedup": 1.5, "over_plain_onednn": 1.0},
                                  "flash": {"speedup": 3.0, "over_plain_onednn": None}}, ["plain", "plain_onednn", "flash"])
    assert lines.splitlines() == ["plain_onednn: 1.50× plain generate, 1.00× plain_onednn",
                                  "flash: 3.00× plain generate, - plain_onednn"]


def test_batch_summaries_divide_the_same_tokens_by_each_baselines_seconds():
    common = script("common")
    records = [{"batch_size": 4, "tokens": 100, "plain": {"seconds": 10.0, "exact_rows": 4, "rows": 4},
                "plain_onednn": {"seconds": 6.0, "exact_rows": 4, "rows": 4},
                "flashmm:x": {"seconds": 4.0, "exact_rows": 3, "rows": 4, "verify_steps": 10, "accepted": 20}},
               {"batch_size": 4, "tokens": 60, "plain": {"seconds": 6.0, "exact_rows": 4, "rows": 4},
                "plain_onednn": {"seconds": 4.0, "exact_rows": 4, "rows": 4},
                "flashmm:x": {"seconds": 2.0, "exact_rows": 4, "rows": 4, "verify_steps": 10, "accepted": 10}}]
    names = ["plain", "plain_onednn", "flashmm:x"]
    m = common.summarize_batches(records, names, [4])[4]["flashmm:x"]
    assert m["tok_per_s"] == pytest.approx(160 / 6.0)
    assert m["speedup"] == pytest.approx((160 / 6.0) / (160 / 16.0))
    assert m["over_plain_onednn"] == pytest.approx((160 / 6.0) / (160 / 10.0))
    assert m["exact_rate"] == pytest.approx(7 / 8) and m["tau"] == pytest.approx(50 / 20)
    without = common.summarize_batches([{k: v for k, v in r.items() if k != "plain_onednn"} for r in records],
                                       ["plain", "flashmm:x"], [4])[4]["flashmm:x"]
    assert without["over_plain_onednn"] is None and without["speedup"] == pytest.approx(m["speedup"])


def text_records(**extra) -> list[dict]:
    """Two questions, 10 tokens per method each: plain 2.0 / 4.0 s, plain_onednn 1.5 / 2.5 s,
    flashmm 1.0 / 1.25 s (CPU seconds: wall + 0.5)."""
    def entry(seconds, **more):
        return {"new_tokens": 10, "seconds": seconds, "cpu_seconds": seconds + 0.5, "exact": True, **more}

    stats = dict(verify_steps=4, accepted=6, **extra)
    return [{"id": 1, "category": "math", "plain": entry(2.0), "plain_onednn": entry(1.5), "x": entry(1.0, **stats)},
            {"id": 2, "category": "qa", "plain": entry(4.0), "plain_onednn": entry(2.5), "x": entry(1.25, **stats)}]


def test_judge_decoding_summary_over_both_baselines():
    judge = script("judge_decoding")
    records = text_records()
    for r in records:
        for name in ("plain", "plain_onednn", "x"):
            r[name]["answer_agrees"] = True
    s = judge.summarize(records, ["plain", "plain_onednn", "x"])
    m = s["overall"]["x"]
    assert m["speedup"] == pytest.approx(6.0 / 2.25) and m["over_plain_onednn"] == pytest.approx(4.0 / 2.25)
    assert m["tau"] == pytest.approx(10 / 4) and "tau" not in s["overall"]["plain_onednn"]
    assert s["math"]["n"] == 1 and s["math"]["x"]["over_plain_onednn"] == pytest.approx(1.5)


def test_cascade_summary_is_cpu_time_over_both_baselines():
    cascade = script("cascade_drafts")
    s = cascade.summarize(text_records(drafted=12, draft_forwards=8), ["plain", "plain_onednn", "x"])
    over_plain, over_onednn = cascade.CPU_KEYS
    assert s["x"][over_plain] == pytest.approx(7.0 / 3.25)
    assert s["x"][over_onednn] == pytest.approx(5.0 / 3.25)
    assert s["plain_onednn"][over_plain] == pytest.approx(7.0 / 5.0) and "tau" not in s["plain_onednn"]
    assert s["x"]["tau"] == pytest.approx(10 / 4) and s["x"]["draft_forwards_per_step"] == pytest.approx(2.0)


def test_verify_bench_medians_over_both_baselines_and_older_records():
    bench = script("verify_bench")
    key = ("chain: block", 8, 1.0)

    def entry(seconds):
        return {"new_tokens": 10, "seconds": seconds, "cpu_seconds": seconds}

    row = {"verify_steps": 4, "accepted": 4, "first_drafted": 4, "first_accepted": 2}
    records = [{"plain@1.0": {**entry(2.0), "bound": {"positions": 10, "1": 5.0}}, "plain_onednn@1.0": entry(1.5),
                "chain: block|8|1.0": {**entry(1.0), **row}},
               {"plain@1.0": {**entry(3.0), "bound": {"positions": 10, "1": 5.0}}, "plain_onednn@1.0": entry(2.0),
                "chain: block|8|1.0": {**entry(1.0), **row}}]
    c = bench.summarize(records, {key: (None, 1)})["chain: block|8|1.0"]
    assert c["speedup"] == pytest.approx(2.5) and c["over_plain_onednn"] == pytest.approx(1.75)
    assert c["cpu_speedup"] == pytest.approx(2.5) and c["cpu_over_plain_onednn"] == pytest.approx(1.75)
    assert bench.speed_cell(c) == "2.50× / 1.75× (CPU 2.50× / 1.75×)"
    older = [{k: v for k, v in r.items() if not k.startswith("plain_onednn")} for r in records]
    c = bench.summarize(older, {key: (None, 1)})["chain: block|8|1.0"]
    assert c["over_plain_onednn"] is None and bench.speed_cell(c) == "2.50× / - (CPU 2.50× / -)"
