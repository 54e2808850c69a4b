"""The ``flashmm`` command line.

    flashmm caption PATH... --model DIR --drafter DIR|NAME|none [--out results.jsonl]
                   [--prompt TEXT] [--max-new-tokens N] [--num-frames N | --fps F] ...

``caption`` captions images and videos (a directory PATH expands to the media files under it)
and writes one JSON object per line: to ``--out`` (appended and flushed as each item finishes,
so an interrupted run loses nothing; a rerun skips paths already captioned successfully in that
file and retries failed ones; the last line for a path is the current one) or to stdout.
Progress goes to stderr.

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
from .pipelines import DEFAULT_PROMPTS, IMAGE_SUFFIXES, VIDEO_SUFFIXES, expand_paths

EXIT_OK, EXIT_ITEM_FAILED, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashmm", description="Lossless speculative decoding for Hugging Face vision-language and text models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    cap = commands.add_parser(
        "caption", help="caption images and videos (JSONL out, resumable)",
        description="Caption images and videos with a vision-language model and a drafter. Results are JSON "
                    "lines (path, kind, caption, new_tokens, seconds, stats, error). Exit status: 0 all "
                    "captioned, 1 some item failed, 2 usage or setup error.",
        epilog=f"Images: {' '.join(IMAGE_SUFFIXES)}. Videos (decord): {' '.join(VIDEO_SUFFIXES)}.")
    cap.add_argument("paths", nargs="+", metavar="PATH", help="media files or directories (searched recursively)")
    cap.add_argument("--model", required=True, metavar="DIR", help="vision-language model directory (save_pretrained)")
    cap.add_argument("--drafter", required=True, metavar="DIR|NAME",
                     help="FlashDrafter directory (flash_config.json), a drafter name (prompt_lookup, flash), "
                          "or 'none' for the model's own generate")
    cap.add_argument("--out", metavar="FILE", help="JSONL file to append to (default: stdout); reruns skip done paths")
    cap.add_argument("--prompt", help="instruction (default: 'Describe the image.' / 'Describe the video.')")
    cap.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens per caption at most (128)")
    frames = cap.add_mutually_exclusive_group()
    frames.add_argument("--num-frames", type=int, metavar="N", help="frames sampled evenly from each video (default 8)")
    frames.add_argument("--fps", type=float, metavar="F", help="sample video frames at this rate instead")
    cap.add_argument("--batch-size", type=int, default=1, metavar="N",
                     help="items loaded and preprocessed together (1); decoding is one sequence at a time")
    cap.add_argument("--max-draft-tokens", type=int, metavar="N",
                     help="drafted tokens per step at most (SpecConfig default)")
    cap.add_argument("--verifier", choices=VERIFIERS,
                     help="verification rule (auto); typical_lossy is NOT lossless")
    cap.add_argument("--attention", default="auto", choices=("auto", "triton", "torch"),
                     help="tree attention: auto = Triton on CUDA, PyTorch elsewhere")
    cap.add_argument("--linear", default="auto", choices=("auto", "onednn", "torch"),
                     help="tree forwards' linear layers: auto = oneDNN for fp32 on x86-64 CPUs, "
                          "the model's own elsewhere")
    cap.add_argument("--device", help="e.g. cuda, cpu (default: where the model loads)")
    cap.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="model dtype (as saved)")
    cap.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    cap.add_argument("--temperature", type=float, default=1.0, help="with --do-sample (1.0)")
    cap.add_argument("--top-k", type=int, help="with --do-sample")
    cap.add_argument("--top-p", type=float, help="with --do-sample")
    cap.add_argument("--seed", type=int, help="seed of the sampling generator")
    cap.add_argument("--no-progress", action="store_true", help="no progress bar")
    cap.set_defaults(run=run_caption)
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
def read_done(out_path: str) -> set[str]:
    """Absolute paths captioned successfully in an existing JSONL file (unparsable lines, e.g. a
    line cut by an interrupted write, are ignored)."""
    done = set()
    if not os.path.isfile(out_path):
        return done
    with open(out_path, encoding="utf-8") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("path"), str):
                key = os.path.abspath(record["path"])
                if record.get("error") is None and record.get("caption") is not None:
                    done.add(key)
                else:
                    done.discard(key)  # the latest line for a path decides
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


def _error(message: str) -> int:
    print(f"flashmm caption: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run_caption(args) -> int:
    for name in ("max_new_tokens", "batch_size", "num_frames"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "max_new_tokens" else 1):
            return _error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'max_new_tokens' else '>= 1'}")
    if args.fps is not None and not args.fps > 0:
        return _error("--fps must be > 0")
    paths = expand_paths(args.paths)
    if not paths:
        return _error(f"no media files found in {args.paths}")
    done = read_done(args.out) if args.out else set()
    todo = [p for p in paths if os.path.abspath(p) not in done]
    if len(todo) < len(paths):
        print(f"flashmm caption: skipping {len(paths) - len(todo)} path(s) already captioned in {args.out}",
              file=sys.stderr)
    if not todo:
        return EXIT_OK
    try:
        pipe = _build_pipeline(args)
    except (OSError, ValueError, TypeError, ImportError) as err:
        return _error(f"cannot set up the model / drafter: {type(err).__name__}: {err}")
    return _caption_all(pipe, todo, args)


def _build_pipeline(args):
    import torch

    from .pipelines import CaptionPipeline

    spec = {k: v for k, v in (("max_draft_tokens", args.max_draft_tokens), ("verifier", args.verifier))
            if v is not None}
    drafter = None if args.drafter.lower() == "none" else args.drafter
    dtype = args.dtype if args.dtype in (None, "auto") else getattr(torch, args.dtype)
    return CaptionPipeline(args.model, drafter=drafter, device=args.device, dtype=dtype, attention=args.attention,
                           linear=args.linear, **spec)


def _caption_all(pipe, todo: list[str], args) -> int:
    import torch
    from tqdm import tqdm

    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=pipe.model.device).manual_seed(args.seed)
        torch.manual_seed(args.seed)  # plain decoding (--drafter none) samples from the global generator
    sink = _open_for_append(args.out) if args.out else sys.stdout
    failed = tokens = seconds = 0
    forwards = steps = emitted = 0
    progress = tqdm(total=len(todo), unit="item", file=sys.stderr, disable=args.no_progress, dynamic_ncols=True)
    try:
        results = pipe.stream(todo, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                              batch_size=args.batch_size, num_frames=args.num_frames, fps=args.fps,
                              do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, generator=generator)
        for path, result in zip(todo, results):
            fields = result.to_dict()
            del fields["source"], fields["token_ids"]
            prompt = args.prompt or DEFAULT_PROMPTS.get(result.kind)
            record = dict(path=os.path.abspath(path), **fields, prompt=prompt, model=args.model,
                          drafter=args.drafter)
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
