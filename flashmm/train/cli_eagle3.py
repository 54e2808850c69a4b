"""``python -m flashmm.train eagle3|eagle|dflash``: drafters that read the target's features.

eagle3: an EAGLE-3 head trained with training-time test (flashmm.train.eagle3). eagle: an EAGLE-1 / EAGLE-2
head on the target's final-normed state (flashmm.train.eagle). dflash: a DFlash
block drafter (flashmm.train.dflash). The target answers --data (the corpus), its features at
--layers are cached over those answers (flashmm.train.corpus.features, resumable), and the network
trains ``--steps`` steps on them (checkpointed every --checkpoint-every steps; a rerun resumes).
EAGLE-3's ``--batch`` > 1 computes the features on --device and holds them there instead
(flashmm.train.eagle3_batched; "plain" and "griffin" styles; on CUDA it trains with TF32 matmuls).
Several --corpus folders are joined in order: the shipped eagle3 trained on both SmolLM2 corpora,

    python -m flashmm.train eagle3 --target smollm2 --corpus assets/corpus/smollm2 assets/corpus/smollm2_gpu \\
        --holdout-every 16 --batch 48 --device cuda --warmup 200 --steps 5000 --ttt-steps 5 --lr 0.001 \\
        --seed 0 --threads 16 --out assets/text_drafters/smollm2/eagle3

(one H200, ~7 min; every 16th sequence of the joined corpora held out for drafter.json's replay_tau).
"""
from __future__ import annotations

from ..distributed import local_device, process_info
from .cli_common import (PARALLEL, VOCAB_FROM_HELP, Command, add_holdout_arguments, add_text_arguments,
                         command_line, log, method_settings, target_info)


def add_arguments(p) -> None:
    add_text_arguments(p)
    p.add_argument("--layers", default=None,
                   help="target layers the head reads, comma-separated output_hidden_states indices "
                        "(default: EAGLE-3's 2, n/2, n-3)")
    p.add_argument("--vocab", type=int, default=8192, help="draft vocabulary: most frequent corpus tokens")
    p.add_argument("--style", default="plain", choices=["plain", "hass", "griffin"])
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unrolled steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--batch", type=int, default=1, help="sequences per step (> 1: features held on --device)")
    p.add_argument("--device", default="cpu", help="where --batch > 1 computes features and trains (on CUDA the "
                   "training's float32 matmuls run in TF32, torch.backends.cuda.matmul.allow_tf32, as the shipped "
                   "eagle3 was trained; the features are computed in full fp32 before it is switched on)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    add_holdout_arguments(p, 0, "the head's teacher-forced accuracy and greedy τ (drafter.json replay_tau)")
    p.add_argument("--eval-sequences", type=int, default=16, help="held-out sequences the τ replay reads")
    p.add_argument("--eval-tokens", type=int, default=128, help="answer tokens replayed per held-out sequence")
    p.add_argument("--depth", type=int, default=6, help="drafting: tree depth")
    p.add_argument("--tree-top-k", type=int, default=8, help="drafting: children per node of the dynamic tree")
    p.epilog = PARALLEL


def layers_of(args, model) -> tuple[int, ...]:
    from .corpus import default_layers  # noqa: PLC0415

    if args.layers is None:
        return tuple(default_layers(model))
    try:
        layers = tuple(int(x) for x in args.layers.split(","))
    except ValueError:
        raise SystemExit(f"--layers {args.layers!r}: give comma-separated integers, e.g. 2,15,27") from None
    n = model.config.get_text_config().num_hidden_layers
    if not layers or not all(0 <= layer <= n for layer in layers):
        raise SystemExit(f"--layers {args.layers!r}: each must be in 0..{n} (the target's output_hidden_states)")
    return layers


def run(args, argv: list[str]) -> int:
    import torch  # noqa: PLC0415

    from ..drafters.eagle3 import save_head  # noqa: PLC0415
    from . import eagle3 as E  # noqa: PLC0415
    from .cli_common import holdout_split, text_setup  # noqa: PLC0415
    from .corpus import corpus_sequences  # noqa: PLC0415
    from .self_corpus import stop_ids  # noqa: PLC0415

    if args.batch > 1 and args.style == "hass":
        raise SystemExit("--style hass needs the cached target logits: use --batch 1")
    drafting_only = ("eval_sequences", "eval_tokens", "depth", "tree_top_k")   # not what the head trains on
    s = text_setup(args, "eagle3", method_settings(args, skip=drafting_only))
    model = s.model
    device = local_device(args.device, process_info())  # a launch's process trains on its own GPU
    layers = layers_of(args, model)
    sequences = corpus_sequences(s.records, "greedy", s.end_id())
    train_ids, held_ids = holdout_split(len(sequences), args)
    embed = E.frozen_embedding(model)
    if args.batch > 1:
        from .eagle3_batched import PaddedExamples  # noqa: PLC0415

        model.to(device)
        train = PaddedExamples.from_target(model, sequences, layers, members=train_ids if held_ids else None, log=log)
        model.cpu()
        held = [train.example(i) for i in held_ids]
        rms_examples = [train.example(i) for i in train_ids[:8]]
        train_embed = E.FrozenEmbedding(embed.weight.to(device))
        torch.backends.cuda.matmul.allow_tf32 = str(device).startswith("cuda")  # the features above are full fp32
    else:
        cached = s.features(layers=layers, top_k=args.top_k)
        columns = list(range(len(layers)))
        train = [E.example_from(cached[i], columns) for i in train_ids]
        held = [E.example_from(cached[i], columns) for i in held_ids]
        rms_examples, train_embed = train, embed
    net = E.new_head(model, sequences, args.vocab, layers, rms_examples, args.seed,
                     always=tuple(sorted(stop_ids(model, s.tokenizer))))
    opts = E.TrainOptions(style=args.style, ttt_steps=args.ttt_steps, lr=args.lr, steps=args.steps,
                          warmup=min(args.warmup, args.steps // 10), batch=args.batch, seed=args.seed,
                          checkpoint_every=args.checkpoint_every)
    summary = E.train(net.to(device if args.batch > 1 else "cpu"), train_embed, train, opts, s.work, log=log,
                      parallel=s.parallel)
    if not s.parallel.is_main:  # the others hold the same head: process 0 measures and writes it
        return 0
    net = net.cpu().float()
    info = {"method": "eagle3", "target": target_info(args.target, model),
            "training": {**summary["options"], "history": summary["history"][-3:], "layers": list(layers),
                         "train_sequences": len(train_ids), "held_out_sequences": len(held_ids),
                         "corpus": corpus_of(args), **({"device": args.device} if args.batch > 1 else {})},
            "command": command_line(argv)}
    if held:
        info["replay_tau"] = {args.style: replay_held_out(net, embed, held[:args.eval_sequences], args.eval_tokens)}
        log(f"held-out replay: {info['replay_tau']}")
    save_head(s.out, net, info, dict(tree="dynamic", depth=args.depth, top_k=args.tree_top_k))
    log(f"EAGLE-3 head written to {s.out}")
    return 0


def corpus_of(args):
    """drafter.json's training "corpus": the --corpus folder (a list when several were joined), or --data's answers."""
    if args.corpus is None:
        return "the target's greedy answers to --data"
    return args.corpus[0] if len(args.corpus) == 1 else list(args.corpus)


def replay_held_out(net, embed, held: list, tokens: int) -> dict:
    """An EAGLE-3 head on held-out sequences: teacher-forced accuracy of 6 unrolled steps, and greedy
    τ by exact replay (flashmm.train.eagle3.replay_tau) of a 6-token chain and of EAGLE-2 trees of
    60 nodes (depth 6, top-k 8), over the first ``tokens`` answer tokens of each."""
    from ..drafters.eagle3 import Eagle3Drafter  # noqa: PLC0415
    from . import eagle3 as E  # noqa: PLC0415

    row = {"teacher_forced": E.evaluate(net, embed, held, E.TrainOptions(ttt_steps=6))}
    for name, drafter, budget in [("chain6", Eagle3Drafter(net, tree="chain", depth=6, adaptive=False), 6),
                                  ("eagle2_60", Eagle3Drafter(net, tree="dynamic", depth=6, top_k=8, adaptive=False),
                                   60)]:
        drafter._embed = embed
        emitted, steps = E.replay_examples(drafter, held, budget, tokens)
        row[name] = round(emitted / max(1, steps), 3)
    return row


def add_dflash_arguments(p) -> None:
    add_text_arguments(p)
    p.add_argument("--layers", default=None, help="target layers the drafter reads, comma-separated "
                   "output_hidden_states indices (default: 2, n/2, n-3)")
    p.add_argument("--vocab", type=int, default=8192, help="draft vocabulary: most frequent corpus tokens "
                   "(0: the target's whole vocabulary)")
    p.add_argument("--vocab-from", metavar="DIR", default=None, help=VOCAB_FROM_HELP)
    p.add_argument("--block-size", type=int, default=8, help="tokens per block (the first is the last committed)")
    p.add_argument("--mask-token", type=int, default=None, help="the id filling a block's drafted slots: one the "
                   "target's chats never use (default: the tokenizer's unk, else pad token)")
    p.add_argument("--num-layers", type=int, default=1, help="decoder layers of the drafter")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps, one sequence each")
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps (at most a tenth of --steps)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    add_holdout_arguments(p, 0, "the acceptance table the tree drafter plans from (drafter.json accept; without "
                          "held-out sequences it is the last training steps')")
    p.epilog = PARALLEL


def run_dflash(args, argv: list[str]) -> int:
    import torch  # noqa: PLC0415

    from . import eagle3 as E  # noqa: PLC0415
    from .cli_common import text_setup  # noqa: PLC0415
    from .cli_common import holdout_split, vocab_from  # noqa: PLC0415
    from .corpus import corpus_sequences  # noqa: PLC0415
    from .dflash import DFlashTrainOptions, held_out_accept, new_net, save_dflash, train  # noqa: PLC0415
    from .draft_lm import choose_vocab  # noqa: PLC0415
    from .self_corpus import stop_ids  # noqa: PLC0415

    if args.block_size < 2:
        raise SystemExit(f"--block-size {args.block_size}: a block holds the committed token and at least one drafted")
    s = text_setup(args, "dflash", method_settings(args))
    model = s.model
    layers = layers_of(args, model)
    mask = args.mask_token
    if mask is None:
        mask = s.tokenizer.unk_token_id if s.tokenizer.unk_token_id is not None else s.tokenizer.pad_token_id
        if mask is None:
            raise SystemExit("--mask-token: the tokenizer has no unk or pad token; give an id the chats never use")
    vocab_size = model.config.get_text_config().vocab_size
    if not 0 <= mask < vocab_size:
        raise SystemExit(f"--mask-token {mask}: not an id of the target's {vocab_size}-token vocabulary")
    cached = s.features(layers=layers, top_k=args.top_k)
    train_ids, held_ids = holdout_split(len(cached), args)
    examples = [E.example_from(cached[i], list(range(len(layers)))) for i in train_ids]
    held = [E.example_from(cached[i], list(range(len(layers)))) for i in held_ids]
    chosen = None
    if args.vocab_from is not None:
        chosen = vocab_from(args.vocab_from, vocab_size)
    elif args.vocab:
        chosen = choose_vocab(corpus_sequences(s.records, "greedy", s.end_id()), args.vocab,
                              always=tuple(sorted(stop_ids(model, s.tokenizer))))
    torch.manual_seed(args.seed)
    net = new_net(model, layers, args.block_size, mask, draft_vocab=chosen, num_layers=args.num_layers)
    opts = DFlashTrainOptions(lr=args.lr, warmup=min(args.warmup, args.steps // 10), steps=args.steps,
                              anchors=args.anchors, seed=args.seed, checkpoint_every=args.checkpoint_every)
    history = train(net, model.get_input_embeddings(), examples, opts, s.work, log=log, parallel=s.parallel)
    if not s.parallel.is_main:  # the others hold the same drafter: process 0 measures and writes it
        return 0
    info = {"method": "dflash", "target": target_info(args.target, model),
            "training": {**method_settings(args), "history": history[-3:], "train_sequences": len(examples)},
            "command": command_line(argv), **({"accept": history[-1]["accept"]} if history else {})}
    if held:
        measured = held_out_accept(net, model.get_input_embeddings(), held)
        log(f"held out ({len(held)} sequences): chain tau {measured['chain_tau']}")
        info["held_out"] = {"sequences": len(held), "counted": measured["counted"], "chain_tau": measured["chain_tau"]}
        info["accept"] = measured["accept"]
    save_dflash(s.out, net, info)
    log(f"DFlash drafter written to {s.out}")
    return 0


def add_eagle_arguments(p) -> None:
    add_text_arguments(p)
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps, one sequence each")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--noise", type=float, default=0.1, help="features read with U(-noise, noise) added")
    p.add_argument("--classification-weight", type=float, default=0.1, help="the classification loss's weight")
    add_holdout_arguments(p, 20, "the head's accuracy (0: measured on the training sequences)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--depth", type=int, default=4, help="drafting: tree depth (EAGLE-2's dynamic tree, verified as "
                   "its best-paying prefix on the target's measured cost)")
    p.add_argument("--tree-top-k", type=int, default=4, help="drafting: children per node of the dynamic tree")
    p.add_argument("--draft-vocab", type=int, default=8192, help="drafting: the head scores only the N most frequent "
                   "corpus tokens (FR-Spec; the target still verifies every token; 0: the whole vocabulary)")
    p.epilog = PARALLEL


def run_eagle(args, argv: list[str]) -> int:
    from . import eagle as H  # noqa: PLC0415
    from . import eagle3 as E  # noqa: PLC0415
    from .cli_common import holdout_split, text_setup  # noqa: PLC0415

    drafting_only = ("depth", "tree_top_k", "draft_vocab")     # options of the folder, not of the training
    s = text_setup(args, "eagle", method_settings(args, skip=drafting_only))
    model = s.model
    last = model.config.get_text_config().num_hidden_layers          # its final-normed state (the LM head's input)
    cached = s.features(layers=(last,), top_k=args.top_k)
    train_ids, held = holdout_split(len(cached), args)
    train = [E.example_from(cached[i], [0]) for i in train_ids]
    held_out = [E.example_from(cached[i], [0]) for i in held] or train
    net = H.new_head(model, args.seed)
    embed = E.frozen_embedding(model)
    lm_weight = model.get_output_embeddings().weight.detach().float()
    loss = H.Eagle1Loss(classification_weight=args.classification_weight, noise=args.noise)
    opts = E.TrainOptions(lr=args.lr, steps=args.steps, warmup=min(args.warmup, args.steps // 10), seed=args.seed,
                          checkpoint_every=args.checkpoint_every)
    summary = E.train(net, embed, train, opts, s.work, log=log,
                      loss_of=lambda ex: H.sequence_loss(net, embed, lm_weight, ex, loss), parallel=s.parallel)
    if not s.parallel.is_main:  # the others hold the same head: process 0 measures and writes it
        return 0
    top1 = H.accuracy(net, embed, lm_weight, held_out, loss)
    log(f"top-1 accuracy of the head's guesses: {top1:.3f}")
    info = {"method": "eagle", "target": target_info(args.target, model),
            "training": {**method_settings(args), "history": summary["history"][-3:], "train_sequences": len(train),
                         "held_out_sequences": len(held), "top1": round(top1, 4),
                         "top1_measured_on": "held-out sequences" if held else "the training sequences"},
            "command": command_line(argv)}
    vocab = None
    if args.draft_vocab:
        from .corpus import corpus_sequences  # noqa: PLC0415
        from .draft_lm import choose_vocab  # noqa: PLC0415
        from .self_corpus import stop_ids  # noqa: PLC0415

        vocab = choose_vocab(corpus_sequences(s.records, "greedy", s.end_id()), args.draft_vocab,
                             always=tuple(sorted(stop_ids(model, s.tokenizer))))
    info["drafting_vocab"] = "the whole vocabulary" if vocab is None else \
        f"{vocab.numel()} most frequent corpus tokens ({H.DRAFT_VOCAB_FILE})"
    H.save_head(s.out, net, info, dict(tree="dynamic", depth=args.depth, top_k=args.tree_top_k, adaptive=True), vocab)
    log(f"EAGLE-1/2 head written to {s.out}")
    return 0


COMMANDS = {"eagle3": Command("train an EAGLE-3 head (training-time test; plain, HASS or GRIFFIN loss)",
                              add_arguments, run),
            "eagle": Command("train an EAGLE-1 / EAGLE-2 head (feature regression + classification; the "
                             "EAGLE repository's layout)", add_eagle_arguments, run_eagle),
            "dflash": Command("train a DFlash block drafter (a block of tokens per forward from the target's "
                              "features)", add_dflash_arguments, run_dflash)}
