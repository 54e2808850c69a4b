"""Held-out greedy τ of trained head folders (Medusa / Hydra / MTP) under drafting options, by the
exact offline replay of flashmm.train.head_replay.replay_tau (no target forward: the held-out corpus
answers are the target's greedy text and the cached features its states there).

    python eval/heads_tau.py assets/text_drafters/smollm2/mtp --tree-nodes 0 8 16 --fixed

The held-out sequences are the ones ``python -m flashmm.train medusa|hydra|mtp`` held out for the
shipped folders (every --holdout-every-th of the first --take corpus records, from --holdout-offset),
so the numbers compare with drafter.json's ``held_out_replay``. The target's final-normed states over
those records are cached under --features (flashmm.train.corpus.features; computed once, ~1 min a
64-record shard on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashmm.drafters import load as load_drafter  # noqa: E402
from flashmm.paths import work_dir  # noqa: E402
from flashmm.train import head_replay as R  # noqa: E402
from flashmm.train import heads as H  # noqa: E402
from flashmm.train.cli_common import holdout_split, load_target  # noqa: E402
from flashmm.train.corpus import features, read_corpus  # noqa: E402


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--tree-nodes", type=int, nargs="+", default=[None],
                    help="static tree sizes (0: a chain; default: the folder's drafting options)")
    ap.add_argument("--fixed", action="store_true", help="adaptive=False: draft the whole tree every step")
    ap.add_argument("--corpus", default="assets/corpus/smollm2")
    ap.add_argument("--take", type=int, default=512, help="the first N corpus records (the shipped heads': 512)")
    ap.add_argument("--holdout-every", type=int, default=20)
    ap.add_argument("--holdout-offset", type=int, default=0)
    ap.add_argument("--features", default=str(work_dir("heads_tau", "features")), help="feature cache folder")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, _ = load_target("smollm2")
    last = model.config.num_hidden_layers
    cached = features(model, read_corpus(args.corpus)[:args.take], layers=(last,), cache_dir=args.features, log=log)
    held = H.load_head_data(cached, holdout_split(len(cached), args)[1], 0)
    rows = []
    for folder in args.folders:
        for nodes in args.tree_nodes:
            options = {} if nodes is None else \
                {"tree": "static", "max_draft_tokens": nodes} if nodes else {"tree": "chain"}
            if args.fixed:
                options["adaptive"] = False
            drafter = load_drafter(folder, **options)
            drafter.bind(R.ModelFacts(model))
            got = R.replay_tau(drafter, held, max_new_tokens=args.max_new_tokens)
            nodes = drafter.max_draft_tokens if drafter.tree == "static" else 0
            rows.append({"folder": folder, "tree_nodes": nodes, "adaptive": drafter.adaptive, **got})
            log(json.dumps(rows[-1]))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
