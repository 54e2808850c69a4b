"""A/B of the fused step's batch attention: folded grouped-query attention and cache compaction on or off.

    python eval/batch_attention_ab.py --drafters prompt_lookup assets/text_drafters/smollm2/medusa \\
        --batch 8 --questions 16 --rounds 3 --out eval/results/batch_attention_ab

One process, one wrapped model per drafter; each batch of Spec-Bench dev questions (round-robin over the
categories, chat template, left-padded) is decoded by both configurations in alternating order, round
after round. "off" sets ``flashmm.targets.fused_attention.FOLD_MAX = 0`` (every query head attends on its own, as
``scaled_dot_product_attention(enable_gqa=True)``) and ``flashmm.targets.batch.COMPACT_HOLES = 1`` (the
cache is never compacted); "on" is the shipped setting. Both emit the same tokens (checked), so the
ratio is the step's speed alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_results  # noqa: E402
from text_speed import DEFAULT_QUESTIONS  # noqa: E402
from vllm_peer import batches, pick_questions  # noqa: E402

import flashmm  # noqa: E402
import flashmm.targets.batch as padded  # noqa: E402
import flashmm.targets.fused_attention as fused_attention  # noqa: E402
from flashmm.tree.cost import batch_bucket  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402

SETTINGS = {"off": {"FOLD_MAX": 0, "COMPACT_HOLES": 1.0},
            "on": {"FOLD_MAX": fused_attention.FOLD_MAX, "COMPACT_HOLES": padded.COMPACT_HOLES}}


def use(setting: str) -> None:
    fused_attention.FOLD_MAX = SETTINGS[setting]["FOLD_MAX"]
    padded.COMPACT_HOLES = SETTINGS[setting]["COMPACT_HOLES"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", default=["prompt_lookup"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="eval/results/batch_attention_ab")
    args = ap.parse_args(argv)
    model, tokenizer = load_gguf_lm("smollm2")
    units = batches(tokenizer, pick_questions(DEFAULT_QUESTIONS, args.questions), args.batch)
    rows = []
    for name in args.drafters:
        sm = flashmm.wrap(model, name)
        warm = units[0]
        sm.generate(warm["ids"][:, -8:], attention_mask=warm["mask"][:, -8:], max_new_tokens=4, do_sample=False)
        for count in range(1, args.batch + 1):  # the batch costs drafts are priced by, measured untimed
            sm.target.verify_cost(batch=batch_bucket(count))
        seconds = {s: [] for s in SETTINGS}
        tokens = {s: [] for s in SETTINGS}
        outputs = {}
        for round_ in range(args.rounds):
            for index, unit in enumerate(units):
                order = list(SETTINGS) if (round_ + index) % 2 == 0 else list(SETTINGS)[::-1]
                for setting in order:
                    use(setting)
                    start = time.perf_counter()
                    out = sm.generate(unit["ids"], attention_mask=unit["mask"], max_new_tokens=args.max_new_tokens,
                                      do_sample=False)
                    seconds[setting].append(time.perf_counter() - start)
                    tokens[setting].append(sm.last_stats.new_tokens)
                    outputs.setdefault((index, setting), out.tolist())
                    assert outputs[(index, setting)] == out.tolist(), "a configuration changed its own output"
        use("on")
        same = all(outputs[(i, "off")] == outputs[(i, "on")] for i in range(len(units)))
        rate = {s: sum(tokens[s]) / sum(seconds[s]) for s in SETTINGS}
        per_unit = [t_off / t_on for t_off, t_on in zip(seconds["off"], seconds["on"])]
        rows.append({"drafter": name, "tok_per_s": rate, "on_over_off": rate["on"] / rate["off"],
                     "median_unit_ratio": statistics.median(per_unit), "unit_ratios": per_unit, "same_tokens": same})
        print(rows[-1])
    lines = [f"# Batch attention A/B: folded grouped-query attention and compaction, on / off (batch {args.batch})", "",
             f"Command: `python eval/batch_attention_ab.py --drafters {' '.join(args.drafters)} --batch {args.batch} "
             f"--questions {args.questions} --rounds {args.rounds} --out {args.out}`", "",
             f"Machine: {machine()}", "",
             f"SmolLM2-135M-Instruct fp32, greedy, {args.max_new_tokens} new tokens, {len(units)} batches of "
             f"{args.batch} Spec-Bench dev questions × {args.rounds} rounds, the two settings alternating in one "
             "process (off: FOLD_MAX 0, COMPACT_HOLES 1). tok/s = all tokens / all seconds; unit ratio = a batch's "
             "off seconds / on seconds.", "",
             "| drafter | off tok/s | on tok/s | on / off | median unit ratio | unit ratios | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {Path(row['drafter']).name} | {row['tok_per_s']['off']:.1f} | {row['tok_per_s']['on']:.1f} | "
                     f"{row['on_over_off']:.3f} | {row['median_unit_ratio']:.3f} | "
                     f"{', '.join(f'{r:.2f}' for r in row['unit_ratios'])} | {'yes' if row['same_tokens'] else 'NO'} |")
    write_results(args.out, {"machine": machine(), "args": vars(args), "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
