"""``python -m flashmm.train rest``: a REST datastore (flashmm.drafters.rest) of the target's own answers.

The datastore is every answer (the greedy one, then the sampled ones) of each corpus record, in
order, -1 between answers, and its suffix array: --out/NAME.safetensors (``Rest(datastore=...)``
or ``SuffixDecoding(datastore=...)`` reads it) and --out/NAME.json (what it holds and the command).
With --corpus the target is not loaded: the datastore needs no target forward, and --target only
names whose answers they are (checked against each corpus folder's build_info.json). With --data the
target first answers the prompts (the self-distillation corpus, cached under --out/corpus).
"""
from __future__ import annotations

import argparse

from .cli_common import TEXT_DATA, Command, command_line, log

PROCESSES = ("Multi-process: under accelerate launch or torchrun process 0 builds and writes the datastore (one pass, "
             "no optimizer steps; with --data process 0 also writes the target's answers) and the others exit.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="model directory, 'smollm2', 'gemma3' or module:function: the "
                   "model whose answers the datastore holds (loaded only with --data, to write them)")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--data", help=TEXT_DATA)
    given.add_argument("--corpus", nargs="+", help="one or more corpus folders the target already wrote, instead of "
                       "--data (flashmm.train.corpus's format: corpus.jsonl.xz + build_info.json naming its target), "
                       "joined in the order given; the target is not loaded")
    p.add_argument("--take", type=int, default=None, help="the first N corpus records only (of the corpora in order)")
    p.add_argument("--out", required=True, help="output directory: NAME.safetensors and NAME.json (and, with --data, "
                   "the corpus the target wrote)")
    p.add_argument("--name", default="datastore", help="file name of the datastore in --out, without suffix")
    p.add_argument("--compact", action="store_true", help="store the tokens alone, as int32 (a quarter of the size); "
                   "the suffix array is built on first load and cached")
    p.add_argument("--dtype", default="float32", help="--data: target dtype (float32, bfloat16, float16)")
    p.add_argument("--seed", type=int, default=0, help="--data: torch seed before the target answers")
    p.add_argument("--max-new-tokens", type=int, default=256, help="--data: longest answer the target writes per prompt")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.epilog = PROCESSES


def corpus_records(args) -> tuple[list, list[str]]:
    """(records, corpus folders): --corpus's folders read in order (each refused, naming it, when its
    build_info.json names another target), or the corpus the target writes for --data."""
    from pathlib import Path  # noqa: PLC0415

    from .cli_common import given_corpora, text_setup  # noqa: PLC0415

    if args.take is not None and args.take < 1:
        raise SystemExit(f"--take must be >= 1, got {args.take}")
    if args.data is not None:
        s = text_setup(args, "rest", {"take": args.take, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                                      "seed": args.seed})
        return s.records, [str(Path(args.out) / "corpus")]
    try:
        records = given_corpora(args.corpus, args.target)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"python -m flashmm.train rest: {err}") from None
    return records[:args.take], list(args.corpus)


def run(args, argv: list[str]) -> int:
    import json  # noqa: PLC0415
    import time  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from ..distributed import process_info  # noqa: PLC0415
    from ..drafters.rest import Rest  # noqa: PLC0415

    start = time.time()
    records, folders = corpus_records(args)
    if not process_info().is_main:  # one pass over the corpus: under a launch, process 0 builds and writes it
        return 0
    try:
        rest = Rest.from_records(records)
    except ValueError as err:
        raise SystemExit(f"python -m flashmm.train rest: {', '.join(folders)}: {err}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name}.safetensors"
    rest.save(path, compact=args.compact)
    info = {"what": f"REST datastore: token ids of every answer (greedy + sampled) of {len(records)} records of the "
                    f"self-distillation corpus, -1 between answers, and "
                    + ("no suffix array (compact: built on first load and cached)" if args.compact else
                       "their suffix array"),
            "corpus": folders if len(folders) > 1 else folders[0], "tokens": len(rest.datastore),
            "seconds": round(time.time() - start, 1), "target": args.target, "command": command_line(argv)}
    path.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")
    log(f"rest datastore ({len(rest.datastore)} tokens) written to {path}")
    return 0


COMMANDS = {"rest": Command("build a REST datastore of the target's answers (no training; --corpus needs no target "
                            "forward)", add_arguments, run)}
