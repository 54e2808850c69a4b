"""Where an EAGLE-3 head loses on Spec-Bench: its first choice against the target's greedy token on
the dev answers and on held-out corpus answers, bucketed by the target's own top-1 probability, and
the answer tokens outside the head's draft vocabulary (and how many of them the committed text
already holds, which ``Eagle3Drafter(context_vocab=True)`` adds).

    python eval/head_gap.py --drafter assets/text_drafters/smollm2/eagle3 --per-category 3 \\
        --held-out 60 --out eval/results/head_gap_smollm2_eagle3

Dev answers: plain greedy ``generate`` on the dev questions (as eval/sequoia_vector.py). Held-out
answers: the corpora's held-out sequences (flashmm.train.eagle3_cache.held_out), cut to the same
number of answer tokens. Depth 1 only (the head reading the target's features), the head's own
vocabulary (no context vocabulary): a token outside it counts as a miss.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository root
from common import machine, markdown_table, write_results  # noqa: E402
from sequoia_vector import dev_examples  # noqa: E402
from text_speed import DEFAULT_QUESTIONS, load_questions  # noqa: E402

from flashmm.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from flashmm.paths import work_dir  # noqa: E402
from flashmm.train import eagle3 as E  # noqa: E402
from flashmm.train.corpus import corpus_sequences, features  # noqa: E402
from flashmm.train.eagle3_cache import held_out  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.01)


@torch.no_grad()
def first_choices(net, embed, examples) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per example: (hit [n] bool: the head's argmax is the target's greedy token, target top-1
    probability [n]) at its answer positions."""
    rows, out = E.target_rows(net), []
    for ex in examples:
        for _, _, _, rank in E.drafted_ranks(net, embed, ex, 1, rows):
            labels = torch.arange(max(0, ex.prompt_len - 2), ex.ids.shape[0] - 1) + 1
            labels = labels[(labels <= ex.ids.shape[0] - 2) & (labels >= ex.prompt_len - 1)]
            confidence = (ex.topk_logits[labels, 0].float() - ex.logsumexp[labels]).exp()
            out.append((rank == 0, confidence))
    return out


def bucket_rows(choices) -> tuple[list[list], float, int]:
    """(one row per confidence bucket: range, share of positions, head top-1; overall top-1; positions)."""
    hit = torch.cat([h for h, _ in choices]).float()
    conf = torch.cat([c for _, c in choices])
    which = torch.bucketize(conf, torch.tensor(EDGES)) - 1
    rows = []
    for k in range(len(EDGES) - 1):
        inside = which == k
        rows.append([f"[{EDGES[k]:.2f}, {min(EDGES[k + 1], 1.0):.2f}{']' if k == len(EDGES) - 2 else ')'}",
                     f"{float(inside.float().mean()):.3f}", f"{float(hit[inside].mean()) if inside.any() else 0:.3f}"])
    return rows, float(hit.mean()), len(hit)


def outside(net, examples, labels) -> dict:
    """{label: [outside, of which in the prompt, of which earlier in the answer, answer tokens]}."""
    counts = defaultdict(lambda: [0, 0, 0, 0])
    for ex, label in zip(examples, labels):
        prompt, seen = set(ex.ids[:ex.prompt_len].tolist()), set()
        for token in ex.ids[ex.prompt_len:].tolist():
            for key in (label, "all"):
                c = counts[key]
                c[3] += 1
                if not net.t2d[token]:
                    c[0] += 1
                    c[1] += token in prompt
                    c[2] += token not in prompt and token in seen
            seen.add(token)
    return counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="assets/text_drafters/smollm2/eagle3")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--held-out", type=int, default=60, help="held-out corpus answers")
    ap.add_argument("--corpus", nargs="+", default=["assets/corpus/smollm2", "assets/corpus/smollm2_gpu"])
    ap.add_argument("--cache", default=str(work_dir("sequoia_features")))
    ap.add_argument("--out", default="eval/results/head_gap_smollm2_eagle3")
    args = ap.parse_args(argv)

    model, tokenizer = load_gguf_lm("smollm2")
    net = Eagle3Drafter.from_dir(args.drafter).net
    layers = list(net.cfg.feature_layers)
    embed = E.FrozenEmbedding(model.get_input_embeddings().weight.detach().float())
    questions = load_questions(DEFAULT_QUESTIONS, args.per_category)
    dev = dev_examples(model, tokenizer, questions, args.max_new_tokens, layers, args.cache)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sequences = [s for corpus in args.corpus for s in corpus_sequences(corpus, "greedy", end)]
    held = [(ids[:p + args.max_new_tokens], p) for i, (ids, p) in enumerate(sequences) if held_out(i)]
    cached = features(model, held[:args.held_out], layers=tuple(layers), top_k=8, cache_dir=args.cache,
                      target_name="smollm2-held-out")
    held = [E.example_from(seq, list(range(len(layers)))) for seq in cached]

    tables, summary = [], {}
    for name, examples in (("dev answers", dev), ("held-out corpus answers", held)):
        rows, top1, n = bucket_rows(first_choices(net, embed, examples))
        summary[name] = dict(top1=top1, positions=n, buckets=rows)
        tables += [f"**{name}** ({len(examples)} answers, {n} positions): head top-1 {top1:.3f}", "",
                   markdown_table(["target top-1 probability", "share of positions", "head top-1"], rows), ""]
    counts = {**outside(net, dev, [q["category"] for q in questions]),
              "held-out corpus": outside(net, held, ["held-out corpus"] * len(held))["all"]}
    oov_rows = [[key, f"{c[0] / c[3]:.3f}", f"{c[1] / max(c[0], 1):.2f}", f"{c[2] / max(c[0], 1):.2f}"]
                for key, c in counts.items()]
    summary["outside_vocabulary"] = dict(counts)
    cmd = "python eval/head_gap.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = "\n".join([f"# Where `{args.drafter}` loses on the dev answers", "", f"Machine: {machine()}", "",
                    f"Command: `{cmd}`", "", "Depth 1: the head's first choice against the target's greedy token.",
                    "", *tables, ("Answer tokens outside the head's draft vocabulary (rows: dev categories, "
                                  "all dev answers, held-out corpus answers):"), "",
                    markdown_table(["answers", "outside the vocabulary", "of them in the prompt",
                                    "of them earlier in the answer"], oov_rows)])
    write_results(args.out, dict(machine=machine(), command=cmd, **summary), md + "\n")
    print(md)


if __name__ == "__main__":
    main()
