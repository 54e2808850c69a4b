"""Build SpecDec++ for SmolLM2's EAGLE-3 head: a rank-acceptance head that scores and stops its trees.

    python -m tools.drafters.build_specdecpp_eagle3 --threads 2 \\
        [--features /tmp/head_work/features --work /tmp/specdecpp_eagle3_work]

Reads the target features build_eagle3 caches (its stage ``features`` computes them). Only the
sequences the EAGLE-3 head never trained on are used (its held-out split, every 16th corpus
sequence): on its own training text the head is more often right than on new text, and a
predictor fitted there is overconfident (fitted on 600 training sequences, its held-out log-loss
was worse than the head's own probabilities'). The first --eval-sequences of them are for
evaluation (held-out metrics; the replay reads the first --replay-sequences), the rest train.
Stages, each cached under --work (a killed run resumes):
  examples   the head unrolled on its own outputs along those sequences: at each answer position
             and depth 0..--depth-1 the head's state, draft distribution and the rank of the
             target's greedy token (flashmm.train.acceptance.rank_examples)
  train      the RankAcceptanceHead: AdamW on cross-entropy, one checkpoint per epoch
  threshold  exact greedy replay (flashmm.train.eagle3.replay_tau) of --replay-sequences evaluation
             answers with the drafter as deployed (EAGLE-2 tree, adaptive pricing against the
             target's measured verify cost): no acceptance head, then each --thresholds value; the
             drafter's own time per step is measured, so each row gets a modeled speedup =
             tokens / (sum over steps of t(nodes) / t(1) + drafting seconds / t(1)). The best
             threshold is written with the head.
The folder (--out) references the EAGLE-3 folder by a relative path (its weights are not copied).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from flashmm.drafters import load
from flashmm.drafters.nets.specdecpp_net import RankAcceptanceHead
from flashmm.drafters.specdecpp import save_specdecpp
from flashmm.paths import work_dir
from flashmm.targets.verify_cost import measure_verify_cost
from flashmm.train import eagle3 as E
from flashmm.train.acceptance import rank_examples, rank_loss, rank_metrics, train_head
from flashmm.train.eagle3_cache import feature_folder, load_examples
from tools.corpus.build import load_target


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


class Timed:
    """A drafter wrapper for replay: records each step's drafted nodes and the seconds propose took."""

    def __init__(self, drafter):
        self.drafter, self.nodes, self.seconds = drafter, [], 0.0

    def begin(self, start):
        self.drafter.begin(start)

    def observe(self, step):
        self.drafter.observe(step)

    def propose(self, committed, max_tokens, sampling, generator):
        start = time.perf_counter()
        draft = self.drafter.propose(committed, max_tokens, sampling, generator)
        self.seconds += time.perf_counter() - start
        self.nodes.append(draft.tokens.shape[1])
        return draft


def replay(drafter, embed, examples, budget: int, tokens: int, verify_cost, target_weights: int) -> dict:
    """τ, nodes per step, drafting ms per step and the modeled speedup of ``drafter`` on ``examples``,
    priced as bind would price it (the target's verify cost and weight count) without a target."""
    drafter._embed = embed
    drafter.length.verify_cost, drafter._target_weights = verify_cost, target_weights
    timed = Timed(drafter)
    emitted, steps = E.replay_examples(timed, examples, budget, tokens)
    t1 = verify_cost.seconds[0]
    verify = sum(verify_cost.relative(n) for n in timed.nodes)
    return {"tau": round(emitted / steps, 3), "steps": steps, "nodes_per_step": round(sum(timed.nodes) / steps, 2),
            "draft_ms_per_step": round(1e3 * timed.seconds / steps, 2),
            "modeled_speedup": round(emitted / (verify + timed.seconds / t1), 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", default=str(work_dir("head_work", "features")))
    ap.add_argument("--eagle3", default="assets/text_drafters/smollm2/eagle3_3k")
    ap.add_argument("--work", default=str(work_dir("specdecpp_eagle3_work")))
    ap.add_argument("--out", default="assets/text_drafters/smollm2/specdecpp_eagle3")
    ap.add_argument("--shards", type=int, default=50)
    ap.add_argument("--eval-sequences", type=int, default=48)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--replay-sequences", type=int, default=24)
    ap.add_argument("--replay-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.7, 0.8, 0.9, 0.95, 0.98])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, _ = load_target("smollm2")
    head_dir = Path(args.eagle3)
    eagle3 = load(head_dir, adaptive=False)
    layers = eagle3.net.cfg.feature_layers
    _, held = load_examples(feature_folder(Path(args.features)), args.shards, tuple(layers))
    if args.replay_sequences > args.eval_sequences or args.eval_sequences >= len(held):
        raise ValueError(f"need replay ({args.replay_sequences}) <= eval ({args.eval_sequences}) < {len(held)} "
                         "held-out sequences")
    embed = E.FrozenEmbedding(model.get_input_embeddings().weight.detach().float())

    log("stage examples")
    path = work / "rank_examples_heldout.pt"
    if not path.exists():
        data = rank_examples(eagle3.net, embed, held, args.depth, args.ranks, log=log)
        torch.save(data, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    data = torch.load(path, weights_only=True)
    evaluation = data["sequence"] < args.eval_sequences
    sets = {name: {k: v[rows] for k, v in data.items()} for name, rows in (("train", ~evaluation), ("heldout", evaluation))}
    log(f"examples: {len(sets['train']['label'])} train, {len(sets['heldout']['label'])} evaluation")

    log("stage train")
    head = RankAcceptanceHead(eagle3.net.cfg.hidden_size, args.ranks, max(args.depth, 8), args.width)
    summary = train_head(head, sets["train"], work_dir=work, epochs=args.epochs, lr=args.lr, seed=args.seed,
                         loss=rank_loss, log=log)
    metrics = rank_metrics(head, sets["heldout"])
    log(f"held-out metrics by depth: {json.dumps(metrics)}")

    log("stage threshold")
    cached = work / "threshold_replay.json"
    rows = json.loads(cached.read_text()) if cached.exists() else {}
    verify_cost = measure_verify_cost(model, linear="onednn")
    weights = sum(p.numel() for p in model.parameters())
    replay_set = held[: args.replay_sequences]
    for h in [None] + args.thresholds:
        key = "heuristic" if h is None else str(h)
        if key in rows:
            continue
        drafter = load(head_dir, **({} if h is None else {"acceptance": head, "threshold": h}))
        rows[key] = replay(drafter, embed, replay_set, args.budget, args.replay_tokens, verify_cost, weights)
        log(f"{key}: {json.dumps(rows[key])}")
        cached.write_text(json.dumps(rows, indent=1))
    best = max(args.thresholds, key=lambda h: rows[str(h)]["modeled_speedup"])
    info = {"method": "specdecpp", "target": json.loads((head_dir / "drafter.json").read_text())["target"],
            "threshold": best,
            "training": {"draft": str(head_dir), "train_sequences": len(held) - args.eval_sequences,
                         "train_examples": summary["examples"],
                         "epochs": summary["epochs"], "losses": summary["losses"], "lr": args.lr, "seed": args.seed,
                         "labels": "rank of the target's greedy token among the EAGLE-3 head's choices, the head "
                                   "unrolled on its own outputs along greedy corpus answers it never trained on "
                                   f"(its held-out split after the first {args.eval_sequences})",
                         "heldout_metrics": metrics, "threshold_replay": rows,
                         "replay": f"{len(replay_set)} evaluation answers x {args.replay_tokens} tokens, budget "
                                   f"{args.budget}, adaptive pricing on (measured verify cost)",
                         "seconds": round(time.time() - started)},
            "notes": "SpecDec++ for EAGLE-3 trees: nodes scored by predicted acceptance; no node below 1 - threshold "
                     "is drafted, so growth stops at the first depth without one",
            "command": f"python -m tools.drafters.build_specdecpp_eagle3 --threads {args.threads}"}
    save_specdecpp(args.out, head, head_dir, info)
    log(f"wrote {args.out} (threshold {best}); {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
