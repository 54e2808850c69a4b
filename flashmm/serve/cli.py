"""The ``flashmm`` command line (also ``python -m flashmm``).

    flashmm caption PATH... --model DIR --drafter DIR|NAME|none [--out results.jsonl]
                   [--prompt TEXT] [--max-new-tokens N] [--num-frames N | --fps F] ...
    flashmm generate "PROMPT" --model DIR --drafter DIR|NAME|none [--raw] [--max-new-tokens N] ...

``caption`` captions images and videos (a directory PATH expands to the media files under it)
and writes one JSON object per line: to ``--out`` (appended and flushed as each item finishes,
so an interrupted run loses nothing) or to stdout. Progress goes to stderr. Resume: each line
records what decided its caption (path, prompt, model, drafter, settings); a rerun skips an item
only when a line with the same five fields captioned it successfully (the last such line
decides), so a rerun with another prompt, model, drafter or decoding setting captions again.
Every input is accounted for: a file that cannot be read, a video cut short and a directory that
cannot be listed each get an error line (and a rerun tries them again). One run at a time per
--out: a second run on the same --out (also ``caption-merge``) exits 2 naming the first one's pid
and the lock file ``--out`` + ``.lock`` (flashmm.serve.caption_results.OutputLock).

Many processes (``accelerate launch -m flashmm caption ...``, ``torchrun -m flashmm caption ...``, any
number of GPUs or machines): process r of n captions the items i with i % n == r (i: position
in the expanded input list) into its own shard file beside --out (``results.rank{r}-of{n}.jsonl``,
flashmm.serve.caption_results); when every process is done, process 0 appends the shards to --out in
input order and deletes them. A rerun after any process was killed skips what every shard
already holds; ``flashmm caption-merge --out FILE`` merges shards by hand (after a killed run,
or after copying shard files from machines without a shared file system). Under a launch on a
CUDA machine, --device cuda (or no --device) means each process's own GPU, cuda:LOCAL_RANK.

``generate`` (flashmm.serve.cli_generate) answers one text prompt with any causal LM (or a
vision-language model without media), streaming the answer to stdout as tokens commit and the
stats to stderr.

Decoding settings left out (--do-sample, --temperature, --top-k, --top-p) come from the
model's generation_config, as with ``model.generate``. A randomly initialised drafter (the name
``flash``, a FLASH directory that records no training) is refused unless --allow-untrained.

Exit status: 0 when every item was captioned (or already done), 1 when any item failed
(its line carries "error"), 2 for usage / setup errors (bad options, model or drafter that
cannot be loaded, no inputs, an --out that cannot be written or that another run is writing),
found before the model loads.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..distributed import ProcessGroup, ProcessInfo, local_device, process_info
from .caption_results import (INDEX_FIELD, KEY_FIELDS, MergeSummary, OutputLock, OutputLockedError,  # noqa: F401
                              check_writable, key_of, merge_shards, open_for_append, read_done, read_records,
                              shard_files, shard_path)
from .cli_export import add_export_command
from .cli_generate import add_generate_command
from .cli_options import (EXIT_ITEM_FAILED, EXIT_OK, EXIT_USAGE, add_decoding_options, check_decoding_options,
                          drafter_arg, error, generation_kwargs, spec_kwargs, torch_dtype)
from .pipelines import DEFAULT_PROMPTS, IMAGE_SUFFIXES, VIDEO_SUFFIXES, expand_paths, media_kind

DEFAULT_FRAMES = 8  # CaptionPipeline's default when neither --num-frames nor --fps is given


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashmm", description="Lossless speculative decoding for Hugging Face vision-language and text models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    cap = commands.add_parser(
        "caption", help="caption images and videos (JSONL out, resumable)",
        description="Caption images and videos with a vision-language model and a drafter. Results are JSON "
                    "lines (path, prompt, model, drafter, settings, kind, caption, new_tokens, seconds, stats, "
                    "error); a rerun skips the items whose (path, prompt, model, drafter, settings) already "
                    "have a caption. Exit status: 0 all captioned, 1 some item failed, 2 usage or setup error.",
        epilog=f"Images: {' '.join(IMAGE_SUFFIXES)}. Videos: {' '.join(VIDEO_SUFFIXES)}.")
    cap.add_argument("paths", nargs="+", metavar="PATH", help="media files or directories (searched recursively)")
    cap.add_argument("--out", metavar="FILE",
                     help="JSONL file to append to (default: stdout); reruns skip items done with the same settings. "
                          "Under accelerate launch / torchrun each process writes FILE's stem + .rank<r>-of<n>.jsonl, "
                          "merged into FILE at the end")
    cap.add_argument("--prompt", help="instruction (default: 'Describe the image.' / 'Describe the video.')")
    frames = cap.add_mutually_exclusive_group()
    frames.add_argument("--num-frames", type=int, metavar="N",
                        help=f"frames sampled evenly from each video (default {DEFAULT_FRAMES})")
    frames.add_argument("--fps", type=float, metavar="F", help="sample video frames at this rate instead")
    cap.add_argument("--batch-size", type=int, default=1, metavar="N",
                     help="items decoded together; with a drafter a finished item's place goes to the next one (continuous batching), without one each group of N is one batched generate (1)")
    add_decoding_options(cap, max_new_tokens=128)
    cap.add_argument("--no-progress", action="store_true", help="no progress bar")
    cap.set_defaults(run=run_caption)
    merge = commands.add_parser(
        "caption-merge", help="merge the per-process shard files of a multi-process caption run into --out",
        description="Append the results of the shard files beside --out (results.rank<r>-of<n>.jsonl, written by "
                    "'flashmm caption' under accelerate launch / torchrun) to --out in input order, one line per "
                    "resume key, then delete them. A multi-process run does this itself when every process "
                    "finishes; run it after a killed run, or after copying shard files from other machines.")
    merge.add_argument("--out", required=True, metavar="FILE", help="the --out of the caption run")
    merge.add_argument("--keep-shards", action="store_true", help="leave the shard files in place")
    merge.set_defaults(run=run_caption_merge)
    add_generate_command(commands)
    add_export_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashmm`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return args.run(args)


# ----------------------------------------------------------------------------------- caption
def _as_given(name: str) -> str:
    """A model / drafter argument as recorded: a local directory as its absolute path, a name as is."""
    return os.path.abspath(name) if os.path.isdir(name) else name


def item_key(path: str, args) -> dict:
    """The fields that decide an item's caption (KEY_FIELDS), as its JSONL line records them."""
    kind = media_kind(path)
    settings = {**dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p),
                "seed": args.seed, "verifier": args.verifier or "auto"}
    if kind == "video":
        settings.update({"fps": args.fps} if args.fps is not None else {"num_frames": args.num_frames or DEFAULT_FRAMES})
    drafter = "none" if drafter_arg(args.drafter) is None else _as_given(args.drafter)
    return dict(path=os.path.abspath(path), prompt=args.prompt or DEFAULT_PROMPTS.get(kind), model=_as_given(args.model),
                drafter=drafter, settings=settings)


def run_caption(args) -> int:
    for name in ("batch_size", "num_frames"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return error("caption", f"--{name.replace('_', '-')} must be >= 1")
    if args.fps is not None and not args.fps > 0:
        return error("caption", "--fps must be > 0")
    problem = check_decoding_options(args)
    if problem:
        return error("caption", problem)
    try:
        info = process_info()
    except ValueError as err:
        return error("caption", str(err))
    paths = expand_paths(args.paths)
    if not paths:
        return error("caption", f"no media files found in {args.paths}")
    if info.is_distributed:
        if not args.out:
            return error("caption", f"{info.world_size} processes need --out (each writes its own shard file "
                                    "beside it; they are merged at the end)")
        return caption_shard(args, paths, info)
    if not args.out:
        return _caption_todo(args, list(enumerate(paths)), None)
    try:  # before anything loads: a run that cannot write its results, or would write them twice, stops here
        lock = _lock_output(args.out)
    except (OutputLockedError, OSError) as err:
        return error("caption", _output_problem(err, args.out))
    with lock:
        if shard_files(args.out):  # left by a killed multi-process run: theirs first, in order
            report_merge(merge_shards(args.out), args.out)
        done = read_done(args.out)
        todo = [(i, p) for i, p in enumerate(paths) if key_of(item_key(p, args)) not in done]
        report_skipped(len(paths) - len(todo), args.out)
        return _caption_todo(args, todo, args.out)


def _lock_output(out_path: str) -> OutputLock:
    """The run's lock on --out, once --out is known to be writable (OSError / OutputLockedError)."""
    check_writable(out_path)
    return OutputLock(out_path)


def _output_problem(err: Exception, out_path: str) -> str:
    if isinstance(err, OutputLockedError):
        return str(err)
    return f"cannot write --out {out_path}: {type(err).__name__}: {err}"


def _caption_todo(args, todo: list[tuple[int, str]], out_path: str | None) -> int:
    """Load the model and caption ``todo`` into ``out_path`` (appended to; None: stdout)."""
    if not todo:
        return EXIT_OK
    try:
        pipe = _build_pipeline(args)
    except (OSError, ValueError, TypeError, ImportError) as err:
        return error("caption", f"cannot set up the model / drafter: {type(err).__name__}: {err}")
    if out_path is None:
        return _caption_all(pipe, todo, args, sys.stdout)
    with open_for_append(out_path) as sink:
        return _caption_all(pipe, todo, args, sink)


def caption_shard(args, paths: list[str], info: ProcessInfo) -> int:
    """One process of a multi-process launch: caption items i with i % world_size == rank into its
    shard file, wait for every process, and on process 0 merge the shards into --out. Every
    process returns the worst exit status of all."""
    try:
        group = ProcessGroup.start(info)
    except (RuntimeError, ValueError) as err:
        return error("caption", str(err))
    lock = None
    try:
        # process 0 locks --out for the whole launch (the other processes never write it); every
        # process checks its shard file; all stop before loading anything if one cannot go on
        problem, shard = None, shard_path(args.out, info.rank, info.world_size)
        try:
            if info.is_main:
                lock = _lock_output(args.out)
        except (OutputLockedError, OSError) as err:
            problem = _output_problem(err, args.out)
        try:
            check_writable(shard)
        except OSError as err:
            problem = problem or f"cannot write the shard file {shard}: {type(err).__name__}: {err}"
        if problem:
            print(f"{_label(info)}: error: {problem}", file=sys.stderr)
        if group.max(EXIT_USAGE if problem else EXIT_OK) == EXIT_USAGE:
            return EXIT_USAGE
        # every shard file counts (any process count): a rerun after a kill skips what any process did
        done = read_done(args.out, *shard_files(args.out))
        mine = [(i, p) for i, p in enumerate(paths) if i % info.world_size == info.rank]
        todo = [(i, p) for i, p in mine if key_of(item_key(p, args)) not in done]
        report_skipped(len(mine) - len(todo), args.out, info)
        status = EXIT_OK
        if todo:
            args.device = local_device(args.device, info)
            try:
                pipe = _build_pipeline(args)
            except (OSError, ValueError, TypeError, ImportError) as err:
                status = error("caption", f"cannot set up the model / drafter: {type(err).__name__}: {err}")
            else:
                with open_for_append(shard) as sink:
                    status = _caption_all(pipe, todo, args, sink, info)
        group.barrier()  # every shard file is complete
        if info.is_main:
            report_merge(merge_shards(args.out), args.out)
            report_missing(paths, args)
        return group.max(status)
    finally:
        if lock is not None:
            lock.release()
        group.close()


def run_caption_merge(args) -> int:
    if not shard_files(args.out):
        print(f"flashmm caption-merge: no shard files beside {args.out} (nothing to merge)", file=sys.stderr)
        return EXIT_OK
    try:  # a run still writing the shards would lose what it writes after the merge
        lock = _lock_output(args.out)
    except (OutputLockedError, OSError) as err:
        return error("caption-merge", _output_problem(err, args.out))
    with lock:
        report_merge(merge_shards(args.out, keep_shards=args.keep_shards), args.out, "flashmm caption-merge")
    return EXIT_OK


def report_skipped(skipped: int, out_path: str | None, info: ProcessInfo | None = None) -> None:
    if skipped:
        print(f"{_label(info)}: skipping {skipped} path(s) already captioned in {out_path} "
              "with the same prompt, model, drafter and settings", file=sys.stderr)


def report_merge(summary: MergeSummary, out_path: str, label: str = "flashmm caption") -> None:
    if summary.files:
        print(f"{label}: merged {len(summary.files)} shard file(s) into {out_path}: {summary.appended} line(s) "
              f"appended, {summary.already_done} already there", file=sys.stderr)


def report_missing(paths: list[str], args) -> None:
    """After the merge on process 0: items of this run without any line in --out."""
    have = {key_of(record) for record in read_records(args.out)}
    missing = [p for p in paths if key_of(item_key(p, args)) not in have]
    if missing:
        print(f"flashmm caption: {len(missing)} item(s) have no line in {args.out} (first: {missing[0]}); their "
              "shard files were written where this process cannot see them (other machines without a shared "
              "file system?). Copy every *.rank*-of*.jsonl beside it and run: flashmm caption-merge --out "
              f"{args.out}", file=sys.stderr)


def _label(info: ProcessInfo | None) -> str:
    if info is None or not info.is_distributed:
        return "flashmm caption"
    return f"flashmm caption [process {info.rank}/{info.world_size}]"


def _build_pipeline(args):
    from .pipelines import CaptionPipeline

    return CaptionPipeline(args.model, drafter=drafter_arg(args.drafter), device=args.device, dtype=torch_dtype(args),
                           attention=args.attention, linear=args.linear, cuda_graphs=args.cuda_graphs,
                           allow_untrained=args.allow_untrained, **spec_kwargs(args))


def _caption_all(pipe, todo: list[tuple[int, str]], args, sink, info: ProcessInfo | None = None) -> int:
    """Caption ``todo`` ((input index, path) pairs) and write one line per item to ``sink``,
    flushed as each item finishes; shard lines (``info`` of a multi-process launch) also carry
    the input index. Returns the exit status."""
    import torch
    from tqdm import tqdm

    sharded = info is not None and info.is_distributed
    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=pipe.model.device).manual_seed(args.seed)
    failed = tokens = seconds = 0
    forwards = steps = emitted = 0
    progress = tqdm(total=len(todo), unit="item", file=sys.stderr, dynamic_ncols=True,
                    disable=args.no_progress or (sharded and not info.is_main))
    paths = [path for _, path in todo]
    try:
        results = pipe.stream(paths, prompt=args.prompt, batch_size=args.batch_size, num_frames=args.num_frames,
                              fps=args.fps, generator=generator, **generation_kwargs(args))
        for (index, path), result in zip(todo, results):
            fields = result.to_dict()
            del fields["source"], fields["token_ids"]
            record = {**item_key(path, args), **fields}
            if sharded:
                record[INDEX_FIELD] = index
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            sink.flush()
            progress.update(1)
            if not result.ok:
                failed += 1
                progress.write(f"{_label(info)}: {path}: {result.error}", file=sys.stderr)
                continue
            stats = result.stats
            tokens, seconds = tokens + result.new_tokens, seconds + result.seconds
            steps += stats["verify_steps"]
            emitted += stats["accepted_tokens"] + stats["verify_steps"]
            forwards += stats["target_forwards"]
            progress.set_postfix(tok_s=f"{tokens / seconds:.1f}" if seconds else "-",
                                 tau=f"{emitted / steps:.2f}" if steps else "-", refresh=False)
    finally:
        progress.close()
    ok = len(todo) - failed
    summary = f"{_label(info)}: {ok} captioned, {failed} failed"
    if seconds:
        summary += f"; {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tok/s)"
    if steps:
        summary += f"; tau {emitted / steps:.2f}, {forwards} target forwards"
    print(summary, file=sys.stderr)
    return EXIT_ITEM_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
