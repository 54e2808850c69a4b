"""``flashmm export-drafter``: a trained drafter written in a serving engine's layout: EAGLE-3 heads for
SGLang or vLLM's speculators format (flashmm.drafters.export), DFlash drafters for vLLM's speculators format
(flashmm.drafters.export_dflash; ``--target``, a model folder, fills in what drafter.json does not record),
Medusa heads for vLLM (flashmm.drafters.export_medusa; they read the target's LM head, so ``--target`` names
the target), EAGLE-1/2 heads of the EAGLE repository for vLLM's ``eagle`` method (flashmm.drafters.export_eagle).

    flashmm export-drafter assets/text_drafters/smollm2/eagle3 --format sglang --out OUT
    flashmm export-drafter assets/text_drafters/smollm2/dflash --format speculators --out OUT
    flashmm export-drafter assets/text_drafters/smollm2/medusa --format vllm-medusa --target smollm2 --out OUT
    flashmm export-drafter path/to/EAGLE-head --format vllm-eagle --out OUT
"""
from __future__ import annotations

import sys

from ..drafters.export import FORMATS, export_drafter
from ..drafters.export_dflash import target_from_folder
from ..drafters.export_eagle import export_vllm_eagle
from ..drafters.export_medusa import export_medusa


def add_export_command(commands) -> None:
    """The ``flashmm export-drafter`` subcommand (flashmm.serve.cli)."""
    cmd = commands.add_parser(
        "export-drafter", help="write a trained EAGLE-3 head, DFlash drafter or Medusa heads in a serving engine's "
                               "layout",
        description="Export a flashmm EAGLE-3 head folder (drafter.json + model.safetensors) to the layout "
                    "SGLang / SpecForge load (--format sglang: LlamaForCausalLMEagle3) or vLLM's speculators "
                    "format (--format speculators), a DFlash drafter to vLLM's speculators dflash layout (--format "
                    "speculators), Medusa heads to vLLM's Medusa layout (--format vllm-medusa, with --target), or "
                    "an EAGLE-1/2 head of the EAGLE repository to vLLM's EAGLE layout (--format vllm-eagle). "
                    "Keys and shapes are checked before writing.")
    cmd.add_argument("dir", metavar="DIR", help="the trained head's folder (e.g. assets/text_drafters/smollm2/eagle3)")
    cmd.add_argument("--format", required=True, choices=(*FORMATS, "vllm-medusa", "vllm-eagle"), dest="export_format")
    cmd.add_argument("--target", metavar="MODEL", help="vllm-medusa: the target whose LM head the heads read (a "
                                                       "Hugging Face model folder, 'smollm2' or 'gemma3'); a DFlash "
                                                       "drafter: the target's Hugging Face folder, whose config.json "
                                                       "names the verifier in the export (default: drafter.json's)")
    cmd.add_argument("--no-token-map", action="store_true",
                     help="vllm-medusa: write the whole LM head, no token_map (vLLM 0.32 cannot load a token_map; "
                          "the heads then rank every token, not only their trained vocabulary)")
    cmd.add_argument("--out", required=True, metavar="OUT", help="folder to write config.json + model.safetensors to")
    cmd.set_defaults(run=run_export)


def run_export(args) -> int:
    try:
        if args.export_format == "vllm-medusa":
            if not args.target:
                raise ValueError("--format vllm-medusa needs --target (the heads read the target's LM head)")
            out = export_medusa(args.dir, target_lm_head(args.target), args.out,
                                token_map=not args.no_token_map)
        elif args.export_format == "vllm-eagle":
            out = export_vllm_eagle(args.dir, args.out)
        else:
            target = target_from_folder(args.target) if args.target else None
            out = export_drafter(args.dir, args.export_format, args.out, target)
    except (FileNotFoundError, ValueError) as err:
        print(f"flashmm export-drafter: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}/config.json and {out}/model.safetensors ({args.export_format})")
    return 0


def target_lm_head(spec: str):
    """The LM head weight [V, d] of --target: a Hugging Face causal-LM folder, or 'smollm2' / 'gemma3' (the GGUF
    reference weights, flashmm.weights)."""
    import os  # noqa: PLC0415

    if spec in ("smollm2", "gemma3"):
        from ..weights import load_gguf_lm  # noqa: PLC0415

        model, _ = load_gguf_lm(spec)
    elif os.path.isdir(spec):
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        model = AutoModelForCausalLM.from_pretrained(spec)
    else:
        raise ValueError(f"--target {spec!r}: not a model folder, 'smollm2' or 'gemma3'")
    return model.get_output_embeddings().weight.detach()
