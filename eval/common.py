"""Helpers shared by the benchmark scripts: machine description, timing, tables."""
from __future__ import annotations

import gc
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


def freeze_heap() -> None:
    """Move every object alive now (models, processors, datastores: ~440k objects in the reference LMM's
    benchmark) out of the garbage collector's generations, after loading and warm-up and before the clock runs:
    a full collection otherwise scans them all, ~0.2 s on the 2-core EPYC, landing inside whichever method's item
    it falls in (a suffix image item read 0.95 s where it decodes in 0.67 alone)."""
    gc.collect()
    gc.freeze()


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


def on_onednn(model, fn, greedy: bool = False):
    """``fn`` run on the step flashmm's own forwards of ``model`` run on a CPU: the model's fused step
    for the Llama families (flashmm.targets.fused.FusedForward), else every linear layer on oneDNN
    (flashmm.targets.onednn.OneDNNLinears). The plain_onednn baseline of the benchmarks: speculation alone.
    ``greedy``: ``fn`` decodes greedily without logits processors, so the fused step screens its LM head as
    flashmm's greedy verification does (FusedForward's argmax_only)."""
    from flashmm.targets import fused  # noqa: PLC0415
    from flashmm.targets.layout import attention_layout  # noqa: PLC0415
    from flashmm.targets.onednn import OneDNNLinears  # noqa: PLC0415

    fusable = fused.supports(model, attention_layout(model.config.get_text_config())) is None

    def run(*args):
        with fused.FusedForward(model, argmax_only=greedy) if fusable else OneDNNLinears(model):
            return fn(*args)

    return run


# ------------------------------------------------------------------ the two baselines of a CPU speed table
#: plain ``generate`` as the model comes (its own layers), and the same ``generate`` on the step flashmm's
#: own forwards run on CPU (fused for the Llama families, else oneDNN linears): flashmm over the first
#: mixes that faster step with speculation, flashmm over the second is speculation alone
BASELINES = ("plain", "plain_onednn")


def onednn_baseline_missing(model, wanted: bool = True) -> str | None:
    """None where the plain_onednn baseline runs for ``model``, else why it does not (for the legend)."""
    from flashmm.targets.onednn import resolve_linear_backend  # noqa: PLC0415

    if not wanted:
        return "turned off with --no-plain-onednn"
    if resolve_linear_backend("auto", model) != "onednn":
        return ("flashmm keeps this model's own linear layers here (oneDNN routing needs an fp32 model on an x86-64 "
                "CPU and a torch with oneDNN), so ×plain is already speculation alone")
    return None


def baseline_legend(missing: str | None = None) -> str:
    """The one-line legend of the ×plain and ×plain_onednn columns; ``missing``: why plain_onednn was
    not measured (the ×plain_onednn column is then empty, and the legend says so)."""
    legend = ("×plain = tokens/s of the method / tokens/s of plain `model.generate` with the model's own linear "
              "layers (flashmm's faster step and speculation together); ×plain_onednn = the same over plain "
              "`generate` on the step flashmm's forwards run (the fused step for the Llama families, "
              "flashmm.targets.fused; else every linear layer on oneDNN, flashmm.targets.onednn): speculation "
              "alone; both baselines timed in the same interleaved run.")
    if missing:
        legend += f" **×plain_onednn is missing from this table**: plain_onednn was not measured ({missing})."
    return legend


def over(rate: float, baseline_rate: float | None) -> float | None:
    """rate / baseline_rate; None where the baseline was not measured (shown "-" in tables)."""
    if baseline_rate is None:
        return None
    return rate / baseline_rate if baseline_rate > 0 else float("nan")


def speedup_lines(group: dict, names: list[str], label: str = "",
                  keys: tuple[str, str] = ("speedup", "over_plain_onednn")) -> str:
    """Console lines "LABELname: A× plain generate, B× plain_onednn" of one summary group {name: {keys[0]:
    ×plain, keys[1]: ×plain_onednn or None}}, one per name but plain."""
    def fmt(x):
        return "-" if x is None else f"{x:.2f}×"
    return "\n".join(f"{label}{name}: {fmt(group[name][keys[0]])} plain generate, "
                     f"{fmt(group[name].get(keys[1]))} plain_onednn" for name in names if name != "plain")


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
        return f"{x:.3f}" if isinstance(x, float) else "-" if x is None else str(x)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def summarize_batches(records: list[dict], names: list[str], batch_sizes) -> dict:
    """Per batch size and method: total tokens/s, speedup over "plain" and over_plain_onednn (over
    "plain_onednn", None where it did not run), share of rows identical to plain's, and τ (tokens
    per row per verification forward) where the records carry verify steps. Every method of a batch is
    credited with the same ``tokens``."""
    summary = {}
    for size in batch_sizes:
        rs = [r for r in records if r["batch_size"] == size]
        tokens = sum(r["tokens"] for r in rs)
        plain_tps = tokens / sum(r["plain"]["seconds"] for r in rs)
        onednn_tps = tokens / sum(r["plain_onednn"]["seconds"] for r in rs) if "plain_onednn" in names else None
        summary[size] = {}
        for name in names:
            tps = tokens / sum(r[name]["seconds"] for r in rs)
            m = {"tok_per_s": tps, "speedup": tps / plain_tps, "over_plain_onednn": over(tps, onednn_tps),
                 "exact_rate": sum(r[name]["exact_rows"] for r in rs) / sum(r[name]["rows"] for r in rs)}
            if "verify_steps" in rs[0][name]:
                steps = sum(r[name]["verify_steps"] for r in rs)
                m["tau"] = (sum(r[name]["accepted"] for r in rs) + steps) / steps if steps else 0.0
            summary[size][name] = m
    return summary


def step_counters(stats) -> dict:
    """A wrapped call's GenerationStats as a benchmark record's fields: tokens, steps, drafted and accepted
    tokens, drafting and verification seconds, and the accepted-length histogram."""
    return dict(new_tokens=stats.new_tokens, verify_steps=stats.verify_steps, accepted=stats.accepted_tokens,
                drafted=stats.drafted_tokens, draft_seconds=stats.draft_seconds, verify_seconds=stats.verify_seconds,
                accepted_hist={int(k): v for k, v in stats.accepted_hist.items()})


def write_results(out_prefix: str, payload: dict, markdown: str) -> None:
    path = Path(out_prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str))
    path.with_suffix(".md").write_text(markdown)
    print(f"wrote {path.with_suffix('.json')} and {path.with_suffix('.md')}")
