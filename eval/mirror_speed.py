"""Mirror-SD on a CPU: the same drafter sequential vs drafting in a thread during verification.

    python -m eval.mirror_speed --questions-count 4 --max-new-tokens 96 --out eval/results/mirror_speed_smollm2

For each dev Spec-Bench question (first turn; the target's greedy answers cached by
eval/draft_acceptance.py are the exactness reference) the methods run back to back: the sequential
loop at 1 torch thread (and at 2 with --two-threads), and Mirror (1 torch thread per thread: the target's and the
drafter's, 2 cores in all). Reported per method: wall seconds per new token, τ, exactness against the
target's greedy answer, and for Mirror the fraction of background drafts kept and the drafting
thread's seconds that fell inside the target's verify intervals (the measured overlap).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eval.common import machine, markdown_table, write_results
from flashmm import wrap
from flashmm.drafters import load
from flashmm.drafters.mirror import Mirror
from flashmm.paths import work_dir


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="assets/text_drafters/smollm2/fastdraft")
    ap.add_argument("--draft-options", default='{"adaptive": false, "max_draft_tokens": 2}',
                    help="JSON options for the draft (the same for both loops)")
    ap.add_argument("--questions-count", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--answers-cache", type=Path, default=work_dir("smollm2_dev_answers.json"))
    ap.add_argument("--two-threads", action="store_true",
                    help="also time the sequential loop at 2 torch threads (very slow on an oversubscribed machine)")
    ap.add_argument("--out", default="eval/results/mirror_speed_smollm2")
    args = ap.parse_args(argv)
    from flashmm.weights import load_gguf_lm  # noqa: PLC0415

    target, _ = load_gguf_lm("smollm2", dtype=torch.float32)
    answers = list(json.loads(args.answers_cache.read_text()).items())
    step = max(1, len(answers) // args.questions_count)
    items = answers[::step][: args.questions_count]  # spread over the categories
    options = json.loads(args.draft_options)
    methods = {"sequential 1 thread": (1, load(args.draft, **options)),
               "mirror 1+1 threads": (1, Mirror(load(args.draft, **options)))}
    if args.two_threads:
        methods["sequential 2 threads"] = (2, load(args.draft, **options))
    wrapped = {name: wrap(target, drafter) for name, (_, drafter) in methods.items()}
    totals = {name: {"seconds": 0.0, "tokens": 0, "steps": 0, "accepted": 0, "exact": 0, "overlap": 0.0,
                     "mirror_seconds": 0.0, "verify_seconds": 0.0} for name in methods}
    for q, (key, item) in enumerate(items):
        prompt = torch.tensor([item["prompt"]])
        reference = item["answer"][: args.max_new_tokens]
        for name in list(methods)[q % len(methods) :] + list(methods)[: q % len(methods)]:  # rotate the order against drift
            threads, drafter = methods[name]
            torch.set_num_threads(threads)
            sm = wrapped[name]
            start = time.perf_counter()
            out = sm.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
            seconds = time.perf_counter() - start
            new = out[0, prompt.shape[1] :].tolist()
            t = totals[name]
            t["seconds"] += seconds
            t["tokens"] += len(new)
            t["steps"] += sm.last_stats.verify_steps
            t["accepted"] += sm.last_stats.accepted_tokens
            t["exact"] += int(new[: len(reference)] == reference[: len(new)])
            if isinstance(drafter, Mirror):
                t["overlap"] += drafter.overlap_seconds()
                t["mirror_seconds"] += sum(b - a for kind, a, b in drafter.timeline if kind == "mirror")
                t["verify_seconds"] += sum(b - a for kind, a, b in drafter.timeline if kind == "verify")
            print(f"q{key} {name}: {len(new)} tokens in {seconds:.2f}s", flush=True)
    mirror = methods["mirror 1+1 threads"][1]
    rows = []
    for name, t in totals.items():
        row = [name, t["seconds"] / t["tokens"] * 1e3, (t["accepted"] + t["steps"]) / max(t["steps"], 1),
               f"{t['exact']}/{len(items)}"]
        if name.startswith("mirror"):
            row += [mirror.guess_rate, t["overlap"], t["mirror_seconds"], t["verify_seconds"]]
        else:
            row += ["", "", "", ""]
        rows.append(row)
    header = ["method", "ms / token", "τ", "exact", "guesses kept", "overlap s", "drafting-thread s", "verify s"]
    markdown = (f"# Mirror-SD vs the sequential loop, SmolLM2-135M-Instruct + {Path(args.draft).name} "
                f"({options}), {len(items)} dev questions, {args.max_new_tokens} new tokens, greedy\n\n"
                "Machine shared with other jobs (load 14-17 on 2 cores when measured): wall times are noisy; the overlap "
                "column is the drafting thread's time inside the target's verify intervals (timestamps).\n\n"
                f"Command: `python -m eval.mirror_speed --questions-count {args.questions_count} "
                f"--max-new-tokens {args.max_new_tokens}`\n\n" + markdown_table(header, rows) + "\n")
    write_results(args.out, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                             "totals": totals, "kept": mirror.kept, "dropped": mirror.dropped}, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
