"""What the ``flashmm`` subcommands share: exit statuses, the decoding options of ``caption`` and
``generate`` (model, drafter, decoding, speculation, device) and how they become ``generate`` and
``wrap`` keywords, and the one-line usage error."""
from __future__ import annotations

import argparse
import sys

from ..config import VERIFIERS

EXIT_OK, EXIT_ITEM_FAILED, EXIT_USAGE = 0, 1, 2


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
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="verify on a preallocated cache with CUDA-graph replays (GPU; see flashmm.targets.graphs)")
    parser.add_argument("--device", help="e.g. cuda, cpu (default: where the model loads)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="model dtype (as saved)")


def check_decoding_options(args) -> str | None:
    """The first invalid shared option as an error message, or None."""
    if args.max_new_tokens < 1:  # transformers' generate refuses 0 too
        return "--max-new-tokens must be >= 1"
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


def error(command: str, message: str) -> int:
    print(f"flashmm {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE
