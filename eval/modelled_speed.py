"""Modelled speed of text drafters: how well they size their drafts, without timing noise.

    python eval/modelled_speed.py prompt_lookup "suffix:datastore=store.safetensors" --per-category 1

Each drafter runs the real greedy loop on the real target (SmolLM2 by default) over the dev
questions; every verification step is then priced by the target's measured verify cost for the
number of nodes it verified (``target.verify_cost()``: the forward of N tree tokens on this machine,
a staircase on a CPU) plus the drafting time measured in the loop. The modelled speedup is the
plain loop's time (one one-token forward per token) over that sum. It leaves out what every method
pays alike (the prefill, the per-step bookkeeping), so it ranks sizing policies on a shared machine
whose wall clock is too noisy to tell 5% apart; the timed benchmark (``text_speed.py``) gives the
speed.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from text_speed import DEFAULT_QUESTIONS, load_questions, parse_drafter, prompt_ids  # noqa: E402

import flashmm  # noqa: E402
from flashmm.engine import loop as engine  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402


def verified_nodes(run) -> list[int]:
    """The node count of every verification step of ``run()`` (engine.record_step observed)."""
    nodes, record = [], engine.record_step

    def counting(stats, tree, accepted):
        nodes.append(tree.num_nodes)
        return record(stats, tree, accepted)
    engine.record_step = counting
    try:
        run()
    finally:
        engine.record_step = record
    return nodes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="+", help="registered names, name:key=value,... or trained drafter folders")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--categories", nargs="+", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-draft-tokens", type=int, default=16,
                    help="the engine's budget of drafted tokens a step (SpecConfig.max_draft_tokens)")
    args = ap.parse_args(argv)

    model, tokenizer = load_gguf_lm(args.model)
    questions = load_questions(DEFAULT_QUESTIONS, args.per_category, args.categories)
    for spec in args.drafters:
        label, drafter = parse_drafter(spec, tokenizer)
        sm = flashmm.wrap(model, drafter, max_draft_tokens=args.max_draft_tokens)
        cost = sm.target.verify_cost()
        totals = defaultdict(lambda: [0.0, 0, 0])  # modelled seconds, tokens after the first, steps
        for q in questions:
            ids = prompt_ids(tokenizer, q["turns"][0])
            with torch.no_grad():
                nodes = verified_nodes(partial(sm.generate, ids, max_new_tokens=args.max_new_tokens, do_sample=False))
            stats = sm.last_stats
            seconds = sum(cost.seconds_at(n) for n in nodes) + stats.draft_seconds
            for key in (q["category"], "overall"):
                totals[key][0] += seconds
                totals[key][1] += stats.new_tokens - 1
                totals[key][2] += len(nodes)
        speed = {key: tokens * cost.seconds[0] / seconds for key, (seconds, tokens, _) in totals.items()}
        seconds, tokens, steps = totals["overall"]
        print(f"{label}: modelled {speed['overall']:.3f}x plain steps, tau {tokens / steps:.2f}")
        print("    " + "  ".join(f"{key}: {value:.2f}" for key, value in speed.items() if key != "overall"), flush=True)


if __name__ == "__main__":
    main()
