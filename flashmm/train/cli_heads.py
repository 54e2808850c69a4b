"""``python -m flashmm.train medusa|hydra|mtp``: draft heads on the frozen target (flashmm.train.heads).

The target answers --data (the corpus); its final-normed states and top-k logits over those answers
are cached (flashmm.train.corpus.features, resumable); the heads train on them (checkpointed every
--checkpoint-every steps; a rerun resumes). Heads draft over a reduced vocabulary (the --vocab most
frequent corpus tokens, or --vocab-from another drafter's) through the target's own LM head rows.
Every --holdout-every-th sequence is held out (--holdout-offset: which) to measure each head's rank
accuracy, which shapes the static draft tree (0: measured on the training sequences), and the
folder's greedy τ on them: by exact offline replay of the held-out answers (--replay-tokens, no
target forward) and, with --tau-prompts, by decoding held-out prompts live (checked token-identical
to model.generate).
"""
from __future__ import annotations

from .cli_common import (PARALLEL, VOCAB_FROM_HELP, Command, add_holdout_arguments, add_text_arguments,
                         command_line, log, method_settings, target_info)

DEFAULTS = {  # method: (heads, steps, batch)
    "medusa": (4, 600, 256),
    "hydra": (4, 400, 256),
    "mtp": (3, 120, 2),
}


def arguments_for(method: str):
    heads, steps, batch = DEFAULTS[method]

    def add_arguments(p) -> None:
        add_text_arguments(p)
        p.add_argument("--num-heads", type=int, default=heads, help="tokens drafted past the next one")
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--batch", type=int, default=batch,
                       help="sequences per step" if method == "mtp" else "positions per step")
        p.add_argument("--lr", type=float, default=1e-3)
        p.add_argument("--vocab", type=int, default=8192, help="reduced vocabulary: most frequent corpus tokens "
                       "(0: the target's whole vocabulary)")
        p.add_argument("--vocab-from", metavar="DIR", default=None, help=VOCAB_FROM_HELP)
        p.add_argument("--loss-vocab", default="batch", choices=["batch", "reduced"])
        p.add_argument("--objective", default="ce", choices=["ce", "distill"])
        if method in ("hydra", "mtp"):
            p.add_argument("--intermediate", type=int, default=None,
                           help="MLP width of the " + ("prefix layer" if method == "hydra" else "MTP blocks")
                           + " (default: the target's)")
        if method == "hydra":
            p.add_argument("--prefix-attention", action="store_true",
                           help="Hydra++: a decoder layer over the prefix's target states feeds the heads")
            p.add_argument("--prefix-lr-scale", type=float, default=1.0)
        add_holdout_arguments(p, 20, "each head's rank accuracy and the folder's τ")
        p.add_argument("--replay-tokens", type=int, default=128, help="held-out τ by exact offline replay over the "
                       "first N answer tokens of each held-out sequence (drafter.json held_out_replay; 0: skip)")
        p.add_argument("--tau-prompts", type=int, default=0, help="held-out τ by decoding the first N held-out "
                       "prompts live, --replay-tokens tokens each, checked against model.generate (held_out_tau)")
        p.add_argument("--checkpoint-every", type=int, default=100)
        p.add_argument("--max-draft-tokens", type=int, default=16,
                       help="drafting: nodes of the static tree (0: a chain of the heads)")
        p.add_argument("--lookup", choices=["ngram", "suffix", "none"], default="ngram",
                       help="drafting: a lookup chain merged into the heads' tree")
        p.epilog = PARALLEL

    return add_arguments


def run(args, argv: list[str]) -> int:
    import torch  # noqa: PLC0415

    from ..drafters.head_base import save_heads  # noqa: PLC0415
    from ..drafters.hydra import Hydra  # noqa: PLC0415
    from ..drafters.medusa import Medusa  # noqa: PLC0415
    from ..drafters.mtp import MTP  # noqa: PLC0415
    from . import heads as H  # noqa: PLC0415
    from .cli_common import holdout_split, text_setup, vocab_from  # noqa: PLC0415
    from .corpus import corpus_sequences  # noqa: PLC0415
    from .draft_lm import choose_vocab  # noqa: PLC0415
    from .self_corpus import stop_ids  # noqa: PLC0415

    method = args.method
    if args.num_heads < 1:
        raise SystemExit(f"--num-heads must be >= 1, got {args.num_heads}")
    s = text_setup(args, method, method_settings(args))
    model = s.model
    n_layers = model.config.get_text_config().num_hidden_layers
    cached = s.features(layers=(n_layers,), top_k=args.top_k)
    train, held = holdout_split(len(cached), args)
    train_data = H.load_head_data(cached, train, 0)
    held_data = H.load_head_data(cached, held, 0) if held else train_data
    lm_weight = model.get_output_embeddings().weight.detach().float()          # [V, d]
    embeddings = model.get_input_embeddings().weight.detach().float()          # [V, d]
    chosen = None
    if args.vocab_from is not None:
        chosen = vocab_from(args.vocab_from, lm_weight.shape[0])
    elif args.vocab:
        sequences = corpus_sequences(s.records, "greedy", s.end_id())
        chosen = choose_vocab(sequences, args.vocab, always=tuple(sorted(stop_ids(model, s.tokenizer))))
    vocab = H.Vocab(chosen, lm_weight.shape[0])
    lm_rows = lm_weight[vocab.ids]
    torch.manual_seed(args.seed)
    heads = H.build_heads(method, model.config.get_text_config(), args.num_heads, getattr(args, "intermediate", None),
                          prefix_layer=getattr(args, "prefix_attention", False))
    state = H.train_heads(heads, train_data, lm_rows, embeddings, vocab, steps=args.steps, batch=args.batch, lr=args.lr,
                          loss_vocab=args.loss_vocab, objective=args.objective, seed=args.seed, work_dir=s.work,
                          checkpoint_every=args.checkpoint_every, log=log,
                          prefix_lr_scale=getattr(args, "prefix_lr_scale", 1.0), parallel=s.parallel)
    if not s.parallel.is_main:  # the others hold the same heads: process 0 measures and writes them
        return 0
    accuracy = H.head_accuracy(heads, held_data, lm_rows, embeddings, vocab)
    log("rank accuracy per head: " + "; ".join(" ".join(f"{a:.3f}" for a in row[:4]) for row in accuracy))
    tail = state["losses"][-25:]
    info = {"method": method, "target": target_info(args.target, model),
            "drafting": {**({"tree": "static", "max_draft_tokens": args.max_draft_tokens} if args.max_draft_tokens
                            else {"tree": "chain"}), **({} if args.lookup == "none" else {"lookup": args.lookup})},
            "accuracy": accuracy,
            "training": {**method_settings(args), "steps_done": state["step"], "train_sequences": len(train),
                         "held_out_sequences": len(held), "feature_layer": n_layers,
                         "final_loss": round(sum(l[0] for l in tail) / max(1, len(tail)), 4),
                         "accuracy_measured_on": "held-out sequences" if held else "the training sequences"},
            "command": command_line(argv)}
    drafter = {"medusa": Medusa, "hydra": Hydra, "mtp": MTP}[method]
    ids = vocab.ids if chosen is not None else None
    save_heads(s.out, drafter.name, heads, heads.config(), ids, info)
    if held and args.replay_tokens:
        info["held_out_replay"] = replay_held_out(s.out, model, held_data, args.replay_tokens)
        log(f"held-out greedy τ (exact offline replay) {info['held_out_replay']}")
        save_heads(s.out, drafter.name, heads, heads.config(), ids, info)
    if held and args.tau_prompts:
        info["held_out_tau"] = decode_tau(model, s.out, [s.records[i] for i in held[:args.tau_prompts]],
                                          args.replay_tokens or 128)
        log(f"held-out greedy τ {info['held_out_tau']}")
        save_heads(s.out, drafter.name, heads, heads.config(), ids, info)
    log(f"{method} heads written to {s.out}")
    return 0


def replay_held_out(folder, model, held_data, tokens: int) -> dict:
    """Greedy τ of the folder's drafter on the held-out answers by exact offline replay
    (head_replay.replay_tau), drafting its whole tree every step (adaptive sizing would decline
    some steps: this is τ of the drafts themselves)."""
    from ..drafters import load  # noqa: PLC0415
    from . import head_replay as R  # noqa: PLC0415

    drafter = load(folder, adaptive=False)
    drafter.bind(R.ModelFacts(model))
    return R.replay_tau(drafter, held_data, max_new_tokens=tokens)


def decode_tau(model, folder, records, max_new_tokens: int) -> dict:
    """Greedy decoding of held-out corpus prompts through flashmm.wrap: τ, and whether every output
    equals model.generate's."""
    import torch  # noqa: PLC0415

    from ..drafters import load  # noqa: PLC0415
    from ..engine.api import wrap  # noqa: PLC0415

    sm = wrap(model, load(folder))
    steps = emitted = 0
    exact = True
    for record in records:
        ids = torch.tensor([record.prompt_ids])
        out = sm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        ref = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        exact &= bool(torch.equal(out, ref))
        steps += sm.last_stats.verify_steps
        emitted += sm.last_stats.verify_steps + sm.last_stats.accepted_tokens
    return {"tau": emitted / max(steps, 1), "prompts": len(records), "exact": exact, "max_new_tokens": max_new_tokens}


COMMANDS = {
    "medusa": Command("train Medusa heads (MLP heads on the target's last state)", arguments_for("medusa"), run),
    "hydra": Command("train Hydra heads (sequentially dependent; --prefix-attention --objective distill: Hydra++)",
                     arguments_for("hydra"), run),
    "mtp": Command("train MTP modules (a decoder block per drafted token, DeepSeek-V3 style)", arguments_for("mtp"),
                   run),
}
