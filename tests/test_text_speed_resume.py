"""eval/text_speed.py --resume: a run split across sessions keeps the questions already written, and
refuses to mix in records of a run with other arguments."""
import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def text_speed():
    sys.path.insert(0, str(ROOT / "eval"))  # text_speed imports its sibling common.py
    spec = importlib.util.spec_from_file_location("text_speed", ROOT / "eval" / "text_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resume_keeps_the_records_of_the_same_run_and_refuses_another(tmp_path):
    module = text_speed()
    out = tmp_path / "run"
    args = argparse.Namespace(drafters=["prompt_lookup"], max_new_tokens=64, questions=Path("q.jsonl"),
                              out=str(out), resume=False)
    assert module.earlier_records(args) == []                       # nothing written yet
    records = [{"id": 81, "category": "writing"}, {"id": 82, "category": "writing"}]
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "records": records}, default=str))
    args.resume = True                                              # the flag itself does not count
    assert module.earlier_records(args) == records
    args.max_new_tokens = 128
    with pytest.raises(ValueError, match="other arguments"):
        module.earlier_records(args)


def test_sampled_runs_time_every_baseline_as_named(monkeypatch):
    """Sampling must not turn the plain_onednn baseline into plain generate (it once did, and sampled
    tables read plain oneDNN at 1.00x): the baseline enters flashmm's step (a Llama: the fused step), plain
    does not."""
    import torch  # noqa: PLC0415

    from flashmm.targets import onednn  # noqa: PLC0415
    from flashmm.targets import fused  # noqa: PLC0415

    sys.path.insert(0, str(ROOT / "tests"))
    from text_models import prompt, tiny_lm  # noqa: PLC0415

    model = tiny_lm("llama", seed=0)
    if onednn.resolve_linear_backend("auto", model) != "onednn":
        pytest.skip("no oneDNN on this machine: there is no plain_onednn baseline")
    entered, enter = [], fused.FusedForward.__enter__
    monkeypatch.setattr(fused.FusedForward, "__enter__", lambda self: (entered.append(1), enter(self))[1])
    sampling = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, generator=torch.Generator().manual_seed(0))
    methods, _ = text_speed().make_methods(model, None, [], False, True, sampling)
    methods["plain"](prompt(5), 3)
    assert not entered
    out = methods["plain_onednn"](prompt(5), 3)
    assert entered and out.shape == (1, 8)


def test_the_draft_budget_reaches_every_wrapped_drafter():
    """--max-draft-tokens sets the engine's budget of every flashmm method (a drafter's own cap,
    such as EAGLE-3's own max_draft_tokens, is then min'd with it); the output stays plain greedy's."""
    sys.path.insert(0, str(ROOT / "tests"))
    from text_models import prompt, tiny_lm  # noqa: PLC0415

    model = tiny_lm("llama", seed=0)
    methods, wrapped = text_speed().make_methods(model, None, ["prompt_lookup"], False, False,
                                                 dict(do_sample=False), None, 40)
    assert wrapped["flashmm:prompt_lookup"].spec.max_draft_tokens == 40
    ids = prompt(12)
    assert methods["flashmm:prompt_lookup"](ids, 10).tolist() == methods["plain"](ids, 10).tolist()


def speed_records() -> list[dict]:
    """Two questions of known seconds: plain 2.0 / 4.0 s, plain_onednn 1.5 / 2.5 s, flashmm 1.0 / 1.25 s
    for 10 tokens each (CPU seconds: the wall ones plus 0.5 s)."""
    def entry(seconds, **extra):
        return {"new_tokens": 10, "seconds": seconds, "cpu_seconds": seconds + 0.5, "exact": True, **extra}

    stats = dict(verify_steps=4, accepted=6)
    return [{"id": 1, "category": "coding", "plain": entry(2.0), "plain_onednn": entry(1.5),
             "flashmm:prompt_lookup": entry(1.0, **stats)},
            {"id": 2, "category": "writing", "plain": entry(4.0), "plain_onednn": entry(2.5),
             "flashmm:prompt_lookup": entry(1.25, **stats)}]


NAMES = ["plain", "plain_onednn", "flashmm:prompt_lookup"]


def test_summary_gives_each_method_over_both_baselines():
    s = text_speed().summarize(speed_records(), NAMES)
    m = s["overall"]["flashmm:prompt_lookup"]
    # total tokens / total seconds over each baseline's (20 tokens apiece)
    assert m["speedup"] == pytest.approx(6.0 / 2.25)
    assert m["over_plain_onednn"] == pytest.approx(4.0 / 2.25)
    assert m["cpu_speedup"] == pytest.approx(7.0 / 3.25)
    assert m["cpu_over_plain_onednn"] == pytest.approx(5.0 / 3.25)
    # medians of per-question ratios (two questions: their mean)
    assert m["median_speedup"] == pytest.approx((2.0 / 1.0 + 4.0 / 1.25) / 2)
    assert m["median_over_plain_onednn"] == pytest.approx((1.5 / 1.0 + 2.5 / 1.25) / 2)
    assert s["coding"]["flashmm:prompt_lookup"]["over_plain_onednn"] == pytest.approx(1.5)
    assert s["overall"]["plain_onednn"]["speedup"] == pytest.approx(6.0 / 4.0)  # the routing alone
    assert s["overall"]["plain_onednn"]["over_plain_onednn"] == pytest.approx(1.0)


def test_report_shows_both_columns_and_says_when_one_is_missing(tmp_path):
    module = text_speed()
    args = argparse.Namespace(model="smollm2", temperature=None, max_new_tokens=10, max_draft_tokens=16,
                              out=str(tmp_path / "run"))
    md = module.report(args, ["--x"], speed_records(), NAMES, True, 2)
    header = next(line for line in md.splitlines() if line.startswith("| category"))
    assert "| flashmm:prompt_lookup ×plain | flashmm:prompt_lookup ×plain_onednn |" in header
    assert "| flashmm:prompt_lookup CPU ×plain | flashmm:prompt_lookup CPU ×plain_onednn |" in header
    assert "speculation alone" in md and "missing" not in md
    overall = next(line for line in md.splitlines() if line.startswith("| overall"))
    assert f"| {6.0 / 2.25:.3f} | {4.0 / 2.25:.3f} |" in overall
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["records"][0]["plain_onednn"]["seconds"] == 1.5  # the raw numbers travel with the table

    records = [{k: v for k, v in r.items() if k != "plain_onednn"} for r in speed_records()]
    names = [n for n in NAMES if n != "plain_onednn"]
    md = module.report(args, ["--x"], records, names, True, 2, missing="turned off with --no-plain-onednn")
    assert "×plain_onednn is missing from this table" in md and "--no-plain-onednn" in md
    overall = next(line for line in md.splitlines() if line.startswith("| overall"))
    assert f"| {6.0 / 2.25:.3f} | - |" in overall


def test_plain_onednn_is_timed_unless_turned_off():
    parse = text_speed().arguments().parse_args
    assert parse([]).plain_onednn is True
    assert parse(["--plain-onednn"]).plain_onednn is True   # the flag older commands pass still parses
    assert parse(["--no-plain-onednn"]).plain_onednn is False
