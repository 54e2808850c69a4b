"""``python -m flashmm.train kangaroo``: Kangaroo's adapter after an early exit of the target
(flashmm.train.kangaroo).

The target answers --data (the corpus); its states after --exit-layer and its final-normed states
and top-k logits over those answers are cached (flashmm.train.corpus.features, resumable); the
adapter trains on them, checkpointed every --checkpoint-every sequences (a rerun resumes). Its top-1
agreement with the target is measured on the --validate corpus records after the ones it trained on
(--take), or on the training answers without them. The folder holds the adapter only: layers
[0, exit) and the LM head are the target's own at run time.
"""
from __future__ import annotations

from .cli_common import PARALLEL, Command, add_text_arguments, command_line, log, method_settings, target_info


def add_arguments(p) -> None:
    add_text_arguments(p)
    p.add_argument("--exit-layer", type=int, default=2, help="the early exit: the adapter reads the state after "
                   "this many decoder layers (1 .. layers - 1)")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--ce-positions", type=int, default=48, help="answer positions per sequence in the CE term")
    p.add_argument("--feature-weight", type=float, default=1.0)
    p.add_argument("--checkpoint-every", type=int, default=128, help="sequences between checkpoints")
    p.add_argument("--validate", type=int, default=0, help="measure top-1 agreement on the N corpus records after "
                   "the first --take ones (held out of training; needs --take; 0: on the training answers)")
    p.add_argument("--max-draft-tokens", type=int, default=6, help="drafting: longest chain")
    p.add_argument("--confidence", type=float, default=0.6, help="drafting: stop below this top-1 probability")
    p.epilog = PARALLEL


def run(args, argv: list[str]) -> int:
    from dataclasses import asdict  # noqa: PLC0415

    from ..drafters.kangaroo import Kangaroo  # noqa: PLC0415
    from .cli_common import text_setup  # noqa: PLC0415
    from .corpus import features  # noqa: PLC0415
    from .kangaroo import AdapterTraining, agreement, train_adapter  # noqa: PLC0415

    if args.validate < 0 or (args.validate and args.take is None):
        raise SystemExit(f"--validate {args.validate}: give N >= 0, with --take (the records after --take are held out)")
    if args.accumulate != 1:
        raise SystemExit(f"--accumulate {args.accumulate}: Kangaroo accumulates its own --batch sequences per step "
                         "(split over the processes of a launch); raise --batch instead")
    s = text_setup(args, "kangaroo", method_settings(args, skip=("validate",)))
    n_layers = s.model.config.get_text_config().num_hidden_layers
    if not 1 <= args.exit_layer < n_layers:
        raise SystemExit(f"--exit-layer {args.exit_layer}: must be in 1..{n_layers - 1} for this "
                         f"{n_layers}-layer target")
    cached = s.features(layers=(args.exit_layer, n_layers), top_k=args.top_k)
    settings = AdapterTraining(exit_layer=args.exit_layer, epochs=args.epochs, lr=args.lr, batch=args.batch,
                               ce_positions=args.ce_positions, feature_weight=args.feature_weight, seed=args.seed,
                               checkpoint_every=args.checkpoint_every)
    every = list(range(len(cached)))
    adapter = train_adapter(s.model, cached, every, s.work, 0, 1, settings, log=log, parallel=s.parallel)
    if not s.parallel.is_main:  # the others hold the same adapter: process 0 measures and writes it
        return 0
    measured = {"train_sequences": len(every)}
    if args.validate:
        held = validation_records(args, s)
        held_cached = features(s.model, held, layers=(args.exit_layer, n_layers), top_k=args.top_k,
                               cache_dir=s.features_dir, log=log)
        scores = agreement(adapter, s.model, held_cached, range(len(held_cached)), 0, 1, settings)
        log(f"top-1 agreement on {len(held)} held-out answers: {scores}")
        measured.update({"held_out_sequences": len(held), **scores})
    else:
        scores = agreement(adapter, s.model, cached, every, 0, 1, settings)
        log(f"top-1 agreement on the training answers: {scores}")
        measured["agreement_on_training_answers"] = scores
    info = {"method": "kangaroo", "drafter": "kangaroo", "target": target_info(args.target, s.model),
            "options": {"max_draft_tokens": args.max_draft_tokens, "confidence": args.confidence},
            "training": {**asdict(settings), **measured}, "command": command_line(argv)}
    state = {k: v.detach() for k, v in adapter.state_dict().items()}
    Kangaroo(state, exit_layer=args.exit_layer).save(s.out, info)
    log(f"kangaroo adapter written to {s.out}")
    return 0


def validation_records(args, s) -> list:
    """--validate: the corpus records after the first --take (the --corpus folders', or the corpus
    the target wrote under --out for --data), refused when there are none."""
    from .cli_common import given_corpora  # noqa: PLC0415
    from .corpus import read_corpus  # noqa: PLC0415

    records = given_corpora(args.corpus, args.target) if args.corpus is not None else read_corpus(s.out / "corpus")
    held = records[args.take:args.take + args.validate]
    if not held:
        raise SystemExit(f"--validate {args.validate}: the corpus has {len(records)} records, none after --take "
                         f"{args.take}")
    return held


COMMANDS = {"kangaroo": Command("train a Kangaroo adapter (self-speculation from an early exit)", add_arguments, run)}
