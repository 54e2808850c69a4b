"""Accepted tokens per verification of each exact verifier at equal tree budgets, on synthetic
bigram targets (no model): the papers' claims RSD >= i.i.d. multi-round, block >= token-level,
traversal >= top-down, checked on the rule alone, with the optimal multi-draft bound (k = the
root's branching) beside each tree's first-level acceptance.

    python eval/verify_acceptance.py --rows 200000 --out eval/results/verify_acceptance

Target P and draft Q are Dirichlet bigram tables over 32 tokens (Q = a mix of P and noise, so the
draft is informative but wrong), warped at temperature T; every row drafts from a random root.
Reported: mean accepted drafted tokens (bonus excluded) over ``rows`` rows per cell, averaged over
``tables`` random table pairs. This is not the real-weights benchmark of eval/verify_bench (not
written yet): it isolates the verification rule from drafting and forward costs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_results  # noqa: E402

from flashmm.tree.gumbel import gumbel_topk  # noqa: E402
from flashmm.tree.token_tree import TokenTree  # noqa: E402
from flashmm.verify import verify_block, verify_chain, verify_rsd, verify_spectr, verify_traversal, verify_tree  # noqa: E402
from flashmm.verify.bound import acceptance_bound  # noqa: E402

VOCAB = 32


def tables(seed: int, temperature: float, mix: float) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    target = rng.dirichlet([0.3] * VOCAB, size=VOCAB)
    draft = mix * target + (1 - mix) * rng.dirichlet([0.3] * VOCAB, size=VOCAB)

    def warp(t):
        logits = torch.from_numpy(np.log(t + 1e-12)) / temperature
        return logits.softmax(-1)
    return warp(target), warp(draft)


def draft(tree: TokenTree, roots: torch.Tensor, q: torch.Tensor, scheme: str, gen) -> torch.Tensor:
    """tokens [rows, N]: children i.i.d. ("iid") or without replacement ("wor") from Q[parent]."""
    tokens = roots[:, None].repeat(1, tree.num_nodes)
    for v, kids in enumerate(tree.children):
        if not kids:
            continue
        rows_q = q[tokens[:, v]]
        if scheme == "wor":
            tokens[:, kids] = gumbel_topk(rows_q, len(kids), gen)
        else:
            tokens[:, kids] = torch.multinomial(rows_q, len(kids), replacement=True, generator=gen)
    return tokens


def k_chains(k: int, length: int) -> TokenTree:
    return TokenTree.from_choices([[j] + [0] * d for j in range(k) for d in range(length)])


def shapes(budget: int) -> dict[str, TokenTree]:
    """Trees of exactly ``budget`` drafted nodes: a chain, k chains, and a wide-then-narrow tree."""
    width = 2 if budget <= 8 else 4
    choices, level, frontier = [], 0, [[]]
    while len(choices) < budget:                 # BFS fill: `width` children at depth 0, 2 below
        nxt = []
        for path in frontier:
            for r in range(width if level == 0 else 2):
                if len(choices) < budget:
                    choices.append(path + [r])
                    nxt.append(path + [r])
        frontier, level = nxt, level + 1
    return {"chain": TokenTree.chain(budget), "chains": k_chains(width, budget // width),
            "tree": TokenTree.from_choices(choices)}


# (row label, tree kind, drafting, verifier)
RULES = [
    ("chain: token-level", "chain", "iid", verify_chain),
    ("chain: block", "chain", "iid", verify_block),
    ("chain: traversal", "chain", "iid", verify_traversal),
    ("k i.i.d. chains: multi-round", "chains", "iid", verify_tree),
    ("k i.i.d. chains: SpecTr", "chains", "iid", verify_spectr),
    ("tree i.i.d.: multi-round", "tree", "iid", verify_tree),
    ("tree i.i.d.: traversal", "tree", "iid", lambda *a: verify_traversal(*a, siblings="iid")),
    ("tree w/o repl.: RSD", "tree", "wor", verify_rsd),
    ("tree w/o repl.: traversal", "tree", "wor", verify_traversal),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--mix", type=float, default=0.6, help="draft = mix * target + (1 - mix) * noise")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results, first_level = {}, {}
    for temperature in args.temperatures:
        for budget in args.budgets:
            trees = shapes(budget)
            for label, kind, scheme, verify in RULES:
                accepted, first = [], []
                for seed in range(args.tables):
                    p_table, q_table = tables(seed, temperature, args.mix)
                    gen = torch.Generator().manual_seed(seed)
                    roots = torch.randint(VOCAB, (args.rows,), generator=gen)
                    tokens = draft(trees[kind], roots, q_table, scheme, gen)
                    result = verify(tokens, trees[kind], p_table[tokens], q_table[tokens], gen)
                    accepted.append(float(result.accepted_len.float().mean()))
                    first.append(float((result.accepted_len >= 1).float().mean()))
                results[(temperature, budget, label)] = float(np.mean(accepted))
                first_level[(temperature, budget, label)] = float(np.mean(first))
            k = len(trees["tree"].children[0])
            # the optimal first-level acceptance of k i.i.d. drafts, averaged over the (uniform) roots
            first_level[(temperature, budget, f"optimal bound, k={k} i.i.d. drafts")] = float(np.mean(
                [float(acceptance_bound(*tables(seed, temperature, args.mix), k, "iid").mean())
                 for seed in range(args.tables)]))
    header = ["rule"] + [f"T={t} N={b}" for t in args.temperatures for b in args.budgets]
    cells = [(t, b) for t in args.temperatures for b in args.budgets]
    labels = [label for label, *_ in RULES]
    table = markdown_table(header, [[label] + [results[(t, b, label)] for t, b in cells] for label in labels])
    bound_labels = labels + sorted({key[2] for key in first_level if key[2].startswith("optimal")})
    first_table = markdown_table(header, [[label] + [first_level.get((t, b, label), float("nan")) for t, b in cells]
                                          for label in bound_labels])
    print(table, "\n\nP(at least one drafted token accepted):\n", first_table, sep="")
    if args.out:
        payload = {"rows": args.rows, "tables": args.tables, "mix": args.mix, "vocab": VOCAB,
                   "mean_accepted": [{"temperature": t, "budget": b, "rule": r, "value": v}
                                     for (t, b, r), v in results.items()],
                   "first_level_acceptance": [{"temperature": t, "budget": b, "rule": r, "value": v}
                                              for (t, b, r), v in first_level.items()]}
        write_results(args.out, payload, "Mean accepted drafted tokens per verification (synthetic bigram "
                      f"tables, V={VOCAB}, draft = {args.mix} target + noise, {args.rows} rows x {args.tables} "
                      f"tables per cell; command: python eval/verify_acceptance.py --rows {args.rows})\n\n"
                      + table + "\n\nP(at least one drafted token accepted), with the optimal acceptance of "
                      "k i.i.d. drafts (k = the root branching of the tree and chains rows at that budget: 2 at "
                      "N = 8, 4 above; it bounds their first level):\n\n" + first_table + "\n")


if __name__ == "__main__":
    main()
