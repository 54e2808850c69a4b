"""``flashmm export-drafter``: a trained EAGLE-3 head written in a serving engine's layout
(flashmm.drafters.export).

    flashmm export-drafter assets/text_drafters/smollm2/eagle3 --format sglang --out OUT
"""
from __future__ import annotations

import sys

from ..drafters.export import FORMATS, export_drafter


def add_export_command(commands) -> None:
    """The ``flashmm export-drafter`` subcommand (flashmm.serve.cli)."""
    cmd = commands.add_parser(
        "export-drafter", help="write a trained EAGLE-3 head in SGLang's or vLLM speculators' layout",
        description="Export a flashmm EAGLE-3 head folder (drafter.json + model.safetensors) to the layout "
                    "SGLang / SpecForge load (--format sglang: LlamaForCausalLMEagle3) or vLLM's speculators "
                    "format (--format speculators). Keys and shapes are checked before writing.")
    cmd.add_argument("dir", metavar="DIR", help="the trained head's folder (e.g. assets/text_drafters/smollm2/eagle3)")
    cmd.add_argument("--format", required=True, choices=FORMATS, dest="export_format")
    cmd.add_argument("--out", required=True, metavar="OUT", help="folder to write config.json + model.safetensors to")
    cmd.set_defaults(run=run_export)


def run_export(args) -> int:
    try:
        out = export_drafter(args.dir, args.export_format, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"flashmm export-drafter: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}/config.json and {out}/model.safetensors ({args.export_format})")
    return 0
