"""Exact greedy replay τ of EAGLE-3 heads on held-out corpus answers (the sequences the EAGLE-3 recipes
hold out: every 16th of each corpus, flashmm.train.eagle3_cache.held_out), so a fine-tuned head and the head it started from are
compared on the same answers.

    python eval/held_out_tau.py --drafters assets/text_drafters/smollm2/eagle3 \\
        assets/text_drafters/smollm2/eagle3_tasks --corpus assets/corpus/smollm2_tasks \\
        assets/corpus/smollm2_tasks_s1 assets/corpus/smollm2 assets/corpus/smollm2_gpu --take 0 0 320 320 \\
        --out eval/results/held_out_tau_smollm2_eagle3_tasks

Per corpus and overall: teacher-forced top-1 at TTT steps 1-6, and τ of a 6-token chain and an
EAGLE-2 tree of 60 nodes (depth 6, top-8), adaptive drafting off, 128 answer tokens per sequence
(flashmm.train.eagle3.replay_tau). Features are cached as tools/drafters/build_eagle3 caches them
(flashmm.train.eagle3_cache, --features).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashmm.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from flashmm.paths import work_dir  # noqa: E402
from flashmm.train import eagle3 as E  # noqa: E402
from tools.corpus.build import load_target  # noqa: E402
from flashmm.train.eagle3_cache import cached_examples, start_from  # noqa: E402


def replay(net, embed, examples, tree: str, budget: int, tokens: int) -> tuple[int, int]:
    """(tokens emitted, verification steps) over ``examples``."""
    drafter = Eagle3Drafter(net, tree=tree, depth=6, top_k=8, adaptive=False)
    drafter._embed = embed
    return E.replay_examples(drafter, examples, budget, tokens)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", required=True)
    ap.add_argument("--corpus", nargs="+", required=True)
    ap.add_argument("--take", type=int, nargs="+", required=True)
    ap.add_argument("--features", default=str(work_dir("head_work", "features")))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if len(args.take) != len(args.corpus):
        ap.error("--take needs one count per --corpus")
    torch.set_num_threads(args.threads)
    model, _ = load_target("smollm2")
    embed = E.FrozenEmbedding(model.get_input_embeddings().weight.detach().float())
    held = {}
    for corpus, n in zip(args.corpus, args.take):
        held[corpus] = cached_examples(model, [corpus], [n], args.features, (2, 15, 27))[1]
    rows = []
    for path in args.drafters:
        net = start_from(path, model)
        totals = {"chain6": [0, 0], "eagle2_60": [0, 0]}
        for name, examples in held.items():
            row = {"drafter": path, "corpus": name, "sequences": len(examples),
                   "top1": E.evaluate(net, embed, examples, E.TrainOptions(ttt_steps=6))["acc"]}
            for key, tree, budget in (("chain6", "chain", 6), ("eagle2_60", "dynamic", 60)):
                e, s = replay(net, embed, examples, tree, budget, args.tokens)
                totals[key] = [totals[key][0] + e, totals[key][1] + s]
                row[key] = round(e / max(1, s), 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        rows.append({"drafter": path, "corpus": "overall", "sequences": sum(len(x) for x in held.values()), "top1": [],
                     **{k: round(e / max(1, s), 3) for k, (e, s) in totals.items()}})
    machine = {"cpu_count": os.cpu_count(), "threads": args.threads, "platform": platform.platform(),
               "torch": torch.__version__}
    lines = ["# Held-out replay τ of EAGLE-3 heads", "", f"Machine: {machine}", "",
             "Command: `python eval/held_out_tau.py " + " ".join(sys.argv[1:]) + "`", "",
             "Greedy replay, adaptive drafting off, the first 128 answer tokens of each held-out sequence "
             "(every 16th of each corpus, never trained on by either head).", "",
             "| drafter | corpus | held-out sequences | top-1 at TTT steps 1-6 | chain of 6 τ | EAGLE-2 60 nodes τ |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['drafter']} | {r['corpus']} | {r['sequences']} | {', '.join(f'{a:.3f}' for a in r['top1']) or '-'} | "
              f"{r['chain6']} | {r['eagle2_60']} |" for r in rows]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
