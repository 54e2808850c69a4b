"""Draft-length policies compared exactly offline: fixed k, DraftModel's adaptive length, SpecDec++.

Greedy replay: the target's greedy answer to each prompt is known (dev Spec-Bench answers cached by
eval/draft_acceptance.py, or held-out corpus answers, which are the target's greedy text), so a
greedy speculative run is simulated without the target: the real drafter proposes a chain after
the committed text, the accepted tokens are the chain's longest prefix agreeing with the answer,
the target's own token follows, and the drafter observes that outcome — exactly what the engine's
greedy verification would do. Counted per emitted token: verification steps (τ = tokens / steps),
drafted tokens, draft forwards. The cost model prices a step of n nodes at t(n) / t(1) target
one-token forwards (measured on this machine, flashmm.targets.verify_cost.measure_verify_cost) and a
draft forward at its measured share of a target step, giving a modeled speedup over plain decoding
that timing noise on a loaded machine cannot touch.

    python -m eval.specdecpp_policy --specdecpp assets/text_drafters/smollm2/specdecpp \\
        --out eval/results/specdecpp_policy_smollm2
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from eval.common import machine, markdown_table, write_results
from flashmm.drafters import load
from flashmm.paths import work_dir
from flashmm.train.specdecpp_replay import cpu_cost_model, greedy_replay, summarize


def policies(draft_dir: str, specdecpp_dir: str | None, thresholds: list[float], caps: list[int], fixed: list[int]):
    """(label, drafter) for every policy compared; all share the same draft weights."""
    out = [(f"fixed k={k}", load(draft_dir, max_draft_tokens=k, adaptive=False)) for k in fixed]
    out += [(f"adaptive (DraftModel default) cap={c}", load(draft_dir, max_draft_tokens=c)) for c in caps]
    if specdecpp_dir:
        out += [(f"SpecDec++ h={h} cap={c}", load(specdecpp_dir, threshold=h, max_draft_tokens=c))
                for c in caps for h in thresholds]
    return out


def dev_items(answers_cache: Path, questions: Path) -> list[dict]:
    done = json.loads(answers_cache.read_text())
    rows = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()]
    category = {str(r["question_id"]): r["category"] for r in rows}
    return [{"prompt": v["prompt"], "answer": v["answer"], "category": category.get(k, "?")} for k, v in done.items()]


def corpus_items(corpus: str, first: int, count: int) -> list[dict]:
    from flashmm.train.corpus import read_corpus  # noqa: PLC0415

    records = read_corpus(corpus)[first : first + count]
    return [{"prompt": r.prompt_ids, "answer": r.greedy.ids, "category": "corpus (held out)"} for r in records]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="assets/text_drafters/smollm2/fastdraft")
    ap.add_argument("--specdecpp", default=None, help="a SpecDec++ folder trained for --draft")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--caps", type=int, nargs="+", default=[8])
    ap.add_argument("--fixed", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--data", choices=["dev", "corpus"], default="dev")
    ap.add_argument("--answers-cache", type=Path, default=work_dir("smollm2_dev_answers.json"),
                    help="the target's greedy dev answers (written by eval/draft_acceptance.py)")
    ap.add_argument("--questions", type=Path,
                    default=Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question_dev.jsonl")
    ap.add_argument("--corpus", default="assets/corpus/smollm2")
    ap.add_argument("--corpus-first", type=int, default=3000, help="held-out corpus records start here")
    ap.add_argument("--corpus-count", type=int, default=60)
    ap.add_argument("--out", default="eval/results/specdecpp_policy_smollm2")
    args = ap.parse_args(argv)
    from flashmm.weights import load_gguf_lm  # noqa: PLC0415

    torch.set_num_threads(1)
    target, _ = load_gguf_lm("smollm2", dtype=torch.float32)
    verify_cost, draft_cost = cpu_cost_model(target, load(args.draft).model)
    items = dev_items(args.answers_cache, args.questions) if args.data == "dev" else \
        corpus_items(args.corpus, args.corpus_first, args.corpus_count)
    results = {}
    for label, drafter in policies(args.draft, args.specdecpp, args.thresholds, args.caps, args.fixed):
        drafter._measure_costs(target)  # what bind does: the adaptive length's costs as it would get them
        per_category = defaultdict(list)
        for item in items:
            per_category[item["category"]].append(greedy_replay(drafter, item["prompt"], item["answer"]))
        every = [c for cs in per_category.values() for c in cs]
        results[label] = {"all": summarize(every, verify_cost, draft_cost), "length_costs": drafter.cost_source} | {
            cat: summarize(cs, verify_cost, draft_cost) for cat, cs in sorted(per_category.items())}
        print(label, json.dumps(results[label]["all"]), flush=True)
    header = ["policy", "τ", "drafted / token", "draft forwards / token", "accepted / drafted", "modeled speedup"]
    rows = [[label, r["all"]["tau"], r["all"]["drafted_per_token"], r["all"]["draft_forwards_per_token"],
             r["all"]["accepted_per_drafted"], r["all"]["modeled_speedup"]] for label, r in results.items()]
    cost_line = f"t(1)={verify_cost.seconds[0] * 1e3:.1f} ms, " + ", ".join(f"t({n})/t(1)={verify_cost.relative(n):.2f}" for n in (2, 4, 9, 13))
    markdown = (f"# Draft-length policies, exact greedy replay on SmolLM2-135M-Instruct ({args.data}: {len(items)} "
                f"answers, {sum(len(i['answer']) for i in items)} tokens)\n\n"
                f"Same draft ({args.draft}) in every row. Cost model (thread CPU time at 1 thread, loaded machine): "
                f"{cost_line}; one draft forward = {draft_cost:.3f} target steps.\n\n"
                f"Command: `python -m eval.specdecpp_policy --specdecpp {args.specdecpp} --data {args.data}`\n\n"
                + markdown_table(header, rows) + "\n")
    write_results(args.out, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                             "verify_cost": {"nodes": verify_cost.nodes, "seconds": verify_cost.seconds},
                             "draft_cost": draft_cost, "results": results}, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
