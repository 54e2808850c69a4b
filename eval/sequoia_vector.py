"""Sequoia's positional acceptance vector of a trained EAGLE-3 head, measured on the dev questions
and saved with the head (issue 18), with the replay τ of its trees on the same answers.

    python eval/sequoia_vector.py --drafter assets/text_drafters/smollm2/eagle3 --per-category 3 \\
        --max-new-tokens 128 --save --out eval/results/sequoia_vector_smollm2

Plain greedy ``generate`` answers each dev question; one target forward over prompt + answer gives
the features the head reads and the target's next tokens. accept[r] = the fraction of (answer
position, draft depth) pairs where the target's token is the head's r-th choice
(flashmm.train.eagle3.positional_acceptance, depths 1..--depth, the head unrolled on its own
outputs). τ: exact offline replay of greedy speculative decoding on those answers
(flashmm.train.eagle3.replay_tau) for the EAGLE-2 dynamic tree and the Sequoia tree built from the
vector, at the same node budget, adaptive drafting off (it measures the trees, not the pricing).
``--context-vocab`` replays the dynamic trees with the committed text's tokens added to the head's
vocabulary (Eagle3Drafter(context_vocab=True)), beside the head's own.
``--save`` writes the vector into the folder's drafter.json ("drafting": {"accept": ...}); the
drafter uses it when loaded with tree="sequoia" (or when --tree sequoia is saved as its default).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, markdown_table, write_results  # noqa: E402
from text_speed import DEFAULT_QUESTIONS, load_questions, prompt_ids  # noqa: E402

from flashmm.drafters.eagle3 import CONFIG_FILE, Eagle3Drafter  # noqa: E402
from flashmm.paths import work_dir  # noqa: E402
from flashmm.train import eagle3 as E  # noqa: E402
from flashmm.train.corpus import features  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402


def dev_examples(model, tokenizer, questions, max_new_tokens: int, layers, cache_dir: str) -> list:
    sequences = []
    for q in questions:
        ids = prompt_ids(tokenizer, q["turns"][0])
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        sequences.append((out[0].tolist(), ids.shape[1]))
    cached = features(model, sequences, layers=tuple(layers), top_k=8, cache_dir=cache_dir, target_name="smollm2-dev")
    return [E.example_from(seq, list(range(len(layers)))) for seq in cached]


def replay(drafter, embed, examples, budget: int, unembed=None) -> float:
    drafter._embed = embed  # replay runs without a target: the head reads the target's embeddings
    if drafter.context_vocab:
        drafter.use_target_head(unembed)
    emitted, steps = E.replay_examples(drafter, examples, budget)
    return emitted / max(1, steps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="assets/text_drafters/smollm2/eagle3")
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 60])
    ap.add_argument("--cache", default=str(work_dir("sequoia_features")))
    ap.add_argument("--context-vocab", action="store_true", help="also replay dynamic trees with context_vocab=True")
    ap.add_argument("--save", action="store_true", help="write the vector into the drafter's drafter.json")
    ap.add_argument("--tree", default=None, help="with --save: also make this the folder's default tree")
    ap.add_argument("--out", default="eval/results/sequoia_vector_smollm2")
    args = ap.parse_args(argv)

    model, tokenizer = load_gguf_lm("smollm2")
    head = Eagle3Drafter.from_dir(args.drafter)
    questions = load_questions(args.questions, args.per_category)
    layers = list(head.net.cfg.feature_layers)
    examples = dev_examples(model, tokenizer, questions, args.max_new_tokens, layers, args.cache)
    embed = E.FrozenEmbedding(model.get_input_embeddings().weight.detach().float())
    accept, pairs = E.positional_acceptance(head.net, embed, examples, args.depth, args.ranks)
    rows, unembed = [], model.get_output_embeddings().weight.detach()
    for budget in args.budgets:
        dynamic = Eagle3Drafter(head.net, tree="dynamic", depth=args.depth, top_k=8, adaptive=False)
        sequoia = Eagle3Drafter(head.net, tree="sequoia", depth=args.depth, adaptive=False, accept=accept)
        rows.append([budget, f"{replay(dynamic, embed, examples, budget):.3f}",
                     f"{replay(sequoia, embed, examples, budget):.3f}", len(sequoia.sequoia_paths(budget))])
        if args.context_vocab:
            wide = Eagle3Drafter(head.net, tree="dynamic", depth=args.depth, top_k=8, adaptive=False, context_vocab=True)
            rows[-1].append(f"{replay(wide, embed, examples, budget, unembed):.3f}")
    cmd = "python eval/sequoia_vector.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = "\n".join([
        f"# Sequoia positional acceptance of `{args.drafter}` on {len(examples)} dev answers", "",
        f"Machine: {machine()}", "", f"Command: `{cmd}`", "",
        f"accept[r] over {pairs} (position, depth ≤ {args.depth}) pairs: "
        + ", ".join(f"{a:.4f}" for a in accept), "",
        "Greedy replay τ on the same answers (adaptive drafting off):", "",
        markdown_table(["budget (drafted nodes)", "EAGLE-2 dynamic tree τ", "Sequoia tree τ", "Sequoia nodes"]
                       + (["EAGLE-2 dynamic tree τ, context vocabulary"] if args.context_vocab else []), rows)])
    write_results(args.out, dict(machine=machine(), command=cmd, accept=accept, pairs=pairs,
                                 replay=rows), md + "\n")
    print(md)
    if args.save:
        path = Path(args.drafter) / CONFIG_FILE
        info = json.loads(path.read_text())
        info.setdefault("drafting", {})["accept"] = [round(a, 5) for a in accept]
        if args.tree:
            info["drafting"]["tree"] = args.tree
        info["sequoia_vector"] = dict(command=cmd, pairs=pairs)
        path.write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
