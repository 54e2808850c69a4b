"""Batched text speed: the model's own batched ``generate`` vs flashmm on the same batches.

    python eval/batch_speed.py --batch-sizes 1 4 8 16 --batches 2 --max-new-tokens 128 \
        --out eval/results/batch_speed_smollm2

Dev Spec-Bench questions (first turn, chat template), left-padded into batches of each size.
Per batch the methods run back to back in a rotating order: plain batched ``generate``,
plain_onednn (the same with oneDNN linear layers, flashmm.targets.onednn), flashmm with each drafter
verifying all rows together, and flashmm decoding the rows one after another
(``batching="rows"``). Reported per batch size: total tokens/s (every method is credited with
plain's token count: rows up to their EOS), ×plain and ×plain_onednn (over each baseline's
tokens/s: oneDNN routing and speculation together / speculation alone), τ, and the share of rows
identical to plain's output.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (baseline_legend, machine, markdown_table, on_onednn, onednn_baseline_missing,  # noqa: E402
                    speedup_lines, summarize_batches, timed_with_cpu, write_results)
from text_speed import DEFAULT_QUESTIONS, load_questions  # noqa: E402

import flashmm  # noqa: E402
from flashmm.tree.cost import batch_bucket  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402


def batches_of(tokenizer, questions: list[dict], size: int, count: int) -> list[dict]:
    """``count`` left-padded batches of ``size`` questions each (questions taken in turn)."""
    out = []
    for k in range(count):
        picked = [questions[(k * size + i) % len(questions)] for i in range(size)]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                               add_generation_prompt=True) for q in picked]
        enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
        out.append({"ids": enc.input_ids, "mask": enc.attention_mask, "categories": [q["category"] for q in picked]})
    return out


def new_token_count(out: torch.Tensor, prompt_len: int, eos: set[int]) -> int:
    """Tokens the rows generated, each up to and including its first EOS."""
    total = 0
    for row in out[:, prompt_len:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        total += ends[0] + 1 if ends else len(row)
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--drafters", nargs="+", default=["prompt_lookup"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--batches", type=int, default=2, help="batches per size")
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="eval/results/batch_speed")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_gguf_lm(args.model)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    questions = load_questions(args.questions, None)

    def plain(ids, mask):
        return model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False)

    methods, wrapped = {"plain": plain}, {}
    missing = onednn_baseline_missing(model)
    if missing is None:
        methods["plain_onednn"] = on_onednn(model, plain, greedy=True)
    for name in args.drafters:
        for mode in ("auto", "rows"):
            sm = flashmm.wrap(model, name, batching=mode)
            key = f"flashmm:{name}" + (":rows" if mode == "rows" else "")
            methods[key] = (lambda sm: lambda ids, mask: sm.generate(
                ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False))(sm)
            wrapped[key] = sm
    names = list(methods)
    warm = batches_of(tokenizer, questions, 2, 1)[0]
    for fn in methods.values():
        fn(warm["ids"][:, -8:], warm["mask"][:, -8:])
    # the per-row verify costs batched drafts are priced by: measured (once, cached on disk) before
    # the clock runs, for every batch size a batch passes through as its rows finish
    for sm in wrapped.values():
        for rows in range(1, max(args.batch_sizes) + 1):
            sm.target.verify_cost(batch=batch_bucket(rows))

    records = []
    for size in args.batch_sizes:
        for bi, batch in enumerate(batches_of(tokenizer, questions, size, args.batches)):
            order = names[bi % len(names):] + names[: bi % len(names)]
            rec, outs = {"batch_size": size, "prompt_len": batch["ids"].shape[1]}, {}
            for name in order:
                out, seconds, cpu = timed_with_cpu(lambda: methods[name](batch["ids"], batch["mask"]))
                outs[name] = out
                rec[name] = {"seconds": seconds, "cpu_seconds": cpu}
                if name in wrapped:
                    st = wrapped[name].last_stats
                    rec[name].update(verify_steps=st.verify_steps, accepted=st.accepted_tokens)
            rec["tokens"] = new_token_count(outs["plain"], batch["ids"].shape[1], eos)
            for name in names:
                same = [bool(torch.equal(a, b)) for a, b in zip(outs[name], outs["plain"])]
                rec[name]["exact_rows"], rec[name]["rows"] = sum(same), len(same)
            records.append(rec)
            print(size, {n: round(rec["tokens"] / rec[n]["seconds"], 1) for n in names}, flush=True)

    summary = summarize_batches(records, names, args.batch_sizes)
    header = ["batch", "plain tok/s"] + [h for n in names[1:] for h in (f"{n} ×plain", f"{n} ×plain_onednn",
                                                                       f"{n} τ", f"{n} exact")]
    rows = []
    for size, s in summary.items():
        row = [size, s["plain"]["tok_per_s"]]
        for name in names[1:]:
            row += [s[name]["speedup"], s[name]["over_plain_onednn"], s[name].get("tau", "-"),
                    f"{s[name]['exact_rate']:.0%}"]
        rows.append(row)
    batched = [n for n in names if n.startswith("flashmm:") and not n.endswith(":rows")]
    extra = [[size] + [s[n]["tok_per_s"] / s[n + ":rows"]["tok_per_s"] for n in batched]
             for size, s in summary.items()]
    info = machine()
    md = (f"# Batched text speed: {args.model}, greedy, {args.max_new_tokens} new tokens\n\n"
          f"Machine: {info}\n\nCommand: `python eval/batch_speed.py {' '.join(argv or sys.argv[1:])}`\n\n"
          + baseline_legend(missing) + "\n\n"
          "×plain, ×plain_onednn = total tokens/s of the method / that of the baseline's batched `generate` on "
          "the same batches, interleaved (wall clock); τ = tokens per row per verification forward; exact = rows "
          "identical to plain's.\n\n" + markdown_table(header, rows) + "\n\nBatched over row-by-row "
          "(flashmm verifying all rows together / flashmm decoding them one after another):\n\n"
          + markdown_table(["batch"] + batched, extra) + "\n")
    print(md)
    for size, s in summary.items():
        print(speedup_lines(s, names, f"batch {size}, "))
    write_results(args.out, {"machine": info, "args": vars(args), "summary": summary, "records": records}, md)


if __name__ == "__main__":
    main()
