"""``python -m flashmm.train fastdraft|distillspec|adaspec|pard|s2d|specdecpp``: small draft LMs.

Every recipe starts like FastDraft (flashmm.train.draft_lm_stages): a reduced vocabulary, next-token
pretraining on the corpus (the target's greedy answers to --data, with their prompts), alignment on
the answers; then the method's own stage:
  fastdraft    (alias draft_lm) the aligned draft
  distillspec  a divergence to the target's distributions on the draft's own continuations
  adaspec      forward KL on the tokens the draft can still learn (gap to a distilled reference)
  pard         a mask token and K tokens per forward
  s2d          the aligned draft (or --draft, a FastDraft folder) grown to --s2d-layers,
               sorted-trained over --exits, confidence thresholds per exit chosen on --heldout
               records (a seeded shuffle's first ones)
  specdecpp    an acceptance head on --draft (a FastDraft folder, default: the aligned draft, written
               to --out/draft; or an EAGLE-3 folder: a head over its trees' ranks) that stops drafting
               at --threshold, or at the best of --thresholds by replay of held-out records
               (FastDraft: flashmm.train.specdecpp_chain; EAGLE-3: flashmm.train.specdecpp_tree)
Each stage is checkpointed under --out/work/<method>; a rerun resumes.
"""
from __future__ import annotations

import argparse

from .cli_common import PARALLEL, Command, add_text_arguments, command_line, log, method_settings, target_info

DIVERGENCES = ("fkl", "rkl", "tvd", "jsd")   # flashmm.drafters.nets.distill.DIVERGENCES
STAGES = {"fastdraft": ("pretrain", "align"),
          "distillspec": ("pretrain", "align", "distillspec"),
          "adaspec": ("pretrain", "align", "features", "kd", "adaspec"),
          "pard": ("pretrain", "align", "pard")}


def arguments_for(method: str):
    def add_arguments(p) -> None:
        add_text_arguments(p)
        p.add_argument("--vocab", type=int, default=8192, help="draft vocabulary: most frequent corpus tokens")
        p.add_argument("--hidden", type=int, default=384)
        p.add_argument("--layers", type=int, default=2)
        p.add_argument("--heads", type=int, default=6)
        p.add_argument("--intermediate", type=int, default=1024)
        p.add_argument("--init-layers", default="", help="start from the target: its width, these decoder layers "
                       "(e.g. 0,1), its embedding rows and final norm (--hidden, --layers, --heads, --intermediate "
                       "then do not apply)")
        p.add_argument("--pretrain-epochs", type=float, default=2.0)
        p.add_argument("--align-epochs", type=float, default=1.0)
        p.add_argument("--lr", type=float, default=2e-3)
        p.add_argument("--tokens-per-batch", type=int, default=8192)
        p.add_argument("--max-minutes", type=float, default=None, help="stop (checkpointed) after this long")
        if method in ("distillspec", "adaspec"):
            p.add_argument("--distill-epochs", type=float, default=1.0)
            p.add_argument("--distill-sequences", type=int, default=800,
                           help="greedy answers whose target distributions are computed")
        if method == "distillspec":
            p.add_argument("--on-policy-prompts", type=int, default=800)
            p.add_argument("--on-policy-tokens", type=int, default=128)
            p.add_argument("--divergence", default="tvd", choices=DIVERGENCES)
        if method == "adaspec":
            p.add_argument("--select", type=float, default=0.4, help="fraction of tokens kept")
        if method == "pard":
            p.add_argument("--pard-depth", type=int, default=4, help="tokens predicted per forward")
            p.add_argument("--pard-keep", type=float, default=0.7, help="conditional-drop keep fraction per depth")
            p.add_argument("--pard-epochs", type=float, default=1.0)
        if method == "s2d":
            p.add_argument("--draft", default=None, help="a FastDraft folder to grow (default: train one: pretrain "
                           "and align, as fastdraft does); --lr then sets the sorted training's rate only")
            p.add_argument("--s2d-layers", type=int, default=4, help="layers of the nested draft")
            p.add_argument("--exits", default="1,2,4", help="exits trained and drafted from")
            p.add_argument("--s2d-epochs", type=float, default=0.5)
            p.add_argument("--heldout", type=int, default=160, help="corpus records kept out of sorted training to "
                           "choose the thresholds: the first N of the records shuffled with --seed (at most half "
                           "the corpus); training reads the rest in that shuffled order")
            p.add_argument("--tolerance", type=float, default=0.02)
        if method == "specdecpp":
            p.add_argument("--draft", default=None, help="a FastDraft folder (default: train one into --out/draft), "
                           "or an EAGLE-3 head folder (a head over its trees' ranks)")
            p.add_argument("--threshold", type=float, default=0.7,
                           help="stop before the token that makes P(a rejection) exceed this")
            p.add_argument("--thresholds", type=float, nargs="+", default=None, help="calibrate instead of "
                           "--threshold: replay --calibrate-sequences held-out answers with each and keep the best "
                           "modeled speedup (costs measured on this machine, so the choice is machine-timed; "
                           "FastDraft: greedy chains priced in CPU time, flashmm.train.specdecpp_chain; EAGLE-3: "
                           "the deployed trees priced by the target's measured verify cost and the drafting time, "
                           "flashmm.train.specdecpp_tree)")
            p.add_argument("--calibrate-sequences", type=int, default=20, help="held-out records replayed (the "
                           "first N of them)")
            p.add_argument("--heldout-first", type=int, default=None, help="FastDraft: records from this index on are "
                           "held out of training: --heldout-sequences of them measure the head and calibrate "
                           "--thresholds (default: none held out; metrics on the training answers)")
            p.add_argument("--heldout-sequences", type=int, default=100, help="held-out records (FastDraft: from "
                           "--heldout-first on; EAGLE-3: the first N of the sequences --draft-holdout-every names, "
                           "the rank head training on the rest)")
            p.add_argument("--train-sequences", type=int, default=None, help="FastDraft: train the head on a seeded "
                           "sample of N records (kept in corpus order) of those before --heldout-first (default: all)")
            p.add_argument("--end-token", action=argparse.BooleanOptionalAction, default=True, help="FastDraft: "
                           "finished answers end with the end-of-turn id, as in every draft-LM stage; --no-end-token "
                           "leaves it out of the head's examples")
            p.add_argument("--draft-holdout-every", type=int, default=None, help="EAGLE-3: read only the corpus "
                           "sequences the draft held out of its training, sequence i when i %% N == "
                           "--draft-holdout-offset (the draft command's --holdout-every / --holdout-offset; default: "
                           "every sequence, none held out)")
            p.add_argument("--draft-holdout-offset", type=int, default=None, help="EAGLE-3: see "
                           "--draft-holdout-every (default N-1)")
            p.add_argument("--calibrate-tokens", type=int, default=128, help="EAGLE-3: answer tokens replayed per "
                           "calibration sequence")
            p.add_argument("--calibrate-budget", type=int, default=60, help="EAGLE-3: nodes each replayed step may "
                           "draft (the engine's budget)")
            p.add_argument("--max-draft-tokens", type=int, default=8)
            p.add_argument("--width", type=int, default=None,
                           help="the acceptance head's hidden width (default 128; 64 on an EAGLE-3 head)")
            p.add_argument("--depth", type=int, default=6, help="EAGLE-3: tree depths the rank head learns")
            p.add_argument("--ranks", type=int, default=8, help="EAGLE-3: children ranks the rank head tells apart")
            p.add_argument("--head-epochs", type=int, default=1)
            p.add_argument("--head-lr", type=float, default=2e-3)
        p.epilog = PARALLEL

    return add_arguments


RECIPE_OPTIONS = ("distill_epochs", "distill_sequences", "on_policy_prompts", "on_policy_tokens", "divergence",
                  "select", "pard_depth", "pard_keep", "pard_epochs")


def run(args, argv: list[str]) -> int:
    from types import SimpleNamespace  # noqa: PLC0415

    from ..drafters.fastdraft import save_reduced_lm  # noqa: PLC0415
    from .cli_common import text_setup  # noqa: PLC0415
    from .draft_lm_stages import DraftLMStages  # noqa: PLC0415

    method = args.method
    given_draft = getattr(args, "draft", None)
    if given_draft is not None:
        from ..drafters.saved import read_info  # noqa: PLC0415

        try:
            kind = read_info(given_draft)["drafter"]
        except (FileNotFoundError, ValueError) as err:
            raise SystemExit(f"--draft {given_draft}: {err}") from None
        allowed = ("fastdraft", "eagle3") if method == "specdecpp" else ("fastdraft",)
        if kind not in allowed:
            raise SystemExit(f"--draft {given_draft}: holds a {kind!r} drafter; {method} "
                             + ("heads sit on a FastDraft or an EAGLE-3 folder" if method == "specdecpp"
                                else "grows a FastDraft folder"))
    if method == "specdecpp":
        refuse_other_kinds_options(args, given_draft, "eagle3" if given_draft and kind == "eagle3" else "fastdraft")
    s = text_setup(args, method, method_settings(args))
    trained = {}

    def export(name, draft, summary, notes, drafter="fastdraft", extra=None, **more):
        trained[name] = (draft, summary)
        if name != method or not s.parallel.is_main:
            return
        info = {"method": name, "target": target_info(args.target, s.model),
                "training": {**summary, "options": method_settings(args)}, "notes": notes,
                "command": command_line(argv), **more}
        save_reduced_lm(s.out, draft, info, drafter=drafter, extra=extra)
        log(f"{name} written to {s.out}")

    # DraftLMStages reads every recipe's options by name; the other recipes' are None here
    options = SimpleNamespace(**{**dict.fromkeys(RECIPE_OPTIONS), **vars(args)})
    stages = DraftLMStages(s.records, options, s.work, lambda: (s.model, s.tokenizer), export, log=log,
                           parallel=s.parallel)
    needs = () if given_draft else STAGES.get(method, ("pretrain", "align"))
    for stage in needs:
        getattr(stages, f"stage_{stage}")()
    if method == "s2d":
        train_s2d(args, argv, s, stages, trained.get("fastdraft", (None,))[0])
    elif method == "specdecpp":
        train_specdecpp(args, argv, s, trained.get("fastdraft"))
    return 0


def refuse_other_kinds_options(args, draft, kind: str) -> None:
    """specdecpp: the options of the other kind of --draft (FastDraft's record choice, EAGLE-3's held-out split
    and replay) are refused, naming them, unless at their defaults."""
    from .specdecpp_tree import TREE_OPTIONS  # noqa: PLC0415

    only = CHAIN_OPTIONS if kind == "eagle3" else TREE_OPTIONS
    wrong = [f"--{k.replace('_', '-')}" for k in only if getattr(args, k) != only[k]]
    if wrong:
        raise SystemExit(f"{', '.join(wrong)}: {'FastDraft' if kind == 'eagle3' else 'EAGLE-3'} drafts only; --draft "
                         f"{draft or '(a FastDraft trained into --out/draft)'} is "
                         f"{'an EAGLE-3 head' if kind == 'eagle3' else 'a FastDraft draft'}")


def train_s2d(args, argv, s, stages, aligned) -> None:
    """S2D (flashmm.train.sorted): the aligned draft (or --draft) deepened with identity layers,
    sorted-trained on the greedy answers of the records not held out, thresholds chosen on the rest."""
    import random  # noqa: PLC0415

    from ..drafters.fastdraft import ReducedVocabLM, load_reduced_lm  # noqa: PLC0415
    from ..drafters.s2d import save_s2d  # noqa: PLC0415
    from ..drafters.nets.distill import target_rows  # noqa: PLC0415
    from . import draft_lm as T  # noqa: PLC0415
    from .corpus import corpus_sequences  # noqa: PLC0415
    from .sorted import deepen, train_nested  # noqa: PLC0415

    try:
        exits = tuple(int(e) for e in args.exits.split(","))
    except ValueError:
        raise SystemExit(f"--exits {args.exits!r}: give comma-separated layer counts, e.g. 1,2,4") from None
    if not exits or exits != tuple(sorted(set(exits))) or exits[0] < 1 or exits[-1] > args.s2d_layers:
        raise SystemExit(f"--exits {args.exits!r}: increasing layer counts within 1..--s2d-layers ({args.s2d_layers})")
    if args.heldout < 1:
        raise SystemExit(f"--heldout must be >= 1, got {args.heldout}")
    if aligned is None:
        aligned = load_reduced_lm(args.draft)[0]
    start = f"{args.draft or 'the aligned draft'} ({aligned.lm.config.num_hidden_layers} layers)"
    draft = ReducedVocabLM(deepen(aligned.lm, args.s2d_layers), aligned.draft_to_target, aligned.target_vocab)
    rows = target_rows(draft.draft_to_target, draft.target_vocab)
    order = list(range(len(s.records)))
    random.Random(args.seed).shuffle(order)
    held = min(args.heldout, len(order) // 2)  # a one-record corpus: trained and held out at once
    train_records = [s.records[i] for i in order[held:]]
    heldout_records = [s.records[i] for i in order[:held]] or train_records
    train, heldout = (T.examples_from_sequences(corpus_sequences(records, "greedy", stages.end_id()), rows,
                                                answers_only=True) for records in (train_records, heldout_records))
    log(f"s2d: {len(train_records)} training records, {len(heldout_records)} held out; exits {exits} of "
        f"{args.s2d_layers} layers, from {start}")
    summary, chosen = train_nested(draft.lm, train, heldout, exits, s.work, target_to_draft=rows,
                                   epochs=args.s2d_epochs, lr=args.lr, tokens_per_batch=args.tokens_per_batch,
                                   seed=args.seed, tolerance=args.tolerance, max_seconds=stages.seconds_left(), log=log,
                                   parallel=s.parallel)
    if not summary["finished"]:
        raise SystemExit(f"sorted training stopped at step {summary['step']}/{summary['total']}: run again to resume")
    if not s.parallel.is_main:  # the others hold the same weights: process 0 chooses the thresholds and writes
        return
    log(f"s2d thresholds {chosen['thresholds']} (agreement per exit {chosen['agreement_per_exit']})")
    info = {"method": "s2d", "target": target_info(args.target, s.model),
            "training": {**summary, "options": method_settings(args), "init": f"{start} grown to "
                         f"{args.s2d_layers} with identity layers", "heldout_records": len(heldout_records)},
            "thresholds_heldout": chosen, "command": command_line(argv),
            "notes": "S2D: nested draft, every exit drafts; per drafted token the first exit whose top-1 "
                     "probability reaches its threshold answers (deepest always)"}
    save_s2d(s.out, draft, info, exits, tuple(chosen["thresholds"]))
    log(f"s2d written to {s.out}")


def train_specdecpp(args, argv, s, aligned) -> None:
    """SpecDec++ (flashmm.train.acceptance): an acceptance head on the draft's states (a FastDraft's
    chains), or over an EAGLE-3 head's tree ranks."""
    from pathlib import Path  # noqa: PLC0415

    from ..drafters.fastdraft import save_reduced_lm  # noqa: PLC0415
    from ..drafters.saved import read_info  # noqa: PLC0415
    from ..drafters.specdecpp import save_specdecpp  # noqa: PLC0415
    from .specdecpp_tree import rank_head  # noqa: PLC0415

    if args.draft is None:
        draft_dir = s.out / "draft"
        draft, summary = aligned
        s.parallel.main_writes(lambda: save_reduced_lm(
            draft_dir, draft, {"method": "fastdraft", "target": target_info(args.target, s.model),
                               "training": summary, "command": command_line(argv),
                               "notes": "the draft of the SpecDec++ folder above"}))
    else:
        draft_dir = Path(args.draft)
    ranks = read_info(draft_dir)["drafter"] == "eagle3"
    if ranks:
        head, summary, threshold, more = rank_head(args, s, draft_dir, log=log)
        notes = ("SpecDec++ for EAGLE-3 trees: nodes scored by predicted acceptance; no node below 1 - threshold "
                 "is drafted, so growth stops at the first depth without one" +
                 (" (calibrated by replay of held-out answers)" if args.thresholds else ""))
    else:
        head, summary, threshold, more = chain_head(args, s, draft_dir)
        notes = ("SpecDec++: stop drafting before the token that makes P(at least one rejection) exceed threshold" +
                 (" (calibrated by greedy replay of held-out answers)" if args.thresholds else ""))
    if not s.parallel.is_main:  # the others hold the same head: process 0 calibrates and writes it
        return
    info = {"method": "specdecpp", "target": target_info(args.target, s.model), "threshold": threshold,
            **({} if ranks else {"max_draft_tokens": args.max_draft_tokens}),
            "training": {**summary, "options": method_settings(args), **more}, "notes": notes,
            "command": command_line(argv)}
    save_specdecpp(s.out, head, draft_dir, info)
    log(f"specdecpp written to {s.out} (draft: {draft_dir})")


def _cached(path, make):
    """torch.load(path, weights_only=True), written first by ``make()`` (atomically) when missing."""
    import torch  # noqa: PLC0415

    if not path.exists():
        torch.save(make(), path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    return torch.load(path, weights_only=True)


CHAIN_OPTIONS = {"heldout_first": None, "train_sequences": None, "end_token": True}  # FastDraft only: their defaults


def chain_head(args, s, draft_dir):
    """(head, summary, threshold, record): an AcceptanceHead on a draft LM, P(the draft's greedy token is the
    target's), teacher-forced on the training records' greedy answers (flashmm.train.specdecpp_chain:
    which records, and the threshold --thresholds calibrates on held-out ones)."""
    import torch  # noqa: PLC0415

    from ..drafters import load  # noqa: PLC0415
    from ..drafters.specdecpp import AcceptanceHead  # noqa: PLC0415
    from .acceptance import acceptance_examples, head_metrics, train_head  # noqa: PLC0415
    from .corpus import corpus_sequences  # noqa: PLC0415
    from .specdecpp_chain import calibrate, split_records  # noqa: PLC0415

    try:
        train, heldout = split_records(s.records, args.seed, args.train_sequences, args.heldout_first,
                                       args.heldout_sequences)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if args.thresholds and not heldout:
        raise SystemExit("--thresholds: calibration replays held-out answers: give --heldout-first")
    if args.calibrate_sequences < 1:
        raise SystemExit(f"--calibrate-sequences must be >= 1, got {args.calibrate_sequences}")
    torch.manual_seed(args.seed)  # before the draft is built: the head's initial weights draw after it
    draft_lm = load(draft_dir).model
    end_id = s.end_id() if args.end_token else None

    def examples(records, name):
        return _cached(s.work / f"{name}.pt",
                       lambda: acceptance_examples(draft_lm, corpus_sequences(records, "greedy", end_id), log=log))

    data = s.parallel.main_first(lambda: examples(train, "acceptance_examples"))
    head = AcceptanceHead(data["hidden"].shape[1], args.width or 128)
    summary = train_head(head, data, work_dir=s.work, epochs=args.head_epochs, lr=args.head_lr, seed=args.seed,
                         log=log, parallel=s.parallel)
    summary["train_records"] = len(train)
    if not s.parallel.is_main:
        return head, summary, args.threshold, {}
    if not heldout:
        return head, summary, args.threshold, {"metrics_on_training_answers": head_metrics(head, data)}
    record = {"heldout_records": [args.heldout_first, args.heldout_first + len(heldout)],
              "heldout_metrics": head_metrics(head, examples(heldout, "acceptance_examples_heldout"))}
    if not args.thresholds:
        return head, summary, args.threshold, record
    best, replay, cost = calibrate(s.model, draft_lm, head, heldout[:args.calibrate_sequences], args.thresholds,
                                   args.max_draft_tokens, log=log)
    return head, summary, best, {**record, "threshold_replay": replay, "cost_model": cost}


COMMANDS = {
    "fastdraft": Command("train a FastDraft draft LM (pretrain on the corpus, align on the target's answers)",
                         arguments_for("fastdraft"), run, aliases=("draft_lm",)),
    "distillspec": Command("train a DistillSpec draft LM (on-policy distillation)", arguments_for("distillspec"), run),
    "adaspec": Command("train an AdaSPEC draft LM (selective distillation)", arguments_for("adaspec"), run),
    "pard": Command("train a PARD draft LM (K tokens per forward)", arguments_for("pard"), run),
    "s2d": Command("train an S2D nested draft LM (sorted fine-tuning, exits with thresholds)", arguments_for("s2d"),
                   run),
    "specdecpp": Command("train a SpecDec++ acceptance head on a FastDraft draft or an EAGLE-3 head", arguments_for("specdecpp"), run),
}
