"""SpecDec++ against EAGLE-2 scoring for the shipped EAGLE-3 head, by exact greedy replay on the dev answers.

    python eval/sequoia_vector.py --per-category 3 --max-new-tokens 128   # caches the dev features once
    python -m eval.specdecpp_eagle3_replay --out eval/results/specdecpp_eagle3_replay_smollm2

Replays greedy speculative decoding of plain `generate`'s own dev answers (the features
eval/sequoia_vector.py caches under --features) with each policy, adaptive pricing on and off, and
reports τ, nodes and the drafter's measured time per step, and the modeled speedup over
speculation-free decoding (flashmm.train.specdecpp_tree.replay, what specdecpp's --thresholds calibrates with): the timed run's τ should
match the adaptive rows, which separates what the text allows from what the pricing declines.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from eval.common import machine, markdown_table, write_results
from flashmm.drafters import load
from flashmm.paths import work_dir
from flashmm.targets.verify_cost import measure_verify_cost
from flashmm.train import eagle3 as E
from flashmm.train.corpus import CorpusFeatures
from flashmm.train.specdecpp_tree import replay
from flashmm.weights import load_gguf_lm


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", default=str(work_dir("sequoia_features")))
    ap.add_argument("--eagle3", default="assets/text_drafters/smollm2/eagle3_3k")
    ap.add_argument("--specdecpp", default="assets/text_drafters/smollm2/specdecpp_eagle3")
    ap.add_argument("--budget", type=int, default=16, help="the engine's default max_draft_tokens")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="eval/results/specdecpp_eagle3_replay_smollm2")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_gguf_lm("smollm2")
    folders = sorted(Path(args.features).glob("smollm2-dev-L2_15_27-*"))
    if not folders:
        raise FileNotFoundError(f"no dev features under {args.features}: run eval/sequoia_vector.py first")
    meta = json.loads((folders[0] / "meta.json").read_text())
    cached = CorpusFeatures(folders[0], meta["shard_size"], meta["sequences"])
    shards = len(list(folders[0].glob("shard_*.pt")))
    examples = [E.example_from(s, [0, 1, 2]) for shard in range(shards) for s in cached.shard(shard)]
    embed = E.FrozenEmbedding(model.get_input_embeddings().weight.detach().float())
    verify_cost = measure_verify_cost(model, linear="onednn")
    weights = sum(p.numel() for p in model.parameters())
    rows, results = [], {}
    for label, folder in (("EAGLE-2 scoring", args.eagle3), ("SpecDec++", args.specdecpp)):
        for adaptive in (True, False):
            r = replay(load(folder, adaptive=adaptive), embed, examples, args.budget, args.tokens, verify_cost, weights)
            name = f"{label}, {'adaptive pricing' if adaptive else 'drafting every step'}"
            results[name] = r
            rows.append([name, r["tau"], r["nodes_per_step"], r["draft_ms_per_step"], r["modeled_speedup"]])
            print(name, json.dumps(r), flush=True)
    cmd = "python -m eval.specdecpp_eagle3_replay " + " ".join(argv if argv is not None else sys.argv[1:])
    md = "\n".join([f"# SpecDec++ vs EAGLE-2 scoring for the EAGLE-3 head: exact greedy replay of {len(examples)} dev "
                    f"answers ({args.tokens} tokens, budget {args.budget})", "", f"Machine: {machine()}", "",
                    f"Command: `{cmd.strip()}`", "",
                    "modeled speedup = tokens / Σ (t(nodes) / t(1) + drafting seconds / t(1)), t = the target's "
                    "measured oneDNN forward: against speculation-free decoding on oneDNN.", "",
                    markdown_table(["policy", "τ", "nodes / step", "drafting ms / step", "modeled speedup"], rows)])
    write_results(args.out, dict(machine=machine(), command=cmd, results=results), md + "\n")
    print(md)


if __name__ == "__main__":
    main()
