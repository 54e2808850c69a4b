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
