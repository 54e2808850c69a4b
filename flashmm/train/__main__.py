"""``python -m flashmm.train flash --target DIR_OR_SPEC --data data.jsonl --out DIR [options]``.

--target: a Hugging Face model directory (a vision-language model when its config has a
vision part, else a causal LM; processor / tokenizer from the same directory), "smollm2" or
"gemma3" (the GGUF reference weights, flashmm.weights), or "package.module:function" naming a
callable that returns (model, processor). Runs unchanged under ``accelerate launch`` (one GPU per
process, several machines, or CPU processes: ``accelerate launch --multi_gpu --num_processes 2
-m flashmm.train flash ...`` on a machine without CUDA trains on gloo).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys


def load_target(spec: str, dtype: str = "float32"):
    """(model, processor) for a --target value (see the module docstring)."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashmm.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="method", required=True)
    p = sub.add_parser("flash", help="train a FLASH drafter by self-distillation")
    p.add_argument("--target", required=True, help="model directory, 'smollm2', 'gemma3' or module:function")
    p.add_argument("--data", required=True, help="JSONL of {\"image\"|\"video\": path, \"prompt\": str}")
    p.add_argument("--out", required=True, help="output directory (drafter, checkpoints, feature cache)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--max-new-tokens", type=int, default=64, help="length of the target's own answers")
    p.add_argument("--num-queries", type=int, default=64, help="compressed visual tokens per span")
    p.add_argument("--tokens-per-step", type=int, default=5, help="K, features predicted per SAR pass")
    p.add_argument("--compression", default="learned", choices=["learned", "prune", "merge", "none"])
    p.add_argument("--pool-spans", type=int, default=1,
                   help="visual spans compressed together (videos given frame by frame as images)")
    p.add_argument("--num-frames", type=int, default=None, help="frames sampled per video (default 8)")
    p.add_argument("--fps", type=float, default=None, help="sample videos at this rate instead")
    p.add_argument("--ce-max-rows", type=int, default=None,
                   help="estimate the cross-entropy term on this many random rows per batch (large vocabularies)")
    p.add_argument("--dtype", default="float32", help="target dtype (float32, bfloat16, float16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    from ..distributed import process_info  # noqa: PLC0415
    from .data import read_jsonl  # noqa: PLC0415
    from .trainer import train_flash  # noqa: PLC0415

    if args.num_frames is not None and args.fps is not None:
        parser.error("give --num-frames or --fps, not both")
    records = read_jsonl(args.data)
    model, processor = load_target(args.target, args.dtype)
    result = train_flash(model, processor, records, out_dir=args.out, epochs=args.epochs, lr=args.lr,
                         batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                         num_queries=args.num_queries, tokens_per_step=args.tokens_per_step,
                         compression=args.compression, pool_spans=args.pool_spans,
                         num_frames=args.num_frames, fps=args.fps,
                         ce_max_rows=args.ce_max_rows, seed=args.seed, resume=args.resume,
                         progress=not args.no_progress)
    if result.epoch_losses and process_info().is_main:
        print(f"final epoch loss {result.epoch_losses[-1]:.4f}; drafter saved to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
