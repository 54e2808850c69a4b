"""What every ``python -m flashmm.train <method>`` command shares: the target, the prompt file, the
self-distillation corpus under --out, the processes of a launch (flashmm.train.data_parallel), and the
drafter.json provenance.

A text method's --out folder holds, besides the drafter (drafter.json + weights):
  corpus/    the target's greedy answers to --data (flashmm.train.self_corpus; resumable)
  features/  the target's cached features over them (flashmm.train.corpus.features; resumable)
  work/      the training checkpoints and settings.json (a rerun with the same options resumes;
             with other options it is refused)
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Command:
    """One subcommand: ``add_arguments(parser)`` declares its options, ``run(args, argv)`` trains
    and returns the exit status; ``aliases`` are other names for it."""

    help: str
    add_arguments: Callable
    run: Callable
    aliases: tuple[str, ...] = ()


def load_target(spec: str, dtype: str = "float32"):
    """(model, processor or tokenizer) for a --target value: a Hugging Face model directory (a
    vision-language model when its config has a vision part, else a causal LM), "smollm2" or
    "gemma3" (the GGUF reference weights, flashmm.weights), or "package.module:function" naming a
    callable that returns (model, processor)."""
    import torch  # noqa: PLC0415

    torch_dtype = getattr(torch, dtype)
    if os.path.isdir(spec):
        from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,  # noqa: PLC0415
                                  AutoProcessor, AutoTokenizer)

        config = AutoConfig.from_pretrained(spec)
        if getattr(config, "vision_config", None) is not None:
            model = AutoModelForImageTextToText.from_pretrained(spec, dtype=torch_dtype)
            processor = AutoProcessor.from_pretrained(spec)
        else:
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype)
            processor = AutoTokenizer.from_pretrained(spec)
        return model.eval(), processor
    if spec in ("smollm2", "gemma3"):
        from ..weights import load_gguf_lm  # noqa: PLC0415

        return load_gguf_lm(spec)
    if ":" in spec:
        module_name, attr = spec.split(":", 1)
        factory = getattr(importlib.import_module(module_name), attr)
        model, processor = factory()
        return model.eval(), processor
    raise SystemExit(f"--target {spec!r}: not a directory, 'smollm2', 'gemma3' or 'module:function'")


def add_target_arguments(p: argparse.ArgumentParser, data_help: str) -> None:
    p.add_argument("--target", required=True, help="model directory, 'smollm2', 'gemma3' or module:function")
    p.add_argument("--data", required=True, help=data_help)
    p.add_argument("--out", required=True, help="output directory: the drafter, and its corpus, features and "
                   "checkpoints (a rerun with the same options resumes there)")
    p.add_argument("--dtype", default="float32", help="target dtype (float32, bfloat16, float16)")
    p.add_argument("--seed", type=int, default=0)


TEXT_DATA = ('JSONL of prompts: {"prompt": str}, {"turns": [str, ...]} (Spec-Bench: each turn asked after the '
             'target\'s answer to the last) or {"messages": [{"role", "content"}, ...]}')
PARALLEL = ("Multi-process: accelerate launch --multi_gpu --num_processes P -m flashmm.train METHOD ... (or "
            "torchrun; on a machine without CUDA the processes train on CPU over gloo) splits each step's units "
            "over the P processes (see --accumulate).")


def add_text_arguments(p: argparse.ArgumentParser, accumulate: bool = True) -> None:
    """--target / --data or --corpus / --out and the corpus options of every text method (and
    --accumulate, for the methods that take optimizer steps)."""
    p.add_argument("--target", required=True, help="model directory, 'smollm2', 'gemma3' or module:function")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--data", help=TEXT_DATA)
    given.add_argument("--corpus", nargs="+", metavar="DIR", help="one or more corpora the target already wrote, "
                       "instead of --data: folders in flashmm.train.corpus's format (corpus.jsonl.xz + "
                       "build_info.json naming its target, each checked against --target), such as an earlier run's "
                       "--out/corpus or this repository's assets/corpus/smollm2; several are joined in the order "
                       "given (sequence i of the joined list is what --take and --holdout-every count)")
    p.add_argument("--take", type=int, default=None, help="train on the first N corpus records only (of the --corpus "
                   "folders joined in order)")
    p.add_argument("--out", required=True, help="output directory: the drafter, and its corpus, features and "
                   "checkpoints (a rerun with the same options resumes there)")
    p.add_argument("--dtype", default="float32", help="target dtype (float32, bfloat16, float16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest answer the target writes per prompt")
    p.add_argument("--top-k", type=int, default=32, help="target logits cached per position")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    if not accumulate:
        return
    p.add_argument("--accumulate", type=int, default=1, help="units (examples / batches) per process per optimizer "
                   "step, their gradients summed. Under accelerate launch or torchrun with P processes a step "
                   "reads accumulate x P units, split over the processes (P processes with --accumulate A train "
                   "exactly as one process with --accumulate A*P); the processes answer --data's prompts and compute the "
                   "feature shards split between them, and process 0 writes --out")


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, flush=True)


def data_parallel(args):
    """The DataParallel of this process (flashmm.train.data_parallel): --accumulate over the processes
    of the launch (a gloo group, closed when the process exits), or this process alone."""
    import atexit  # noqa: PLC0415

    from ..distributed import ProcessGroup, process_info  # noqa: PLC0415
    from .data_parallel import DataParallel  # noqa: PLC0415

    accumulate = getattr(args, "accumulate", 1)  # rest and judge take no optimizer steps
    if accumulate < 1:
        raise SystemExit(f"--accumulate must be >= 1, got {accumulate}")
    info = process_info()
    if not info.is_distributed:
        return DataParallel(accumulate)
    group = ProcessGroup.start(info)
    atexit.register(group.close)
    return DataParallel(accumulate, group)


def command_line(argv: list[str]) -> str:
    """The exact command that rebuilds a drafter (drafter.json's "command")."""
    return "python -m flashmm.train " + shlex.join(argv)


def target_info(spec: str, model) -> dict:
    """drafter.json's "target": what the drafter was trained for."""
    text = model.config.get_text_config()
    return {"name": spec, "architectures": list(getattr(model.config, "architectures", None) or
                                                [type(model).__name__]),
            "vocab_size": int(text.vocab_size), "hidden_size": int(text.hidden_size),
            "num_hidden_layers": int(text.num_hidden_layers)}


@dataclass
class TextSetup:
    """A text method's inputs, ready to train: target, tokenizer, corpus records and folders."""

    model: object
    tokenizer: object
    records: list
    out: Path
    work: Path
    parallel: object    # flashmm.train.data_parallel.DataParallel

    @property
    def features_dir(self) -> Path:
        return self.out / "features"

    def features(self, **options):
        """The target's cached features over the corpus (flashmm.train.corpus.features with ``options``),
        their shards computed split over the processes of a launch."""
        from .corpus import features  # noqa: PLC0415

        return features(self.model, self.records, cache_dir=self.features_dir, log=log, parallel=self.parallel,
                        **options)

    def end_id(self) -> int | None:
        eos = self.model.generation_config.eos_token_id
        return eos[0] if isinstance(eos, list) else eos


def text_setup(args, method: str, settings: dict) -> TextSetup:
    """Check the inputs before anything heavy (one process, --data readable, --out's earlier options),
    load the target, and build or read the self-distillation corpus."""
    import torch  # noqa: PLC0415

    from .self_corpus import build_self_corpus, read_prompts  # noqa: PLC0415

    parallel = data_parallel(args)
    if args.take is not None and args.take < 1:
        raise SystemExit(f"--take must be >= 1, got {args.take}")
    try:
        conversations = None if args.data is None else read_prompts(args.data)
        records = None if args.corpus is None else given_corpora(args.corpus, args.target)
    except (FileNotFoundError, ValueError) as err:  # the messages name --data / --corpus, the file and the line
        raise SystemExit(f"python -m flashmm.train {method}: {err}") from None
    out = Path(args.out)
    work = out / "work" / method
    per_step = {"units_per_step": parallel.per_step} if parallel.per_step > 1 else {}  # what a resume must keep
    parallel.main_first(lambda: check_settings(work, {"method": method, **settings, **per_step}))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, processor = load_target(args.target, args.dtype)
    tokenizer = getattr(processor, "tokenizer", processor)
    if tokenizer is None:
        raise SystemExit(f"--target {args.target}: gives no tokenizer; a text method renders --data with it")
    if records is None:
        records = build_self_corpus(model, tokenizer, conversations, out / "corpus", max_new_tokens=args.max_new_tokens,
                                    target=args.target, log=log, parallel=parallel)
    return TextSetup(model, tokenizer, records[:args.take], out, work, parallel)


def given_corpora(folders: list, target: str) -> list:
    """The records of the --corpus folders joined in order (given_corpus refuses each, naming it)."""
    records = []
    for folder in folders:
        records += given_corpus(folder, target)
    return records


def given_corpus(folder, target: str) -> list:
    """The records of the --corpus folder, refused (naming it) when its build_info.json names another target
    than --target: its answers are another model's, not the target's own."""
    from .corpus import INFO_FILE, read_corpus, read_info  # noqa: PLC0415

    folder = Path(folder)
    if not (folder / INFO_FILE).is_file():
        raise FileNotFoundError(f"--corpus {str(folder)!r}: no {INFO_FILE} there (a corpus folder holds "
                                f"corpus.jsonl.xz and {INFO_FILE})")
    info = read_info(folder)
    settings = info.get("settings")
    built_for = info.get("target") or (settings.get("target") if isinstance(settings, dict) else None)
    if built_for is not None and built_for != target:
        raise ValueError(f"--corpus {folder}: its answers were written by {built_for!r} ({folder / INFO_FILE}), "
                         f"not by --target {target!r}")
    return read_corpus(folder)


def check_settings(work: Path, settings: dict) -> None:
    """Record ``settings`` in work/settings.json; refuse a rerun whose settings differ (its
    checkpoints belong to other options)."""
    path = work / "settings.json"
    if path.is_file():
        before = json.loads(path.read_text())
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        if changed:
            raise SystemExit(f"{work} holds a run with other options ({', '.join(changed)}); use another --out "
                             f"or delete {work}")
        return
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n")


def method_settings(args, skip: tuple[str, ...] = ()) -> dict:
    """The options that shape a run's training (what check_settings compares)."""
    ignored = {"target", "data", "out", "threads", "max_minutes", "method", "command", "no_progress", "accumulate",
               *skip}
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in ignored and not callable(v)}
    if isinstance(settings.get("corpus"), list) and len(settings["corpus"]) == 1:
        settings["corpus"] = settings["corpus"][0]  # one folder recorded as before: an earlier run's work/ resumes
    return settings


def add_holdout_arguments(p: argparse.ArgumentParser, every: int, measures: str) -> None:
    """--holdout-every / --holdout-offset: which corpus sequences a method keeps out of training
    (``measures``: what it measures on them). One rule for every method: sequence i is held out when
    ``i % every == offset``."""
    p.add_argument("--holdout-every", type=int, default=every,
                   help=f"hold out every N-th corpus sequence to measure {measures} (0: hold out none)")
    p.add_argument("--holdout-offset", type=int, default=None,
                   help="index of the first held-out sequence: sequences K, K+N, K+2N, ... are held out "
                        "(default N-1: the N-th, 2N-th, ...)")


def holdout_split(count: int, args, option: str = "--holdout") -> tuple[list[int], list[int]]:
    """(training indices, held-out indices) of ``count`` corpus sequences under --holdout-every /
    --holdout-offset (add_holdout_arguments; ``option``: the options' prefix, e.g. "--draft-holdout",
    read from args as draft_holdout_every / draft_holdout_offset and named so in errors)."""
    attribute = option.lstrip("-").replace("-", "_")
    every, offset = getattr(args, f"{attribute}_every"), getattr(args, f"{attribute}_offset")
    if every < 0:
        raise SystemExit(f"{option}-every must be >= 0, got {every}")
    if not every:
        if offset is not None:
            raise SystemExit(f"{option}-offset needs {option}-every N > 0")
        return list(range(count)), []
    offset = every - 1 if offset is None else offset
    if not 0 <= offset < every:
        raise SystemExit(f"{option}-offset {offset}: must be in 0..{every - 1} ({option}-every {every})")
    held = [i for i in range(count) if i % every == offset]
    return [i for i in range(count) if i % every != offset], held


VOCAB_FROM_HELP = ("reuse another drafter's drafting vocabulary: the target ids of the folder DIR (a FastDraft / "
                   "PARD / DFlash folder's draft_to_target, an EAGLE-3 folder's d2t, a Medusa / Hydra / MTP "
                   "folder's vocab or an EAGLE-1/2 folder's draft_vocab.safetensors), in its order; instead of --vocab")


def vocab_from(folder, vocab_size: int):
    """The drafting vocabulary (target ids, int64, in the folder's order) of the drafter folder
    ``folder`` (--vocab-from; VOCAB_FROM_HELP lists the layouts read), refused when an id is not one
    of the target's ``vocab_size``."""
    import torch  # noqa: PLC0415
    from safetensors import safe_open  # noqa: PLC0415

    folder = Path(folder)
    candidates = [(folder / "model.safetensors", ("draft_to_target", "vocab", "d2t")),
                  (folder / "draft_vocab.safetensors", ("ids",))]
    for path, keys in candidates:
        if not path.is_file():
            continue
        with safe_open(str(path), "pt") as f:
            for key in keys:
                if key in f.keys():
                    ids = f.get_tensor(key).long()
                    ids = torch.arange(ids.numel()) + ids if key == "d2t" else ids   # d2t: offsets (SGLang's)
                    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                        raise SystemExit(f"--vocab-from {str(folder)!r}: {key} in {path.name} holds ids outside the "
                                         f"target's {vocab_size}-token vocabulary (a drafter of another target?)")
                    return ids
    raise SystemExit(f"--vocab-from {str(folder)!r}: no drafting vocabulary there (looked for draft_to_target, vocab "
                     "or d2t in model.safetensors and ids in draft_vocab.safetensors)")
