"""The GPU benchmark scripts run end to end on tiny models (here on the CPU): eval/gpu_speed.py and
eval/gpu_step_cost.py write their tables, every flashmm row exact against plain generate."""
from __future__ import annotations

import json
import sys
from pathlib import Path

EVAL = Path(__file__).resolve().parents[1] / "eval"
sys.path.insert(0, str(EVAL))


def test_gpu_speed_tiny_writes_exact_rows(tmp_path):
    import gpu_speed

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) for i, (c, t) in
                                   enumerate([("qa", "Name three colors. Name three colors."), ("writing", "Write a line.")])))
    out = tmp_path / "speed"
    gpu_speed.main(["--tiny", "--parts", "text1", "--questions", str(questions), "--per-category", "1",
                    "--max-new-tokens", "12", "--warm", "1", "--text-drafters", "--out", str(out)])
    summary = json.loads(out.with_suffix(".json").read_text())["parts"]["text1"]["summary"]["all"]
    assert {"plain", "plain_static", "pl", "pl_graphs", "suffix_graphs"} <= set(summary)
    assert all(m["exact_rate"] == 1.0 for key, m in summary.items() if key != "n")


def test_gpu_step_cost_tiny_times_both_paths(tmp_path):
    import gpu_step_cost

    out = tmp_path / "cost"
    gpu_step_cost.main(["--tiny", "--dtypes", "fp32", "--prefix", "16", "--nodes", "1", "3", "--repeats", "2",
                        "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["nodes"] for r in rows] == [1, 3] and all(r["eager_ms"] > 0 and r["graphs_ms"] > 0 for r in rows)
