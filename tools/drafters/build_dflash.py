"""Build SmolLM2's DFlash block drafter (assets/text_drafters/smollm2/dflash) from the self-distillation corpus.

    python -m tools.drafters.build_dflash --take 1024 --steps 3000 --block-size 8 --threads 2 \\
        [--features /tmp/head_work/features --work /tmp/dflash_work] --out assets/text_drafters/smollm2/dflash

Stages, each resumable (a killed run continues where it stopped):
  features  the target's hidden states at layers 2, 15, 27 (and 30) over the first --take greedy sequences
            of assets/corpus/smollm2, cached by flashmm.train.corpus.features (shards of 64 sequences, ~40 s a
            shard on 2 quiet cores; shared with tools/drafters/build_eagle3.py's cache)
  train     flashmm.train.dflash.train: one layer, block --block-size, anchors in the answers, resumable from
            --work; the draft vocabulary is the shipped EAGLE-3 head's 8,192 tokens, the mask token
            <empty_output> (id 16), which the chat never uses
  held out  the acceptance table (block position x rank, given the chain before it accepted) on the held-out
            sequences; the tree drafter plans from it (drafter.json "accept")
  ship      the network in fp16 with drafter.json (method, target, this command)
Held out of training: every 16th sequence (as build_eagle3 holds them out).
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from flashmm.drafters import load
from flashmm.train.dflash import DFlashTrainOptions, held_out_accept, new_net, save_dflash, train
from tools.corpus.build import load_target
from tools.drafters.build_eagle3 import TARGET, cached_examples

LAYERS = (2, 15, 27)
MASK_TOKEN = 16  # <empty_output>


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--take", type=int, default=1024, help="greedy sequences of assets/corpus/smollm2 (0: all)")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--features", default="/tmp/head_work/features")
    ap.add_argument("--work", default="/tmp/dflash_work")
    ap.add_argument("--out", default="assets/text_drafters/smollm2/dflash")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_target("smollm2")
    examples, held = cached_examples(model, ["assets/corpus/smollm2"], [args.take], args.features, LAYERS)
    log(f"{len(examples)} training sequences, {len(held)} held out")
    vocab = load("assets/text_drafters/smollm2/eagle3").net.draft_to_target
    torch.manual_seed(args.seed)
    net = new_net(model, LAYERS, args.block_size, MASK_TOKEN, draft_vocab=vocab)
    opts = DFlashTrainOptions(lr=args.lr, steps=args.steps, anchors=args.anchors, seed=args.seed)
    history = train(net, model.get_input_embeddings(), examples, opts, args.work, log=log)
    held_out = held_out_accept(net, model.get_input_embeddings(), held)
    log(f"held out ({len(held)} sequences): chain tau {held_out['chain_tau']}, top-1 by position "
        f"{[row[0] for row in held_out['accept']]}")
    command = "python -m tools.drafters.build_dflash " + shlex.join(sys.argv[1:] if argv is None else argv)
    info = {"method": "dflash", "target": {**TARGET, "vocab_size": model.config.vocab_size,
                                           "num_hidden_layers": model.config.num_hidden_layers},
            "training": {**vars(args), "history": history[-3:], "train_sequences": len(examples)},
            "held_out": {"sequences": len(held), "counted": held_out["counted"], "chain_tau": held_out["chain_tau"]},
            "command": command, "accept": held_out["accept"]}
    save_dflash(Path(args.out), net, info)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
