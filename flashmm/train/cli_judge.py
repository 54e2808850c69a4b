"""``python -m flashmm.train judge``: the judge of Judge decoding (flashmm.verify.judge), a verifier's
linear head on the target's own states (flashmm.train.judge says what its label means).

--items of the corpus's greedy answers (a seeded sample) are labelled in chunks of --chunk items, each
cached under --out/work/judge (a rerun reads them back); the judge is logistic regression on them, its
threshold the smallest reaching --precision on a held-out fifth of the items. --out receives
judge.json and judge.safetensors (``flashmm.wrap(..., verifier="judge_lossy", judge=DIR)``).
"""
from __future__ import annotations

from .cli_common import Command, add_text_arguments, command_line, log, method_settings, target_info


def add_arguments(p) -> None:
    add_text_arguments(p, accumulate=False)
    p.add_argument("--items", type=int, default=300, help="greedy corpus answers labelled (a seeded sample)")
    p.add_argument("--per-item", type=int, default=3, help="substituted positions per answer")
    p.add_argument("--min-p", type=float, default=0.05, help="the second choice's least probability")
    p.add_argument("--horizon", type=int, default=14, help="greedy tokens generated after the substitution")
    p.add_argument("--window", type=int, default=8, help="the continuation and the original answer rejoin within "
                   "this many tokens of the substitution")
    p.add_argument("--rejoin", type=int, default=6, help="equal consecutive tokens that count as rejoining")
    p.add_argument("--precision", type=float, default=0.8, help="held-out precision the threshold reaches")
    p.add_argument("--l2", type=float, default=1.0, help="L2 penalty of the logistic regression")
    p.add_argument("--chunk", type=int, default=25, help="items per cached chunk (each chunk draws its positions "
                   "from its own seeded generator, so this shapes the sample)")
    p.add_argument("--chunks", type=int, default=None, help="label and train on only the first K chunks")
    p.epilog = ("Multi-process: under accelerate launch or torchrun the chunks are labelled split over the "
                "processes (process r labels chunk c when c %% P == r; each chunk draws from its own seeded "
                "generator, so the judge is the one a single process writes), and process 0 writes --out.")


def run(args, argv: list[str]) -> int:
    import json  # noqa: PLC0415

    from .cli_common import text_setup  # noqa: PLC0415
    from .corpus import token_pairs  # noqa: PLC0415
    from .judge import build_judge  # noqa: PLC0415

    for name in ("items", "per_item", "horizon", "window", "rejoin", "chunk"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    s = text_setup(args, "judge", method_settings(args))
    pairs = token_pairs(s.records, "greedy")
    judge, report = build_judge(s.model, s.tokenizer, pairs, s.work, args, log=log, parallel=s.parallel)
    if not s.parallel.is_main:  # every process fitted the same judge on the same chunks: process 0 writes it
        return 0
    log(f"judge: {json.dumps(report)}")
    info = {"target": target_info(args.target, s.model),
            "label": (f"second-choice token at a greedy corpus answer position (p >= {args.min_p}); 1 when the "
                      f"target's greedy continuation ({args.horizon} tokens) rejoins the original answer: "
                      f"{args.rejoin} equal consecutive tokens starting within {args.window} tokens"),
            "training": {**method_settings(args), **report}, "command": command_line(argv)}
    judge.save(s.out, info)
    log(f"judge written to {s.out}")
    return 0


COMMANDS = {"judge": Command("train the judge of Judge decoding (a lossy verifier's head on the target's states)",
                             add_arguments, run)}
