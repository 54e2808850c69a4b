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
from flashmm.config import SamplingParams
from flashmm.drafters import load
from flashmm.drafters.base import SequenceStart, StepResult
from flashmm.paths import work_dir
from flashmm.tree.cost import VerifyCost

GREEDY = SamplingParams()


@torch.no_grad()
def greedy_replay(drafter, prompt: list[int], answer: list[int], max_tokens: int = 64) -> dict:
    """Replay greedy speculative decoding of ``answer`` (the target's greedy text after ``prompt``)
    with a chain drafter. Returns counts: tokens, steps, drafted, accepted, draft_forwards, nodes
    (list: nodes verified per step, root included)."""
    forwards = [0]
    handle = drafter.model.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    try:
        drafter.begin(SequenceStart(input_ids=torch.tensor([prompt])))
        committed = list(prompt) + answer[:1]  # the prefill emits the first token
        done = 1
        counts = {"tokens": len(answer), "steps": 0, "drafted": 0, "accepted": 0, "nodes": []}
        while done < len(answer):
            draft = drafter.propose(torch.tensor([committed]), max_tokens, GREEDY, None)
            if draft.tree.max_depth != draft.num_draft_tokens:
                raise ValueError("greedy_replay replays chains only (tree_width=1)")
            chain = draft.tokens[0, 1:].tolist()
            accepted = 0
            while accepted < len(chain) and done + accepted < len(answer) and chain[accepted] == answer[done + accepted]:
                accepted += 1
            emitted = answer[done : done + accepted + 1]
            done += len(emitted)
            committed += emitted
            counts["steps"] += 1
            counts["drafted"] += len(chain)
            counts["accepted"] += accepted
            counts["nodes"].append(len(chain) + 1)
            if done < len(answer):
                drafter.observe(StepResult(committed=torch.tensor([committed]), accepted_len=accepted,
                                           path=torch.arange(accepted + 1)[None]))
        counts["draft_forwards"] = forwards[0]
        return counts
    finally:
        handle.remove()


@torch.no_grad()
def cpu_seconds(model, nodes: int, prefix_len: int = 128, repeats: int = 5, linear: str = "torch") -> float:
    """Median thread CPU seconds of ``model``'s cached forward of ``nodes`` new tokens after a
    ``prefix_len``-token prefix, at 1 torch thread: CPU time, not wall time, so that other processes
    on a loaded machine do not inflate it (they still share caches and memory bandwidth). ``linear``:
    "onednn" multiplies through oneDNN, as flashmm runs the target and its draft LM on such a CPU."""
    import time  # noqa: PLC0415
    from contextlib import nullcontext  # noqa: PLC0415

    from flashmm.targets import cache as kv  # noqa: PLC0415
    from flashmm.targets.onednn import OneDNNLinears  # noqa: PLC0415

    cache = kv.new_cache(model)
    kv.next_logits(model, cache, torch.randint(3, 1000, (1, prefix_len)))
    feed = torch.randint(3, 1000, (1, nodes))
    times = []
    for attempt in range(repeats + 1):  # the first run warms up
        kv.crop(cache, prefix_len)
        start = time.thread_time()
        with OneDNNLinears(model) if linear == "onednn" else nullcontext():
            kv.next_logits(model, cache, feed)
        if attempt:
            times.append(time.thread_time() - start)
    return sorted(times)[len(times) // 2]


def cpu_cost_model(target, draft_lm, grid=(1, 2, 3, 4, 6, 9, 13, 17)) -> tuple[VerifyCost, float]:
    """(the target's verify cost over ``grid`` nodes, a draft forward in target one-token steps), from
    thread CPU time at 1 thread (see cpu_seconds), both multiplying as flashmm's ``linear="auto"`` has them."""
    from flashmm.targets.onednn import resolve_linear_backend  # noqa: PLC0415

    torch.set_num_threads(1)
    linear = resolve_linear_backend("auto", target)
    cost = VerifyCost(tuple(grid), tuple(cpu_seconds(target, n, linear=linear) for n in grid))
    return cost, cpu_seconds(draft_lm, 1, linear=linear) / cost.seconds[0]


def summarize(counts: list[dict], verify_cost, draft_cost: float) -> dict:
    """τ, drafted / draft forwards per token, acceptance of drafted tokens, modeled speedup."""
    tokens = sum(c["tokens"] - 1 for c in counts)  # tokens emitted by verification steps
    steps = sum(c["steps"] for c in counts)
    drafted = sum(c["drafted"] for c in counts)
    forwards = sum(c["draft_forwards"] for c in counts)
    verify_units = sum(verify_cost.relative(n) for c in counts for n in c["nodes"])
    return {"tau": tokens / steps, "drafted_per_token": drafted / tokens, "draft_forwards_per_token": forwards / tokens,
            "accepted_per_drafted": sum(c["accepted"] for c in counts) / max(drafted, 1),
            "modeled_speedup": tokens / (verify_units + draft_cost * forwards), "steps": steps, "tokens": tokens}


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
