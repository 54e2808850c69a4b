"""Held-out greedy τ of trained head folders (Medusa / Hydra / MTP) under drafting options, by the
exact offline replay of flashmm.train.heads.replay_tau (no target forward: the held-out corpus
answers are the target's greedy text and the cached features its states there).

    python -m tools.drafters.heads_tau assets/text_drafters/smollm2/mtp --tree-nodes 0 8 16 [--shards 8]

The held-out sequences are build_heads.py's (every --holdout-every-th of the first --shards feature
shards), so the numbers compare with drafter.json's ``held_out_replay``.
"""
from __future__ import annotations

import argparse
import json

from flashmm.drafters import load as load_drafter
from flashmm.paths import work_dir
from flashmm.train import heads as H
from tools.corpus.build import load_target
from tools.drafters.build_heads import LAYERS, corpus_features, log


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--tree-nodes", type=int, nargs="+", default=[None], help="static tree sizes (0: a chain; default: the folder's drafting options)")
    ap.add_argument("--fixed", action="store_true", help="adaptive=False: draft the whole tree every step")
    ap.add_argument("--corpus", default="assets/corpus/smollm2")
    ap.add_argument("--features-cache", default=str(work_dir("head_work", "features")))
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--holdout-every", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    model, _ = load_target("smollm2")
    feats = corpus_features(model, args)
    held = H.load_head_data(feats, [i for i in range(len(feats)) if i % args.holdout_every == 0], LAYERS.index(30))
    rows = []
    for folder in args.folders:
        for nodes in args.tree_nodes:
            options = {} if nodes is None else \
                {"tree": "static", "max_draft_tokens": nodes} if nodes else {"tree": "chain"}
            if args.fixed:
                options["adaptive"] = False
            drafter = load_drafter(folder, **options)
            drafter.bind(H.ModelFacts(model))
            got = H.replay_tau(drafter, held, max_new_tokens=args.max_new_tokens)
            nodes = drafter.max_draft_tokens if drafter.tree == "static" else 0
            rows.append({"folder": folder, "tree_nodes": nodes, "adaptive": drafter.adaptive, **got})
            log(json.dumps(rows[-1]))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
