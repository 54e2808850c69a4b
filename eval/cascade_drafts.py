"""Cascade drafting on SmolLM2 with the shipped FastDraft: τ, exactness and the draft LM's forwards.

    python eval/cascade_drafts.py --max-new-tokens 128 --out eval/results/cascade_smollm2

Methods (greedy, one question at a time, in a rotating order against two baselines: plain
``model.generate``, and plain_onednn, the same with every linear layer on oneDNN as flashmm routes
its own forwards on CPU):
FastDraft alone and inside a VerticalCascade (prompt lookup guesses verified by the draft LM), both
with their adaptive length (the cascade also with ``reprice=True``) and at a fixed depth
(``--depth``: every step drafts that many tokens, so the draft forwards per step compare like for
like: the vertical chain is FastDraft's own chain);
a HorizontalCascade (FastDraft for the first positions, prompt lookup for the rest); prompt lookup
alone. Draft-LM forwards are counted with a forward hook on the draft LM (independent of what the
drafters count). Timings on a shared machine are noise: they are reported "under load", as CPU-time
×plain and ×plain_onednn (oneDNN routing and speculation together / speculation alone).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import (BASELINES, baseline_legend, machine, markdown_table, on_onednn,  # noqa: E402
                    onednn_baseline_missing, over, speedup_lines, timed_with_cpu, write_results)
from text_speed import DEFAULT_QUESTIONS, load_questions  # noqa: E402

import flashmm  # noqa: E402
from flashmm.drafters import HorizontalCascade, PromptLookup, VerticalCascade, load  # noqa: E402
from tools.corpus.build import load_target  # noqa: E402

DRAFT = "assets/text_drafters/smollm2/fastdraft"
CATEGORIES = ["writing", "coding", "summarization", "rag", "translation", "math_reasoning"]


def methods(depth: int) -> dict:
    """name -> (drafter, the draft LM whose forwards to count or None)."""
    def fastdraft(**options):
        return load(DRAFT, **options)

    fixed = dict(adaptive=False, max_draft_tokens=depth)
    built = {
        "fastdraft": fastdraft(),
        "vertical": VerticalCascade(fastdraft()),
        "vertical_repriced": VerticalCascade(fastdraft(), reprice=True),
        f"fastdraft_d{depth}": fastdraft(**fixed),
        f"vertical_d{depth}": VerticalCascade(fastdraft(**fixed)),
        "horizontal": HorizontalCascade(fastdraft(), PromptLookup()),
        "prompt_lookup": PromptLookup(),
    }
    out = {}
    for name, drafter in built.items():
        lm = getattr(drafter, "draft", None) or getattr(drafter, "first", None) or drafter
        out[name] = (drafter, getattr(lm, "model", None))
    return out


class Counter:
    def __init__(self, module):
        self.calls = 0
        if module is not None:
            module.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--categories", nargs="+", default=CATEGORIES, help="first question of each")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4, help="fixed draft depth of the *_d<depth> methods")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="eval/results/cascade_smollm2")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tokenizer = load_target("smollm2")
    questions = load_questions(args.questions, 1, args.categories)
    wrapped, counters = {}, {}
    for name, (drafter, lm) in methods(args.depth).items():
        wrapped[name] = flashmm.wrap(model, drafter)   # binds: measures verify / draft costs (cached)
        counters[name] = Counter(lm)
    missing = onednn_baseline_missing(model)
    names = ["plain", *(["plain_onednn"] if missing is None else []), *wrapped]
    warm = tokenizer("Hello", return_tensors="pt").input_ids
    for sm in wrapped.values():
        sm.generate(warm, max_new_tokens=4)

    records = []
    for qi, q in enumerate(questions):
        text = tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt").input_ids
        rec, outs = {"id": q["question_id"], "category": q["category"]}, {}
        for name in names[qi % len(names):] + names[: qi % len(names)]:
            if name in BASELINES:
                fn = lambda: model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)  # noqa: E731
                fn = on_onednn(model, fn) if name == "plain_onednn" else fn
            else:
                fn = (lambda sm: lambda: sm.generate(ids, max_new_tokens=args.max_new_tokens))(wrapped[name])
                counters[name].calls = 0
            counted = getattr(getattr(wrapped.get(name), "drafter", None), "counts", None)  # vertical cascades
            before = None if counted is None else dict(vars(counted))
            outs[name], seconds, cpu = timed_with_cpu(fn)
            rec[name] = {"seconds": seconds, "cpu_seconds": cpu, "new_tokens": outs[name].shape[1] - ids.shape[1]}
            if name in wrapped:
                st = wrapped[name].last_stats
                rec[name].update(verify_steps=st.verify_steps, drafted=st.drafted_tokens,
                                 accepted=st.accepted_tokens, draft_forwards=counters[name].calls)
            if before is not None:  # the lookup's guesses scored by the draft LM, and kept
                now = vars(counted)
                rec[name].update(guessed=now["guessed"] - before["guessed"], kept=now["kept"] - before["kept"])
        for name in names:
            rec[name]["exact"] = bool(torch.equal(outs[name], outs["plain"]))
        records.append(rec)
        print(f"{qi + 1}/{len(questions)} {q['category']}", flush=True)
        report(args, argv, records, names, missing)
    print(speedup_lines(summarize(records, names), names, "CPU time, ", CPU_KEYS))


#: the summary's keys of ×plain and ×plain_onednn (CPU time, under load)
CPU_KEYS = ("cpu_speedup_under_load", "cpu_over_plain_onednn_under_load")


def summarize(records: list[dict], names: list[str]) -> dict:
    """Per method: CPU-time tokens/s over plain's and over plain_onednn's (CPU_KEYS; None where
    plain_onednn did not run), each total tokens / total CPU seconds, exact share; for flashmm methods
    also τ, drafted and draft-LM forwards per step, and the raw totals."""
    def cpu_rate(name):
        return sum(r[name]["new_tokens"] for r in records) / sum(r[name]["cpu_seconds"] for r in records)

    plain_tps = cpu_rate("plain")
    onednn_tps = cpu_rate("plain_onednn") if "plain_onednn" in names else None
    summary = {}
    for name in names[1:]:
        tps = cpu_rate(name)
        s = {CPU_KEYS[0]: tps / plain_tps, CPU_KEYS[1]: over(tps, onednn_tps),
             "exact": sum(r[name]["exact"] for r in records) / len(records)}
        if name not in BASELINES:
            tot = {k: sum(r[name][k] for r in records) for k in
                   ("new_tokens", "cpu_seconds", "verify_steps", "drafted", "accepted", "draft_forwards")}
            s.update({"tau": (tot["accepted"] + tot["verify_steps"]) / max(tot["verify_steps"], 1),
                      "drafted_per_step": tot["drafted"] / max(tot["verify_steps"], 1),
                      "draft_forwards_per_step": tot["draft_forwards"] / max(tot["verify_steps"], 1),
                      "draft_forwards_per_drafted": tot["draft_forwards"] / max(tot["drafted"], 1), **tot})
        if "guessed" in records[0][name]:
            s["guessed"] = sum(r[name]["guessed"] for r in records)
            s["kept"] = sum(r[name]["kept"] for r in records)
        summary[name] = s
    return summary


def report(args, argv, records, names, missing=None):
    """Write the table and records so far; missing: why plain_onednn was not timed (None: it was)."""
    summary = summarize(records, names)
    rows = []
    for name, s in summary.items():
        def cell(key, fmt):
            return fmt.format(s[key]) if key in s else "-"
        rows.append([name, cell("tau", "{:.3f}"), cell("drafted_per_step", "{:.2f}"),
                     cell("draft_forwards_per_step", "{:.2f}"), cell("draft_forwards_per_drafted", "{:.2f}"),
                     f"{s['kept']} / {s['guessed']}" if "guessed" in s else "-",
                     f"{s['exact']:.0%}", s[CPU_KEYS[0]], s[CPU_KEYS[1]]])
    md = (f"# Cascade drafting: SmolLM2 + FastDraft, greedy, {args.max_new_tokens} new tokens, "
          f"{len(records)} dev questions ({', '.join(r['category'] for r in records)})\n\n"
          f"Command: `python eval/cascade_drafts.py {' '.join(argv or sys.argv[1:])}`\n\nMachine: {machine()}, "
          "shared with other jobs: the ratios (CPU seconds, total tokens / total CPU seconds against each "
          "baseline, same run) are under load.\n\n" + baseline_legend(missing) + "\n\n"
          + markdown_table(["method", "τ", "drafted / step", "draft-LM forwards / step", "forwards / drafted token",
                            "lookup guesses kept", "exact", "CPU-time ×plain (under load)",
                            "CPU-time ×plain_onednn (under load)"], rows) + "\n")
    write_results(args.out, {"args": vars(args), "summary": summary, "records": records}, md)
    print(md)


if __name__ == "__main__":
    main()
