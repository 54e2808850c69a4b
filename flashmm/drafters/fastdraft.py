"""FastDraft (Intel, arXiv 2411.11055): a small LM trained for one target, drafting with DraftModel.

The draft speaks the target's token ids but predicts only a reduced vocabulary: the tokens that
carry almost all of the target's output mass (chosen from the self-distillation corpus). A token
outside it is never drafted, and verification is exact whatever the draft proposes, so a smaller
output layer only costs acceptance where the target writes a rare token; it saves most of the
draft's step (SmolLM2's 49152-row LM head alone costs a fifth of a target step).

On disk (``flashmm.drafters.load(dir)``): ``drafter.json`` (method, drafter "fastdraft", the target
it was trained for, the draft LM's config) and ``model.safetensors`` (the LM's weights and the
``draft_to_target`` id map), fp16.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..tree.cost import AdaptiveDraftLength
from .base import register
from .draft_model import DraftModel
from .files import CONFIG_ERRORS, DrafterFileError, blamed_on, check_section, load_weights, read_safetensors
from .nets.reduced_vocab import ReducedVocabLM, build_lm
from .saved import CONFIG_FILE, read_info

WEIGHTS_FILE = "model.safetensors"


@register
class FastDraft(DraftModel):
    """A DraftModel over a trained ReducedVocabLM; build with ``FastDraft.from_dir(dir)`` or
    ``flashmm.drafters.load(dir)``. Same drafting and adaptive length as DraftModel (``drafting``:
    DraftModel's tree options — drafting, branching, beam_width, num_chains, pricing)."""

    name = "fastdraft"
    saved_sections: dict[str, dict] = {}   # drafter.json section -> {key: type} the constructor reads from info

    def __init__(self, model: ReducedVocabLM, max_draft_tokens: int = 8, tree_width: int = 1,
                 confidence: float = 0.0, adaptive: bool = True, length: AdaptiveDraftLength | None = None,
                 info: dict | None = None, **drafting):
        if not isinstance(model, ReducedVocabLM):
            raise TypeError("FastDraft drafts with a ReducedVocabLM; load a trained one with "
                            "flashmm.drafters.load(dir), or use DraftModel for any other causal LM")
        super().__init__(model, max_draft_tokens=max_draft_tokens, tree_width=tree_width, confidence=confidence,
                         adaptive=adaptive, length=length, **drafting)
        self.info = info or {}

    @classmethod
    def from_dir(cls, path, dtype: torch.dtype = torch.float32, **options) -> "FastDraft":
        model, info, _ = load_reduced_lm(path, dtype)
        config = Path(path) / CONFIG_FILE
        for name, hints in cls.saved_sections.items():
            if name in info:
                check_section(config, repr(name), info[name], hints)
        with blamed_on(config, "its settings", options):
            return cls(model, info=info, **options)


def load_reduced_lm(path, dtype: torch.dtype = torch.float32, extra: tuple[str, ...] = ()):
    """(ReducedVocabLM, drafter.json info, {name: tensor} for the ``extra`` names) from a folder
    written by save_reduced_lm; weights the config does not describe are refused, not ignored.
    A malformed drafter.json or model.safetensors raises DrafterFileError naming the file."""
    path = Path(path)
    config, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    info = check_section(config, "drafter.json", read_info(path), {"lm_config": dict, "target": dict},
                         required=("lm_config",), unknown_ok=True)
    check_section(config, "'target'", info["target"], {"vocab_size": int}, required=("vocab_size",), unknown_ok=True)
    tensors = read_safetensors(weights)
    if "draft_to_target" not in tensors:
        raise DrafterFileError(weights, "lacks the tensor 'draft_to_target' (the draft row -> target id map)")
    draft_to_target = tensors.pop("draft_to_target")
    kept = {name: tensors.pop(name).to(dtype) for name in extra if name in tensors}
    with blamed_on(config, "'lm_config'", errors=CONFIG_ERRORS):
        lm = build_lm(info["lm_config"])
    missing, unexpected = load_weights(lm, {k: v.to(dtype) for k, v in tensors.items()}, weights, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and lm.config.tie_word_embeddings)]
    missing += [name for name in extra if name not in kept]
    if missing or unexpected:
        raise DrafterFileError(weights, f"does not match its config: missing {missing}, unexpected {unexpected}")
    with blamed_on(weights, "'draft_to_target'"):
        model = ReducedVocabLM(lm.to(dtype), draft_to_target, info["target"]["vocab_size"])
    return model, info, kept


def save_reduced_lm(path, model: ReducedVocabLM, info: dict, drafter: str = "fastdraft",
                    extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` (fp16), ``extra`` tensors (fp16) and ``info`` (must name method and target) as
    a folder ``flashmm.drafters.load`` runs with the registered drafter ``drafter``."""
    for key in ("method", "target"):
        if key not in info:
            raise ValueError(f"drafter info needs {key!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.lm.state_dict().items()
             if not (k == "lm_head.weight" and model.lm.config.tie_word_embeddings)}
    state.update({name: t.detach().to(torch.float16).contiguous() for name, t in (extra or {}).items()})
    state["draft_to_target"] = model.draft_to_target.cpu()
    save_file(state, str(path / WEIGHTS_FILE))
    full = {**info, "drafter": drafter, "lm_config": model.lm.config.to_diff_dict()}
    (path / CONFIG_FILE).write_text(json.dumps(full, indent=1) + "\n")
    return path
