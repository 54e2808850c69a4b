"""Judge decoding (LOSSY) against exact verification with the same drafter and plain ``generate``:
speed and what it costs in quality, side by side, on the dev Spec-Bench questions.

    python eval/judge_decoding.py --judge assets/judges/smollm2 --drafters prompt_lookup \
        assets/text_drafters/smollm2/fastdraft --per-category 3 --max-new-tokens 128 \
        --out eval/results/judge_decoding_smollm2

For every question (chat template, greedy) plain generate, plain_onednn (the same with every
linear layer on oneDNN, as flashmm routes its own forwards on CPU), each drafter with exact
verification and each drafter with ``verifier="judge_lossy"`` run back to back in a rotating order.
Per category: τ, ×plain and ×plain_onednn (total tokens / total time over each baseline's: oneDNN
routing and speculation together / speculation alone), exact rate (output identical to plain greedy), and
answer agreement: on the questions whose plain answer contains a number, the share whose last number
is the same (the final answer of a math item). Exact verification is 100% exact by construction; the
judge's losses are what it gives up.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (BASELINES, baseline_legend, machine, markdown_table, on_onednn,  # noqa: E402
                    onednn_baseline_missing, over, speedup_lines, timed_with_cpu, write_results)
from text_speed import DEFAULT_QUESTIONS, load_questions, parse_drafter, prompt_ids  # noqa: E402

import flashmm  # noqa: E402
from flashmm.verify import load_judge  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number written in ``text`` (thousands separators dropped), or None."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--judge", required=True, help="a judge directory (python -m flashmm.train judge)")
    ap.add_argument("--drafters", nargs="+", default=["prompt_lookup"])
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--categories", nargs="+", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threshold", type=float, default=None, help="override the judge's threshold")
    ap.add_argument("--out", default="eval/results/judge_decoding")
    args = ap.parse_args(argv)

    model, tokenizer = load_gguf_lm("smollm2")
    judge = load_judge(str(Path(args.judge).resolve()))
    if args.threshold is not None:
        judge.threshold = args.threshold
    methods, wrapped = {"plain": lambda ids, n: model.generate(ids, max_new_tokens=n, do_sample=False)}, {}
    missing = onednn_baseline_missing(model)
    if missing is None:
        methods["plain_onednn"] = on_onednn(model, methods["plain"])
    for spec in args.drafters:
        for verifier in ("exact", "judge"):
            label, drafter = parse_drafter(spec, tokenizer)
            config = {"verifier": "judge_lossy", "judge": judge} if verifier == "judge" else {}
            sm = flashmm.wrap(model, drafter, **config)
            name = f"{label} {verifier}"
            methods[name] = (lambda sm: lambda ids, n: sm.generate(ids, max_new_tokens=n, do_sample=False))(sm)
            wrapped[name] = sm
    names = list(methods)
    warm = tokenizer("Hello", return_tensors="pt").input_ids
    for fn in methods.values():
        fn(warm, 4)

    records = []
    questions = load_questions(args.questions, args.per_category, args.categories)
    for qi, q in enumerate(tqdm(questions, desc="questions")):
        ids = prompt_ids(tokenizer, q["turns"][0])
        order = names[qi % len(names):] + names[: qi % len(names)]
        rec, outs = {"id": q["question_id"], "category": q["category"]}, {}
        for name in order:
            out, seconds, cpu = timed_with_cpu(lambda: methods[name](ids, args.max_new_tokens))
            outs[name] = out
            rec[name] = {"seconds": seconds, "new_tokens": out.shape[1] - ids.shape[1],
                         "text": tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}
            if name in wrapped:
                st = wrapped[name].last_stats
                rec[name].update(verify_steps=st.verify_steps, accepted=st.accepted_tokens)
        plain_answer = final_number(rec["plain"]["text"])
        for name in names:
            rec[name]["exact"] = bool(torch.equal(outs[name], outs["plain"]))
            rec[name]["answer_agrees"] = (None if plain_answer is None
                                          else final_number(rec[name]["text"]) == plain_answer)
        records.append(rec)
        report(args, argv, records, names, len(questions), missing)
    print(speedup_lines(summarize(records, names)["overall"], names, "overall "))


def summarize(records: list[dict], names: list[str]) -> dict:
    """Per category (and "overall"): n, and per method but plain: speedup and over_plain_onednn (tokens/s over
    plain's and over plain_onednn's, total tokens / total seconds; None where plain_onednn did not
    run), exact_rate, answer_agrees ("k/n"), and τ for flashmm methods."""
    by_cat = defaultdict(list)
    for r in records:
        by_cat[r["category"]].append(r)
    by_cat["overall"] = records
    summary = {}
    for cat, rs in by_cat.items():
        def rate(name):
            return sum(r[name]["new_tokens"] for r in rs) / sum(r[name]["seconds"] for r in rs)

        plain_tps = rate("plain")
        onednn_tps = rate("plain_onednn") if "plain_onednn" in names else None
        summary[cat] = {"n": len(rs)}
        for name in names[1:]:
            judged = [r[name]["answer_agrees"] for r in rs if r[name]["answer_agrees"] is not None]
            m = {"speedup": rate(name) / plain_tps, "over_plain_onednn": over(rate(name), onednn_tps),
                 "exact_rate": sum(r[name]["exact"] for r in rs) / len(rs),
                 "answer_agrees": f"{sum(judged)}/{len(judged)}" if judged else "-"}
            if name not in BASELINES:
                steps = sum(r[name]["verify_steps"] for r in rs)
                m["tau"] = (sum(r[name]["accepted"] for r in rs) + steps) / steps if steps else 0.0
            summary[cat][name] = m
    return summary


def report(args, argv, records, names, planned, missing=None):
    """Write the table and records so far; missing: why plain_onednn was not timed (None: it was)."""
    summary = summarize(records, names)
    header = ["category", "n"] + [h for name in names[1:] for h in (f"{name} ×plain", f"{name} ×plain_onednn",
                                                                    f"{name} τ", f"{name} exact",
                                                                    f"{name} answer agrees")]
    rows = []
    for cat, s in summary.items():
        row = [cat, s["n"]]
        for name in names[1:]:
            m = s[name]
            row += [m["speedup"], m["over_plain_onednn"], m.get("tau", "-"), f"{m['exact_rate']:.0%}",
                    m["answer_agrees"]]
        rows.append(row)
    done = "" if len(records) == planned else f" ({len(records)} of {planned} questions so far)"
    md = (f"# Judge decoding (LOSSY) vs exact verification: SmolLM2-135M-Instruct, greedy, {args.max_new_tokens} "
          f"new tokens{done}\n\nMachine: {machine()}\n\nCommand: `python eval/judge_decoding.py "
          f"{' '.join(argv or sys.argv[1:])}`\n\n" + baseline_legend(missing) + "\n\n"
          "×plain, ×plain_onednn = total tokens / total seconds over the baseline's, in the same run "
          "(interleaved); τ = tokens per verification forward; exact = output identical to plain greedy; answer "
          "agrees = on questions whose plain answer has a number, its last number is the same.\n\n"
          + markdown_table(header, rows) + "\n")
    write_results(args.out, {"machine": machine(), "args": vars(args), "summary": summary, "records": records}, md)
    print(md)


if __name__ == "__main__":
    main()
