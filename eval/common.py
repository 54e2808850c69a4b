"""Helpers shared by the benchmark scripts: machine description, timing, tables."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = dict(cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version())
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def timed(fn):
    """(result, wall seconds) of fn(), synchronising CUDA around it."""
    out, wall, _ = timed_with_cpu(fn)
    return out, wall


def timed_with_cpu(fn):
    """(result, wall seconds, CPU seconds of this process) of fn(), synchronising CUDA around it.

    On a shared CPU machine the process's CPU time is far less disturbed by other load than
    wall time (with one torch thread it equals wall time on an idle machine); report both.
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0, time.process_time() - c0


def on_onednn(model, fn):
    """``fn`` run with every linear layer of ``model`` on oneDNN (flashmm.onednn.OneDNNLinears):
    the plain_onednn baseline of the benchmarks."""
    from flashmm.onednn import OneDNNLinears  # noqa: PLC0415

    def run(*args):
        with OneDNNLinears(model):
            return fn(*args)

    return run


def parse_options(options: str) -> dict:
    """``key=value,...`` → {key: value}, each value a Python literal where it parses, else the string
    (the options of a ``--drafters NAME_OR_DIR:key=value,...`` argument)."""
    import ast  # noqa: PLC0415

    kwargs = {}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return kwargs


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(x):
        return f"{x:.3f}" if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def summarize_batches(records: list[dict], names: list[str], batch_sizes) -> dict:
    """Per batch size and method: total tokens/s, speedup over "plain", share of rows identical to
    plain's, and τ (tokens per row per verification forward) where the records carry verify steps."""
    summary = {}
    for size in batch_sizes:
        rs = [r for r in records if r["batch_size"] == size]
        tokens = sum(r["tokens"] for r in rs)
        plain_tps = tokens / sum(r["plain"]["seconds"] for r in rs)
        summary[size] = {}
        for name in names:
            tps = tokens / sum(r[name]["seconds"] for r in rs)
            m = {"tok_per_s": tps, "speedup": tps / plain_tps,
                 "exact_rate": sum(r[name]["exact_rows"] for r in rs) / sum(r[name]["rows"] for r in rs)}
            if "verify_steps" in rs[0][name]:
                steps = sum(r[name]["verify_steps"] for r in rs)
                m["tau"] = (sum(r[name]["accepted"] for r in rs) + steps) / steps if steps else 0.0
            summary[size][name] = m
    return summary


def write_results(out_prefix: str, payload: dict, markdown: str) -> None:
    path = Path(out_prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str))
    path.with_suffix(".md").write_text(markdown)
    print(f"wrote {path.with_suffix('.json')} and {path.with_suffix('.md')}")
