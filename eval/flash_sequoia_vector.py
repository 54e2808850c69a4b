"""Sequoia's positional acceptance vector of the reference LMM's FLASH drafter (issue 18), measured
on held-out items, optionally saved with the drafter for ``tree="sequoia"``.

    python eval/flash_sequoia_vector.py --images 8 --videos 4 --vqa 8 --save \\
        --out eval/results/flash_sequoia_vector_reference

Items come from seeds 5000.. (the drafter trained on seeds >= 10000, eval/mm_speed.py measures on
seeds < 1000). Each item is decoded by flashmm with a probe drafter that drafts nothing (so the
output is plain greedy decoding, checked against ``model.generate``) but at every position records
the FLASH drafter's W most likely tokens at depths 1..D after it. accept[r] = the fraction of
(position, depth) pairs — counted where the target's tokens at the shallower depths were all within
the top W, so that the node exists in a full top-W tree — at which the target's token is the r-th
choice. Also per depth: the same rates, and the mean top-1 probability beside the top-1 hit rate
(how well FLASH's own probabilities, which ``pricing="measured"`` prices dynamic trees with, are
calibrated), and the calibration power γ: the maximum-likelihood fit of P(node accepted | parent
accepted) = q^γ over every top-W node of those pairs (q: its draft probability; a power keeps the
best-first order and multiplies along a path). ``--save`` writes both into the drafter's
flash_config.json ("drafting": {"accept": ..., "calibration": γ}); the drafter uses the vector with
tree="sequoia" and γ with pricing="measured".
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository root: tools.reference
from common import machine, markdown_table, write_results  # noqa: E402

import flashmm  # noqa: E402
from flashmm.drafters.base import root_only  # noqa: E402
from flashmm.drafters.flash import CONFIG_NAME, FlashDrafter  # noqa: E402
from tools.reference.flash_build import item_inputs, make_items  # noqa: E402

HELD_OUT_SEED = 5000


class Probe(FlashDrafter):
    """Drafts nothing; records (committed length, top-W token ids [D, W], probabilities [D, W])."""

    def __init__(self, *args, probe_depth: int, width: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.probe_depth, self.width, self.records = probe_depth, width, []

    def propose(self, committed, max_tokens, sampling, generator):
        probs, ids = self.ranked_drafts(committed, self.probe_depth, self.width)
        self.records.append((committed.shape[1], ids.tolist(), probs.tolist()))
        return root_only(committed)


def tally(records, output: list[int], depth: int, width: int, counts, top1, outcomes):
    """Add one item's (position, depth) outcomes: counts[d][r] (r = width: not in the top W),
    top1[d] = [top-1 probability sum, top-1 hits, pairs], outcomes: (top-W probabilities, rank)."""
    for length, ids, probs in records:
        for d in range(depth):
            position = length + d  # the target's token at depth d + 1 after the root length - 1
            if position >= len(output):
                break
            token = output[position]
            rank = ids[d].index(token) if token in ids[d] else width
            counts[d][rank] += 1
            top1[d][0] += probs[d][0]
            top1[d][1] += rank == 0
            top1[d][2] += 1
            outcomes.append((probs[d], rank))
            if rank == width:  # deeper nodes on the target's path are not in the tree
                break


def fit_calibration(outcomes, width: int) -> float:
    """γ in [0.2, 2] maximising Σ log-likelihood of "the target's token is this node" over the top-W
    nodes of every pair, with P = q^γ (float64; a grid of step 0.01)."""
    q = torch.tensor([probs for probs, _ in outcomes], dtype=torch.float64).clamp(1e-9, 1.0)   # [N, W]
    hit = torch.zeros_like(q)
    rows = [i for i, (_, rank) in enumerate(outcomes) if rank < width]
    hit[rows, [outcomes[i][1] for i in rows]] = 1.0
    best = (-math.inf, 1.0)
    for gamma in torch.arange(0.2, 2.0001, 0.01, dtype=torch.float64).tolist():
        p = (q ** gamma).clamp(1e-12, 1 - 1e-12)
        ll = float((hit * p.log() + (1 - hit) * (1 - p).log()).sum())
        best = max(best, (ll, round(gamma, 2)))
    return best[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parents[1]
    ap.add_argument("--flash", default=str(root / "assets/reference_lmm/flash_drafter"))
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--videos", type=int, default=4)
    ap.add_argument("--vqa", type=int, default=8)
    ap.add_argument("--depth", type=int, default=5, help="depths measured (the drafter's default: 5)")
    ap.add_argument("--width", type=int, default=8, help="ranks measured")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--save", action="store_true", help="write accept into the drafter's flash_config.json")
    ap.add_argument("--out", default="eval/results/flash_sequoia_vector_reference")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python eval/flash_sequoia_vector.py " + " ".join(sys.argv[1:] if argv is None else argv)

    from flashmm.reference.load import load_reference_llava  # noqa: PLC0415

    model, processor = load_reference_llava()
    saved = FlashDrafter.from_pretrained(args.flash)
    probe = Probe(saved.net, **saved.drafting_options(), probe_depth=args.depth, width=args.width)
    sm = flashmm.wrap(model, probe, processor=processor)
    seeds = range(HELD_OUT_SEED, HELD_OUT_SEED + max(args.images, args.videos, args.vqa))
    items = (make_items("image", seeds[:args.images]) + make_items("video", seeds[:args.videos])
             + make_items("vqa", seeds[:args.vqa]))
    counts = [[0] * (args.width + 1) for _ in range(args.depth)]
    top1 = [[0.0, 0, 0] for _ in range(args.depth)]
    exact, outcomes = 0, []
    for item in tqdm(items, desc="items"):
        inputs = item_inputs(processor, item["images"], item["prompt"])
        plain = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        probe.records = []
        out = sm.generate(**inputs, max_new_tokens=args.max_new_tokens)
        exact += bool(torch.equal(out, plain))
        tally(probe.records, out[0].tolist(), args.depth, args.width, counts, top1, outcomes)

    pairs = sum(map(sum, counts))
    accept = [sum(c[r] for c in counts) / pairs for r in range(args.width)]
    per_depth = [[c[r] / max(1, sum(c)) for r in range(args.width)] for c in counts]
    gamma = fit_calibration(outcomes, args.width)
    calibration = [dict(depth=d + 1, pairs=t[2], mean_top1_prob=t[0] / max(1, t[2]), top1_rate=t[1] / max(1, t[2]))
                   for d, t in enumerate(top1)]
    header = ["depth", "pairs"] + [f"rank {r}" for r in range(args.width)] + ["mean top-1 prob"]
    rows = [[d + 1, sum(counts[d])] + per_depth[d] + [calibration[d]["mean_top1_prob"]] for d in range(args.depth)]
    rows.append(["all", pairs] + accept + [sum(t[0] for t in top1) / max(1, pairs)])
    info = machine()
    md = (f"# FLASH positional acceptance (reference LMM, held-out seeds {HELD_OUT_SEED}..)\n\n"
          f"Machine: {info}\n\nCommand: `{command}`\n\n"
          f"Items: {args.images} images, {args.videos} videos, {args.vqa} VQA, {args.max_new_tokens} new tokens; "
          f"probe output identical to plain greedy on {exact}/{len(items)}. Rate of rank r = the fraction of "
          "(position, depth) pairs on the target's path through a full top-W tree whose target token is the "
          "FLASH drafter's r-th choice at that depth; the row 'all' is the vector saved for tree='sequoia'. "
          "Mean top-1 prob beside the rank-0 rate: FLASH's calibration.\n\n" + markdown_table(header, rows) + "\n\n"
          f"Calibration power γ (P(node accepted | parent accepted) = q^γ, maximum likelihood over "
          f"{len(outcomes)} pairs × top-{args.width} nodes): **{gamma:.2f}**.\n")
    write_results(args.out, {"machine": info, "command": command, "accept": accept, "per_depth": per_depth,
                             "calibration": calibration, "gamma": gamma, "counts": counts, "exact": exact, "items": len(items)}, md)
    print(md)
    if exact != len(items):
        raise SystemExit(f"the probe's output differed from plain greedy on {len(items) - exact} items")
    if args.save:
        path = Path(args.flash) / CONFIG_NAME
        meta = json.loads(path.read_text())
        meta.setdefault("drafting", {})["accept"] = [round(a, 4) for a in accept]
        meta["drafting"]["calibration"] = gamma
        path.write_text(json.dumps(meta, indent=2))
        print(f"saved accept into {path}")


if __name__ == "__main__":
    main()
