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
    tables read plain oneDNN at 1.00x): the baseline enters oneDNN routing, plain does not."""
    import torch  # noqa: PLC0415

    from flashmm import onednn  # noqa: PLC0415

    sys.path.insert(0, str(ROOT / "tests"))
    from text_models import prompt, tiny_lm  # noqa: PLC0415

    model = tiny_lm("llama", seed=0)
    if onednn.resolve_linear_backend("auto", model) != "onednn":
        pytest.skip("no oneDNN on this machine: there is no plain_onednn baseline")
    entered, enter = [], onednn.OneDNNLinears.__enter__
    monkeypatch.setattr(onednn.OneDNNLinears, "__enter__", lambda self: (entered.append(1), enter(self))[1])
    sampling = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, generator=torch.Generator().manual_seed(0))
    methods, _ = text_speed().make_methods(model, None, [], False, True, sampling)
    methods["plain"](prompt(5), 3)
    assert not entered
    out = methods["plain_onednn"](prompt(5), 3)
    assert entered and out.shape == (1, 8)


def test_the_draft_budget_reaches_every_wrapped_drafter():
    """--max-draft-tokens sets the engine's budget of every flashmm method (a drafter's own cap,
    such as EAGLE-3's max_nodes, is then min'd with it); the output stays plain greedy's."""
    sys.path.insert(0, str(ROOT / "tests"))
    from text_models import prompt, tiny_lm  # noqa: PLC0415

    model = tiny_lm("llama", seed=0)
    methods, wrapped = text_speed().make_methods(model, None, ["prompt_lookup"], False, False,
                                                 dict(do_sample=False), None, 40)
    assert wrapped["flashmm:prompt_lookup"].spec.max_draft_tokens == 40
    ids = prompt(12)
    assert methods["flashmm:prompt_lookup"](ids, 10).tolist() == methods["plain"](ids, 10).tolist()
