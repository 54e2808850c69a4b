"""``python -m flashmm.train flash``: a FLASH drafter for a vision-language (or text) target.

Runs unchanged under ``accelerate launch`` (one GPU per process, several machines, or CPU processes:
``accelerate launch --multi_gpu --num_processes 2 -m flashmm.train flash ...`` on a machine without
CUDA trains on gloo); see flashmm.train.trainer.
"""
from __future__ import annotations

from .cli_common import Command, add_target_arguments, load_target


def add_arguments(p) -> None:
    add_target_arguments(p, 'JSONL of {"image"|"video": path, "prompt": str} (or a "prompt" alone, text targets)')
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
    p.add_argument("--global-visual", action="store_true",
                   help="add ViSpec's global visual feature (a pooled image vector added to every text unit)")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="fine-tune the trained FLASH drafter in DIR instead of starting fresh (with --global-visual: "
                        "the feature is added at zero)")
    p.add_argument("--no-progress", action="store_true")


def run(args, argv: list[str]) -> int:
    from ..distributed import process_info  # noqa: PLC0415
    from .data import read_jsonl  # noqa: PLC0415
    from .trainer import train_flash  # noqa: PLC0415

    if args.num_frames is not None and args.fps is not None:
        raise SystemExit("give --num-frames or --fps, not both")
    try:
        records = read_jsonl(args.data)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"python -m flashmm.train flash: --data: {err}") from None
    model, processor = load_target(args.target, args.dtype)
    drafter = None
    if args.init is not None:
        from ..drafters.flash import FlashDrafter  # noqa: PLC0415
        from .trainer import with_global_visual  # noqa: PLC0415

        drafter = FlashDrafter.from_pretrained(args.init)
        drafter = with_global_visual(drafter, args.seed) if args.global_visual else drafter
    result = train_flash(model, processor, records, out_dir=args.out, epochs=args.epochs, lr=args.lr,
                         batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                         num_queries=args.num_queries, tokens_per_step=args.tokens_per_step,
                         compression=args.compression, pool_spans=args.pool_spans,
                         num_frames=args.num_frames, fps=args.fps,
                         ce_max_rows=args.ce_max_rows, seed=args.seed, resume=args.resume,
                         progress=not args.no_progress, drafter=drafter, global_visual=args.global_visual)
    if result.epoch_losses and process_info().is_main:
        print(f"final epoch loss {result.epoch_losses[-1]:.4f}; drafter saved to {args.out}")
    return 0


COMMANDS = {"flash": Command("train a FLASH drafter by self-distillation (multi-process under accelerate launch)",
                             add_arguments, run)}
