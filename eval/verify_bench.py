"""Exact verifiers on real weights at equal tree budgets: τ, first-level acceptance against the
optimal multi-draft bound, and speed over plain ``generate`` (issue 18).

    python eval/verify_bench.py --drafter assets/text_drafters/smollm2/fastdraft --per-category 1 \\
        --max-new-tokens 64 --temperatures 0.6 1.0 --budgets 8 16 32 --out eval/results/verify_bench_smollm2

Target SmolLM2-135M-Instruct (PyPI GGUF, fp32), dev Spec-Bench questions, sampling (top_k 0, top_p 1).
For a budget of N drafted tokens, k = 2 branches when N = 8 and 4 above, each d = N // k deep:

  chain (N deep)               token-level ("chain"), block, traversal
  k i.i.d. chains (k x d)      multi-round ("tree"), SpecTr
  k chains w/o replacement     RSD-C (Gumbel-Top-k at the root, chains below): RSD, traversal
  beam of k (k x d)            RSD-S (stochastic beam search): RSD

Every drafter drafts exactly N tokens a step (adaptive length off), so the rows differ only in
the rule and the sampling of the draft. Per question, plain ``generate``, plain_onednn (the same
with every linear layer on oneDNN, as flashmm routes its own forwards on CPU) and every row run
interleaved (rotated order), each with its own seeded generator. Speed: the median over questions
of tokens/s over each baseline's, ×plain (oneDNN routing and speculation together) and
×plain_onednn (speculation alone), wall and CPU time.

"first-level acceptance" = P(some drafted token at depth 1 is accepted), per verification step.
"bound" = the optimal acceptance of k i.i.d. drafts (flashmm.verify.bound.acceptance_bound, Hu et
al. 2025), k = the row's root branching (1 for chains: 1 - TV), averaged over the positions of plain
``generate``'s own sampled answers, p = the target's and q = the draft's warped next-token
distributions there. For the rows whose root children are drawn without replacement the i.i.d.
bound is a reference, not their bound (the without-replacement bound needs ≤ 16-token supports).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (BASELINES, baseline_legend, machine, markdown_table, median, on_onednn,  # noqa: E402
                    onednn_baseline_missing, timed_with_cpu, write_results)
from text_speed import DEFAULT_QUESTIONS, load_questions, prompt_ids  # noqa: E402

import flashmm  # noqa: E402
from flashmm.drafters import load as load_drafter  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402
from flashmm.verify.bound import acceptance_bound  # noqa: E402

# (row label, drafting options given (k, d, N), verifier, root branching given k)
ROWS = [
    ("chain: token-level", lambda k, d, n: dict(drafting="sibling", tree_width=1), "chain", lambda k: 1),
    ("chain: block", lambda k, d, n: dict(drafting="sibling", tree_width=1), "block", lambda k: 1),
    ("chain: traversal", lambda k, d, n: dict(drafting="sibling", tree_width=1), "traversal", lambda k: 1),
    ("k i.i.d. chains: multi-round", lambda k, d, n: dict(drafting="chains", num_chains=k), "tree", lambda k: k),
    ("k i.i.d. chains: SpecTr", lambda k, d, n: dict(drafting="chains", num_chains=k), "spectr", lambda k: k),
    ("RSD-C: RSD", lambda k, d, n: dict(drafting="rsd_c", branching=(k,) + (1,) * (d - 1)), "rsd", lambda k: k),
    ("RSD-C: traversal", lambda k, d, n: dict(drafting="rsd_c", branching=(k,) + (1,) * (d - 1)), "traversal",
     lambda k: k),
    ("RSD-S: RSD", lambda k, d, n: dict(drafting="rsd_s", beam_width=k), "rsd", lambda k: k),
]


def shape(budget: int) -> tuple[int, int]:
    k = 2 if budget <= 8 else 4
    return k, budget // k


def sampling_of(temperature: float) -> dict:
    return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)


def make_rows(model, drafter_dir: str, budgets, temperatures) -> dict:
    """{(label, budget, temperature): (wrapped model, root branching)}."""
    out = {}
    for budget in budgets:
        k, d = shape(budget)
        for label, drafting, verifier, root in ROWS:
            drafter = load_drafter(drafter_dir, adaptive=False, max_draft_tokens=budget, **drafting(k, d, budget))
            wrapped = flashmm.wrap(model, drafter, verifier=verifier, max_draft_tokens=budget)
            for temperature in temperatures:
                out[(label, budget, temperature)] = (wrapped, root(k))
    return out


@torch.no_grad()
def bound_terms(model, draft_lm, ids: torch.Tensor, prompt_len: int, temperature: float, ks) -> dict:
    """{str(k): sum over the answer's positions of the optimal k-i.i.d.-draft acceptance} (string keys,
    as they read back from OUT.json for --resume), and the count."""
    p = torch.softmax(model(ids).logits[0, prompt_len - 1:-1].double() / temperature, -1)
    q = torch.softmax(draft_lm(ids).logits[0, prompt_len - 1:-1].double() / temperature, -1)
    return {"positions": p.shape[0], **{str(k): float(acceptance_bound(p, q, k).sum()) for k in ks}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="assets/text_drafters/smollm2/fastdraft",
                    help="a trained DraftModel folder (its drafting supports every scheme)")
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--categories", nargs="+", default=None, help="only these Spec-Bench categories")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="eval/results/verify_bench_smollm2")
    ap.add_argument("--resume", action="store_true", help="keep the questions already in OUT.json, run the rest")
    args = ap.parse_args(argv)

    model, tokenizer = load_gguf_lm("smollm2")
    rows = make_rows(model, args.drafter, args.budgets, args.temperatures)
    draft_lm = next(iter(rows.values()))[0].drafter.model
    ks = sorted({root for _, root in rows.values()})
    questions = load_questions(args.questions, args.per_category, args.categories)
    warm = tokenizer("Hello", return_tensors="pt").input_ids
    for wrapped, _ in list(rows.values())[:: len(args.temperatures)]:
        wrapped.generate(warm, max_new_tokens=4, **sampling_of(1.0))
    missing = onednn_baseline_missing(model)
    baselines = ["plain"] + (["plain_onednn"] if missing is None else [])
    done = Path(f"{args.out}.json")
    records = json.loads(done.read_text())["records"] if args.resume and done.exists() else []
    for qi, q in enumerate(tqdm(questions, desc="questions")):
        if any(r["id"] == q["question_id"] for r in records):
            continue  # seeds follow the question's index, so a resumed run draws what a whole one would
        ids = prompt_ids(tokenizer, q["turns"][0])
        rec = {"id": q["question_id"], "category": q["category"]}
        for temperature in args.temperatures:
            names = baselines + [key for key in rows if key[2] == temperature]
            order = names[qi % len(names):] + names[: qi % len(names)]
            for name in order:
                seed = args.seed * 1000 + qi
                if name in BASELINES:
                    torch.manual_seed(seed)  # plain generate samples from torch's global generator
                    fn = lambda: model.generate(ids, max_new_tokens=args.max_new_tokens,  # noqa: E731
                                                **sampling_of(temperature))
                    fn = on_onednn(model, fn) if name == "plain_onednn" else fn
                else:
                    wrapped = rows[name][0]
                    fn = lambda: wrapped.generate(  # noqa: E731
                        ids, max_new_tokens=args.max_new_tokens, generator=torch.Generator().manual_seed(seed),
                        **sampling_of(temperature))
                out, seconds, cpu = timed_with_cpu(fn)
                entry = {"seconds": seconds, "cpu_seconds": cpu, "new_tokens": out.shape[1] - ids.shape[1]}
                if name == "plain":
                    entry["bound"] = bound_terms(model, draft_lm, out, ids.shape[1], temperature, ks)
                if name in BASELINES:
                    rec[f"{name}@{temperature}"] = entry
                else:
                    st = wrapped.last_stats
                    entry.update(verify_steps=st.verify_steps, accepted=st.accepted_tokens,
                                 first_drafted=st.drafted_at_depth[1], first_accepted=st.accepted_at_depth[1])
                    rec["|".join(map(str, name))] = entry
        records.append(rec)
        report(args, argv, records, rows, len(questions), missing)
    if records:
        print(report(args, argv, records, rows, len(questions), missing))


def summarize(records, rows) -> dict:
    """Per (label, budget, temperature): tau, first-level acceptance, bound, and the medians over
    questions of tokens/s over plain's (speedup, cpu_speedup) and over plain_onednn's
    (over_plain_onednn, cpu_over_plain_onednn: None where no question timed plain_onednn)."""
    def median_over(done, key, base, clock):
        timed = [r for r in done if base in r]
        return median([(r[key]["new_tokens"] / r[key][clock]) / (r[base]["new_tokens"] / r[base][clock])
                       for r in timed]) if timed else None

    table = {}
    for (label, budget, temperature), (_, root) in rows.items():
        key, plain = "|".join(map(str, (label, budget, temperature))), f"plain@{temperature}"
        onednn = f"plain_onednn@{temperature}"
        done = [r for r in records if key in r]
        steps = sum(r[key]["verify_steps"] for r in done)
        positions = sum(r[plain]["bound"]["positions"] for r in done)
        table[key] = dict(
            label=label, budget=budget, temperature=temperature, questions=len(done),
            tau=(steps + sum(r[key]["accepted"] for r in done)) / max(1, steps),
            first_level=sum(r[key]["first_accepted"] for r in done) / max(1, sum(r[key]["first_drafted"] for r in done)),
            bound=sum(r[plain]["bound"][str(root)] for r in done) / max(1, positions), root_branching=root,
            speedup=median_over(done, key, plain, "seconds"),
            cpu_speedup=median_over(done, key, plain, "cpu_seconds"),
            over_plain_onednn=median_over(done, key, onednn, "seconds"),
            cpu_over_plain_onednn=median_over(done, key, onednn, "cpu_seconds"))
    return table


def speed_cell(c: dict) -> str:
    """"A× / B× (CPU C× / D×)": ×plain / ×plain_onednn, wall then CPU time ("-" where not measured)."""
    def fmt(x):
        return "-" if x is None else f"{x:.2f}×"
    return (f"{fmt(c['speedup'])} / {fmt(c['over_plain_onednn'])} "
            f"(CPU {fmt(c['cpu_speedup'])} / {fmt(c['cpu_over_plain_onednn'])})")


def report(args, argv, records, rows, planned, missing=None) -> str:
    """Write the tables and records so far and return the markdown; missing: why plain_onednn was not
    timed (None: it was)."""
    table = summarize(records, rows)
    labels = [label for label, *_ in ROWS]
    header = ["rule"] + [f"T={t} N={n}" for t in args.temperatures for n in args.budgets]

    def grid(fmt):
        return [[label] + [fmt(table["|".join(map(str, (label, n, t)))]) for t in args.temperatures
                           for n in args.budgets] for label in labels]

    cmd = "python eval/verify_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [f"# Exact verifiers on SmolLM2-135M-Instruct at equal budgets ({len(records)}/{planned} dev questions, "
          f"{args.max_new_tokens} new tokens, sampling)", "",
          f"Machine: {machine()}", "", f"Command: `{cmd}`", "",
          f"Drafter: `{args.drafter}` (drafts exactly N tokens a step; shapes in the script's docstring). "
          "τ = tokens per verification forward.", "",
          "## τ", "", markdown_table(header, grid(lambda c: f"{c['tau']:.3f}")), "",
          "## First-level acceptance (optimal bound for the root's k drafts)", "",
          markdown_table(header, grid(lambda c: f"{c['first_level']:.3f} ({c['bound']:.3f})")), "",
          "## Speed: ×plain / ×plain_onednn (CPU time: ×plain / ×plain_onednn)", "",
          baseline_legend(missing) + " Each cell: the median over questions of the per-question ratio, both "
          "baselines sampled at the same temperature in the same run; CPU = the same on CPU seconds.", "",
          markdown_table(header, grid(speed_cell))]
    payload = dict(machine=machine(), command=cmd, drafter=args.drafter, table=table, records=records)
    write_results(args.out, payload, "\n".join(md) + "\n")
    plot(args, table)
    return "\n".join(md) + "\n"


def plot(args, table) -> None:
    import matplotlib  # noqa: PLC0415 (eval extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(args.temperatures), figsize=(5.5 * len(args.temperatures), 4), squeeze=False)
    for ax, t in zip(axes[0], args.temperatures):
        for label, *_ in ROWS:
            ax.plot(args.budgets, [table["|".join(map(str, (label, n, t)))]["tau"] for n in args.budgets],
                    marker="o", label=label)
        ax.set(title=f"T = {t}", xlabel="drafted tokens per step (budget)", ylabel="τ", xscale="log")
        ax.set_xticks(args.budgets, [str(n) for n in args.budgets])
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{args.out}_tau.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
