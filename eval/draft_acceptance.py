"""Acceptance of draft LMs against SmolLM2 on the dev Spec-Bench questions, computed exactly offline.

For greedy chain drafting, the tokens a draft proposes after an accepted prefix are its argmaxes
on the target's own greedy text, so one teacher-forced draft forward over (prompt + the target's
greedy answer) gives, at every answer position i, the run of consecutive agreements starting at i.
A chain of k drafted tokens started at i accepts min(k, run_i) of them; walking the answer step by
step gives the exact greedy τ of spec decoding with that draft and k (no timing, no noise).
Sampling at T: the expected acceptance of one drafted token, Σ_v min(p_T, q_T), averaged over the
same positions (the greedy trajectory stands in for sampled ones).

    python -m eval.draft_acceptance --drafters assets/text_drafters/smollm2/fastdraft ... \\
        --per-category 5 --out eval/results/draft_acceptance_smollm2
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

from eval.common import machine, markdown_table, write_results
from flashmm.drafters import load
from flashmm.paths import work_dir

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question_dev.jsonl"


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def questions(path: Path, per_category: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    taken: dict[str, int] = defaultdict(int)
    out = []
    for row in rows:
        if taken[row["category"]] < per_category:
            taken[row["category"]] += 1
            out.append(row)
    return out


@torch.no_grad()
def target_answers(model, tokenizer, rows: list[dict], max_new_tokens: int, cache: Path) -> list[dict]:
    """The target's greedy answers (cached in ``cache``: they do not depend on the drafters)."""
    done = json.loads(cache.read_text()) if cache.exists() else {}
    cache.parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        key = str(row["question_id"])
        if key not in done:
            ids = chat_ids(tokenizer, row["turns"][0])
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
            done[key] = {"prompt": ids, "answer": out[0, len(ids):].tolist()}
            cache.write_text(json.dumps(done))
    return [{**row, **done[str(row["question_id"])]} for row in rows]


def greedy_tau(agree: list[bool], k: int) -> float:
    """Exact tokens per verification step of greedy chain drafting with k tokens, from agreements."""
    runs = [0] * (len(agree) + 1)
    for i in range(len(agree) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if agree[i] else 0
    return tau_from_runs(runs[:-1], k)


def tau_from_runs(runs: list[int], k: int) -> float:
    """Exact tokens per verification step when a chain drafted after answer position i would have its
    first runs[i] tokens right (an autoregressive draft: its consecutive agreements; PARD: its depths)."""
    i, steps, n = 0, 0, len(runs)
    while i < n:
        i += min(k, runs[i], n - i) + 1  # accepted tokens + the target's own token
        steps += 1
    return n / steps if steps else 0.0


@torch.no_grad()
def pard_runs(drafter, item: dict) -> list[int]:
    """For each answer position i, how many of PARD's depth 0..K-1 predictions from the prefix
    ending there (one teacher-forced packed forward, flashmm.train.pard) match the answer in a row."""
    import random  # noqa: PLC0415

    from flashmm.train.pard import packed_logits  # noqa: PLC0415

    ids = torch.tensor(item["prompt"] + item["answer"])
    start = len(item["prompt"]) - 1
    rows = drafter.model.target_to_draft[ids]
    logits, _, _, (layout,) = packed_logits(drafter.pard, [dict(input_ids=rows, first_trained=start)],
                                            drafter.depth, 1.0, random.Random(0))
    guess = drafter.model.draft_to_target[logits[0].argmax(-1)]
    right = {}  # (anchor, depth) → the guess is the answer's token
    for slot in range(len(layout["source"])):
        label = int(layout["label"][slot])
        if label >= 0:
            right[int(layout["anchor"][slot]), int(layout["level"][slot])] = bool(guess[slot] == ids[label])
    runs = []
    for anchor in range(start, len(ids) - 1):
        run = 0
        while right.get((anchor, run), False):
            run += 1
        runs.append(run)
    return runs


@torch.no_grad()
def measure(draft_lm, model, items: list[dict], temperature: float, ks: tuple[int, ...]) -> dict:
    per_category: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for item in items:
        ids = torch.tensor([item["prompt"] + item["answer"]])
        start = len(item["prompt"]) - 1  # position predicting the first answer token
        q_logits = draft_lm(input_ids=ids, logits_to_keep=0).logits[0, start:-1].float()  # [A, V]
        p_logits = model(input_ids=ids).logits[0, start:-1].float()
        answer = torch.tensor(item["answer"])
        agree = (q_logits.argmax(-1) == answer).tolist()
        p = (p_logits / temperature).softmax(-1)
        q = (q_logits / temperature).softmax(-1)
        stats = per_category[item["category"]]
        stats["alpha_greedy"].append(sum(agree) / len(agree))
        stats["alpha_sampled"].append(float(torch.minimum(p, q).sum(-1).mean()))
        for k in ks:
            stats[f"tau_k{k}"].append(greedy_tau(agree, k))
    return {c: {m: sum(v) / len(v) for m, v in s.items()} for c, s in per_category.items()}


def measure_pard(drafter, model, items: list[dict], temperature: float, ks: tuple[int, ...]) -> dict:
    """measure()'s figures for a PARD drafter: α from its first position (a plain forward of its LM),
    τ from its K positions per forward (pard_runs), chains no longer than its depth."""
    out = measure(drafter.model, model, items, temperature, ks)
    per_category: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for item in items:
        runs = pard_runs(drafter, item)
        for k in ks:
            per_category[item["category"]][f"tau_k{k}"].append(tau_from_runs(runs, min(k, drafter.depth)))
    for category, taus in per_category.items():
        out[category].update({m: sum(v) / len(v) for m, v in taus.items()})
    return out


class ExitView:
    """A nested draft (S2D) read at one exit, or per position at the first exit whose top-1 probability
    reaches its threshold (``rule``): called like a causal LM, teacher-forced, logits in target ids."""

    def __init__(self, drafter, exit: int | None):
        self.drafter, self.exit = drafter, exit

    def __call__(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> SimpleNamespace:
        from flashmm.train.sorted import exit_logits  # noqa: PLC0415

        draft = self.drafter.model
        exits = self.drafter.exits if self.exit is None else (self.exit,)
        small = exit_logits(draft.lm, draft.target_to_draft[input_ids], None, exits)  # {e: [1, W, Vd]}
        chosen = small[exits[-1]]
        if self.exit is None:  # shallow first: a confident exit answers, else the next one
            taken = torch.zeros(chosen.shape[:-1], dtype=torch.bool)
            for e, threshold in zip(exits[:-1], self.drafter.thresholds):
                take = ~taken & (small[e].softmax(-1).amax(-1) >= threshold)
                chosen = torch.where(take[..., None], small[e], chosen)
                taken |= take
        full = chosen.new_full((*chosen.shape[:-1], draft.target_vocab), float("-inf"))
        full[..., draft.draft_to_target] = chosen
        return SimpleNamespace(logits=full)


def exit_views(drafter) -> dict[str, ExitView]:
    """{"exit<e>": ..., "rule": ...} for a drafter with several exits (S2D); {} for any other."""
    exits = getattr(drafter, "exits", ())
    if len(exits) < 2:
        return {}
    return {**{f"exit{e}": ExitView(drafter, e) for e in exits}, "rule": ExitView(drafter, None)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", required=True, help="trained drafter folders")
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--answers-cache", type=Path, default=work_dir("smollm2_dev_answers.json"))
    ap.add_argument("--out", default="eval/results/draft_acceptance_smollm2")
    args = ap.parse_args(argv)
    from flashmm.weights import load_gguf_lm  # noqa: PLC0415

    model, tokenizer = load_gguf_lm("smollm2", dtype=torch.float32)
    items = target_answers(model, tokenizer, questions(args.questions, args.per_category), args.max_new_tokens,
                           args.answers_cache)
    ks = (4, 8)
    results = {}
    for folder in args.drafters:
        drafter = load(folder)
        if hasattr(drafter, "pard"):  # K tokens per forward: its own depths, not an autoregressive chain
            results[Path(folder).name] = measure_pard(drafter, model, items, args.temperature, ks)
            continue
        results[Path(folder).name] = measure(drafter.model, model, items, args.temperature, ks)
        for name, view in exit_views(drafter).items():  # S2D: every exit alone, and its confidence rule
            results[f"{Path(folder).name}@{name}"] = measure(view, model, items, args.temperature, ks)
    metrics = ["alpha_greedy", "alpha_sampled"] + [f"tau_k{k}" for k in ks]
    rows = []
    for name, per_category in results.items():
        overall = {m: sum(c[m] for c in per_category.values()) / len(per_category) for m in metrics}
        rows.append([name, "all (mean of categories)"] + [overall[m] for m in metrics])
        for category, stats in sorted(per_category.items()):
            rows.append([name, category] + [stats[m] for m in metrics])
    header = ["drafter", "category", "α greedy", f"α sampled T={args.temperature}", "τ greedy k=4", "τ greedy k=8"]
    markdown = (f"# Draft acceptance on SmolLM2-135M-Instruct, dev Spec-Bench ({len(items)} questions, "
                f"{args.per_category} per category, {args.max_new_tokens} new tokens)\n\n"
                "Exact offline computation (eval/draft_acceptance.py docstring): α greedy = the draft's argmax "
                "equals the target's greedy token; τ greedy k = tokens per verification step of chain drafting with "
                f"k tokens; α sampled = mean Σ min(p, q) at T = {args.temperature} along the greedy answers.\n\n"
                f"Command: `python -m eval.draft_acceptance --drafters {' '.join(args.drafters)} "
                f"--per-category {args.per_category}`\n\n" + markdown_table(header, rows) + "\n")
    write_results(args.out, {"machine": machine(), "args": vars(args) | {"questions": str(args.questions),
                                                                       "answers_cache": str(args.answers_cache)},
                             "results": results}, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
