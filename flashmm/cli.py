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

``generate`` (flashmm.cli_generate) answers one text prompt with any causal LM (or a
vision-language model without media), streaming the answer to stdout as tokens commit and the
stats to stderr.

Decoding settings left out (--do-sample, --temperature, --top-k, --top-p) come from the
model's generation_config, as with ``model.generate``. A randomly initialised drafter (the name
``flash``, a FLASH directory that records no training) is refused unless --allow-untrained.

Exit status: 0 when every item was captioned (or already done), 1 when any item failed
(its line carries "error"), 2 for usage / setup errors (bad options, model or drafter that
cannot be loaded, no inputs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .config import VERIFIERS
from .pipelines import DEFAULT_PROMPTS, IMAGE_SUFFIXES, VIDEO_SUFFIXES, expand_paths, media_kind

EXIT_OK, EXIT_ITEM_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_FRAMES = 8  # CaptionPipeline's default when neither --num-frames nor --fps is given
KEY_FIELDS = ("path", "prompt", "model", "drafter", "settings")


def add_decoding_options(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """Options shared by ``caption`` and ``generate``: model, drafter, decoding, speculation, device."""
    parser.add_argument("--model", required=True, metavar="DIR", help="model directory (save_pretrained)")
    parser.add_argument("--drafter", required=True, metavar="DIR|NAME",
                        help="FlashDrafter directory (flash_config.json), a drafter name (prompt_lookup, flash), "
                             "or 'none' for the model's own generate")
    parser.add_argument("--allow-untrained", action="store_true",
                        help="accept a randomly initialised drafter (the name 'flash', a FLASH directory that "
                             "records no training)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                        help=f"new tokens at most ({max_new_tokens})")
    parser.add_argument("--do-sample", action=argparse.BooleanOptionalAction,
                        help="sample (--do-sample) or decode greedily (--no-do-sample); default: the model's "
                             "generation_config")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: generation_config)")
    parser.add_argument("--top-k", type=int, help="sampling top-k (default: generation_config)")
    parser.add_argument("--top-p", type=float, help="sampling top-p (default: generation_config)")
    parser.add_argument("--seed", type=int, help="seed of the sampling generator")
    parser.add_argument("--max-draft-tokens", type=int, metavar="N",
                        help="drafted tokens per step at most (SpecConfig default)")
    parser.add_argument("--verifier", choices=VERIFIERS, help="verification rule (auto); typical_lossy is NOT lossless")
    parser.add_argument("--attention", default="auto", choices=("auto", "triton", "torch"),
                        help="tree attention: auto = Triton on CUDA, PyTorch elsewhere")
    parser.add_argument("--linear", default="auto", choices=("auto", "onednn", "torch"),
                        help="tree forwards' linear layers: auto = oneDNN for fp32 on x86-64 CPUs, "
                             "the model's own elsewhere")
    parser.add_argument("--device", help="e.g. cuda, cpu (default: where the model loads)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="model dtype (as saved)")


def build_parser() -> argparse.ArgumentParser:
    from .cli_generate import add_generate_command

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
                     help="JSONL file to append to (default: stdout); reruns skip items done with the same settings")
    cap.add_argument("--prompt", help="instruction (default: 'Describe the image.' / 'Describe the video.')")
    frames = cap.add_mutually_exclusive_group()
    frames.add_argument("--num-frames", type=int, metavar="N",
                        help=f"frames sampled evenly from each video (default {DEFAULT_FRAMES})")
    frames.add_argument("--fps", type=float, metavar="F", help="sample video frames at this rate instead")
    cap.add_argument("--batch-size", type=int, default=1, metavar="N",
                     help="items loaded and preprocessed together (1); decoding is one sequence at a time")
    add_decoding_options(cap, max_new_tokens=128)
    cap.add_argument("--no-progress", action="store_true", help="no progress bar")
    cap.set_defaults(run=run_caption)
    add_generate_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashmm`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return args.run(args)


def check_decoding_options(args) -> str | None:
    """The first invalid shared option as an error message, or None."""
    if args.max_new_tokens < 0:
        return "--max-new-tokens must be >= 0"
    if args.max_draft_tokens is not None and args.max_draft_tokens < 0:
        return "--max-draft-tokens must be >= 0"
    if args.temperature is not None and not args.temperature > 0:
        return "--temperature must be > 0"
    if args.top_k is not None and args.top_k < 0:
        return "--top-k must be >= 0"
    if args.top_p is not None and not 0 < args.top_p <= 1:
        return "--top-p must be in (0, 1]"
    return None


def generation_kwargs(args) -> dict:
    """The decoding options given on the command line, as ``generate`` keywords (options left out
    are left to the model's generation_config)."""
    given = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p)
    return {name: value for name, value in given.items() if value is not None}


def spec_kwargs(args) -> dict:
    return {k: v for k, v in (("max_draft_tokens", args.max_draft_tokens), ("verifier", args.verifier))
            if v is not None}


def torch_dtype(args):
    import torch

    return args.dtype if args.dtype in (None, "auto") else getattr(torch, args.dtype)


def drafter_arg(drafter: str) -> str | None:
    """--drafter as CaptionPipeline / resolve_drafter take it (None for 'none')."""
    return None if drafter.lower() == "none" else drafter


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


def key_of(record: dict) -> str:
    """A hashable resume key of a JSONL record (or of ``item_key``'s fields)."""
    return json.dumps([record.get(name) for name in KEY_FIELDS], sort_keys=True)


def read_done(out_path: str) -> set[str]:
    """Resume keys (``key_of``) captioned successfully in an existing JSONL file; the latest line
    of a key decides. Unparsable lines (e.g. a line cut by an interrupted write) and lines of
    older versions without the key fields are ignored."""
    done = set()
    if not os.path.isfile(out_path):
        return done
    with open(out_path, encoding="utf-8") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not (isinstance(record, dict) and all(name in record for name in KEY_FIELDS)):
                continue
            key = key_of(record)
            if record.get("error") is None and record.get("caption") is not None:
                done.add(key)
            else:
                done.discard(key)
    return done


def _open_for_append(out_path: str):
    """Open ``out_path`` for appending, first ending a line cut by an interrupted write."""
    folder = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(folder, exist_ok=True)
    needs_newline = False
    if os.path.isfile(out_path) and os.path.getsize(out_path) > 0:
        with open(out_path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            needs_newline = fh.read(1) != b"\n"
    fh = open(out_path, "a", encoding="utf-8")
    if needs_newline:
        fh.write("\n")
    return fh


def error(command: str, message: str) -> int:
    print(f"flashmm {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


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
    paths = expand_paths(args.paths)
    if not paths:
        return error("caption", f"no media files found in {args.paths}")
    done = read_done(args.out) if args.out else set()
    todo = [p for p in paths if key_of(item_key(p, args)) not in done]
    if len(todo) < len(paths):
        print(f"flashmm caption: skipping {len(paths) - len(todo)} path(s) already captioned in {args.out} "
              "with the same prompt, model, drafter and settings", file=sys.stderr)
    if not todo:
        return EXIT_OK
    try:
        pipe = _build_pipeline(args)
    except (OSError, ValueError, TypeError, ImportError) as err:
        return error("caption", f"cannot set up the model / drafter: {type(err).__name__}: {err}")
    return _caption_all(pipe, todo, args)


def _build_pipeline(args):
    from .pipelines import CaptionPipeline

    return CaptionPipeline(args.model, drafter=drafter_arg(args.drafter), device=args.device, dtype=torch_dtype(args),
                           attention=args.attention, linear=args.linear, allow_untrained=args.allow_untrained,
                           **spec_kwargs(args))


def _caption_all(pipe, todo: list[str], args) -> int:
    import torch
    from tqdm import tqdm

    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=pipe.model.device).manual_seed(args.seed)
    sink = _open_for_append(args.out) if args.out else sys.stdout
    failed = tokens = seconds = 0
    forwards = steps = emitted = 0
    progress = tqdm(total=len(todo), unit="item", file=sys.stderr, disable=args.no_progress, dynamic_ncols=True)
    try:
        results = pipe.stream(todo, prompt=args.prompt, batch_size=args.batch_size, num_frames=args.num_frames,
                              fps=args.fps, generator=generator, **generation_kwargs(args))
        for path, result in zip(todo, results):
            fields = result.to_dict()
            del fields["source"], fields["token_ids"]
            record = {**item_key(path, args), **fields}
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            sink.flush()
            progress.update(1)
            if not result.ok:
                failed += 1
                progress.write(f"flashmm caption: {path}: {result.error}", file=sys.stderr)
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
        if sink is not sys.stdout:
            sink.close()
    ok = len(todo) - failed
    summary = f"flashmm caption: {ok} captioned, {failed} failed"
    if seconds:
        summary += f"; {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tok/s)"
    if steps:
        summary += f"; tau {emitted / steps:.2f}, {forwards} target forwards"
    print(summary, file=sys.stderr)
    return EXIT_ITEM_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
