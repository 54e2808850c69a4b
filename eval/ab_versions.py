"""Two checkouts of flashmm against each other on the same questions: is a change within noise?

    git worktree add /tmp/ab_old <commit>
    python eval/ab_versions.py --old /tmp/ab_old --new . --per-category 1 --max-new-tokens 128 --rounds 3 \
        --drafters prompt_lookup suffix assets/text_drafters/smollm2/eagle3 --out eval/results/ab_<name>

Each round runs one worker process per checkout (the order alternates from round to round; a first
warm-up round is not counted, see --warmup-rounds), with
``PYTHONPATH`` set to that checkout so it imports its own flashmm. A worker loads SmolLM2 once and, for
every drafter in turn (a name, ``name:key=value,...`` or a trained folder, as eval/text_speed.py reads them), decodes every question greedily through ``flashmm.wrap`` (its first question once
untimed, to warm up), timing only the ``generate`` calls. Reported per drafter and checkout: tokens/s over
all rounds (total tokens / total seconds), the median round's tokens/s, τ, and new / old; and whether the
two checkouts emitted the same tokens for every question (they should: a refactor changes no output).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import freeze_heap, machine, markdown_table, write_results  # noqa: E402

QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question_dev.jsonl"


def worker(args) -> None:
    """Run in a checkout: decode every question with every drafter, print one JSON line of results."""
    import torch  # noqa: PLC0415

    import flashmm  # noqa: PLC0415
    from flashmm.weights import load_gguf_lm  # noqa: PLC0415
    from text_speed import load_questions, parse_drafter, prompt_ids  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    model, tokenizer = load_gguf_lm("smollm2")
    questions = load_questions(Path(args.questions), args.per_category, args.categories)
    prompts = [prompt_ids(tokenizer, q["turns"][0]) for q in questions]
    results = {"flashmm": flashmm.__file__}
    for spec in args.drafters:
        sm = flashmm.wrap(model, parse_drafter(spec, tokenizer)[1])
        sm.generate(prompts[0], max_new_tokens=8, do_sample=False)  # warm-up, untimed
        freeze_heap()
        seconds, tokens, steps, accepted, outputs = 0.0, 0, 0, 0, []
        for ids in prompts:
            start = time.perf_counter()
            out = sm.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            seconds += time.perf_counter() - start
            new = out[0, ids.shape[1]:].tolist()
            tokens += len(new)
            steps += sm.last_stats.verify_steps
            accepted += sm.last_stats.accepted_tokens
            outputs.append(new)
        results[spec] = {"seconds": seconds, "tokens": tokens, "tau": (accepted + steps) / max(steps, 1),
                         "outputs": outputs}
    print("RESULT " + json.dumps(results), flush=True)


def run_worker(checkout: Path, argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    script = Path(__file__).resolve()
    done = subprocess.run([sys.executable, str(script), "--worker", *argv], cwd=checkout, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the worker in {checkout} failed:\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the checkout measured as the baseline")
    ap.add_argument("--new", type=Path, default=Path("."), help="the checkout measured against it")
    ap.add_argument("--drafters", nargs="+", default=["prompt_lookup"])
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--categories", nargs="+", help="only these Spec-Bench categories (default: every one)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="rounds run first and not counted: the first run on a machine measures and caches the "
                         "target's verify cost (flashmm.disk_cache), which the checkout that runs first would pay")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    child = ["--drafters", *args.drafters, "--questions", args.questions, "--per-category", str(args.per_category),
             *(["--categories", *args.categories] if args.categories else []),
             "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), "--old", "unused"]
    runs = {"old": [], "new": []}
    for r in range(-args.warmup_rounds, args.rounds):
        for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
            result = run_worker(getattr(args, side), child)
            if r < 0:
                print(f"warm-up round {side}: not counted", flush=True)
                continue
            runs[side].append(result)
            print(f"round {r + 1} {side}:", {d: round(runs[side][-1][d]["tokens"] / runs[side][-1][d]["seconds"], 1)
                                           for d in args.drafters}, flush=True)
    rows = []
    for spec in args.drafters:
        rate = {side: sum(x[spec]["tokens"] for x in runs[side]) / sum(x[spec]["seconds"] for x in runs[side])
                for side in runs}
        median = {side: statistics.median(x[spec]["tokens"] / x[spec]["seconds"] for x in runs[side]) for side in runs}
        same = all(a[spec]["outputs"] == b[spec]["outputs"] for a in runs["old"] for b in runs["new"])
        rows.append([spec, f"{rate['old']:.1f}", f"{rate['new']:.1f}", f"{rate['new'] / rate['old']:.3f}",
                     f"{median['new'] / median['old']:.3f}", f"{runs['old'][0][spec]['tau']:.2f}",
                     f"{runs['new'][0][spec]['tau']:.2f}", "yes" if same else "NO"])
    command = "python eval/ab_versions.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = "\n".join([
        f"# Two checkouts of flashmm on SmolLM2-135M-Instruct (fp32, greedy, {args.max_new_tokens} new tokens)", "",
        f"Machine: {machine()}", "", f"Command: `{command}`", "",
        f"old: {runs['old'][0]['flashmm']}; new: {runs['new'][0]['flashmm']}. {args.rounds} rounds after "
        f"{args.warmup_rounds} uncounted warm-up round(s), one worker process "
        "per checkout and round, the order alternating; tok/s = total tokens / total seconds of the timed generate "
        "calls; new/old median = ratio of the median round's tok/s; same tokens = every question's output equal "
        "in every round of both.", "",
        markdown_table(["drafter", "old tok/s", "new tok/s", "new/old", "new/old median", "τ old", "τ new",
                        "same tokens"], rows)])
    print(md)
    if args.out:
        write_results(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, md)


if __name__ == "__main__":
    main()
