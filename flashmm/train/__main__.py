"""``python -m flashmm.train METHOD --target DIR_OR_SPEC --data data.jsonl --out DIR [options]``.

Trains a drafter for a target and writes it to --out, a folder ``flashmm.wrap(model, DIR)`` opens
(``python -m flashmm.train METHOD --help`` lists each method's options). --target: a Hugging Face
model directory (a vision-language model when its config has a vision part, else a causal LM;
processor / tokenizer from the same directory), "smollm2" or "gemma3" (the GGUF reference weights,
flashmm.weights), or "package.module:function" naming a callable that returns (model, processor).

Every method runs unchanged under ``accelerate launch`` or ``torchrun`` (one GPU per process, several
machines, or CPU processes: ``accelerate launch --multi_gpu --num_processes 2 -m flashmm.train METHOD
...`` on a machine without CUDA trains on gloo). flash reads {"image"|"video": path, "prompt": str}
records. The text methods read prompts ({"prompt"}, {"turns"} or {"messages"}), let the target answer
them greedily (the self-distillation corpus, cached under --out/corpus), and split each step's
--accumulate units per process over the processes (flashmm.train.data_parallel); a rerun with the
same --out and options resumes (corpus, features and checkpoints are kept there).
"""
from __future__ import annotations

import argparse
import sys

from . import cli_draft_lm, cli_eagle3, cli_flash, cli_heads, cli_judge, cli_kangaroo, cli_rest
from .cli_common import load_target  # noqa: F401  (the --target loader; its long-standing home)

COMMANDS = {**cli_flash.COMMANDS, **cli_eagle3.COMMANDS, **cli_heads.COMMANDS, **cli_draft_lm.COMMANDS,
            **cli_kangaroo.COMMANDS, **cli_judge.COMMANDS,
            **cli_rest.COMMANDS}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m flashmm.train", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="method", required=True, metavar="METHOD")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, aliases=list(command.aliases), help=command.help,
                           description=command.help, formatter_class=argparse.RawDescriptionHelpFormatter)
        command.add_arguments(p)
        p.set_defaults(command=command, method=name)  # an alias runs as its method
    return top


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    return args.command.run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
