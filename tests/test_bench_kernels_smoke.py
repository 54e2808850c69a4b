"""eval/bench_kernels.py --smoke on CPU (TRITON_INTERPRET=1): every kernel checked against its
reference at tiny shapes, the tables and JSON written. Timings are not asserted."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))

import bench_kernels  # noqa: E402


def test_smoke_run_writes_checked_tables(tmp_path):
    out = tmp_path / "bench"
    bench_kernels.main(["--smoke", "--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    assert {(r["prefix"], r["n"]) for r in result["attention"]} == {(0, 5), (0, 33), (40, 5), (40, 33)}
    assert all(r["max_err_vs_ref"] < 1e-4 and r["max_err_vs_dense"] < 1e-4 for r in result["attention"])
    assert result["summary"]["all_identical"] and result["verify"] and result["kv_keep"]
    assert "| P | N | tree ms |" in out.with_suffix(".md").read_text()
