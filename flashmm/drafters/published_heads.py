"""Medusa-1 heads in FasterDecoding/Medusa's layout, read into flashmm's Medusa drafter.

    flashmm.drafters.load("path/to/medusa-heads")      # or flashmm.wrap(model, "path/to/medusa-heads")

A Medusa folder holds ``config.json`` with ``medusa_num_heads``, ``medusa_num_layers`` and
``base_model_name_or_path``, and ``medusa_lm_head.safetensors`` (what medusa/train/train_legacy.py writes)
or ``medusa_lm_head.pt`` (what medusa_model.py loads; read with ``torch.load(weights_only=True)``), the
state dict of ``medusa_head``: head k is ``nn.Sequential(*[ResBlock] * L, nn.Linear(d, V, bias=False))`` with
L = ``medusa_num_layers``, keys ``{k}.{j}.linear.weight`` [d, d] / ``{k}.{j}.linear.bias`` [d] (j < L; a
ResBlock is h + SiLU(W h + b)) and ``{k}.{L}.weight`` [V, d], its own LM head; medusa_model_legacy.py's
heads have no LM head of their own and are read by the target's (no ``{k}.{L}.weight`` keys).

Followed (read, not copied): FasterDecoding/Medusa e2a5d20c048a9b0a4092e6933c34313687422518,
medusa/model/medusa_model.py (ResBlock, MedusaConfig, the head Sequential, ``medusa_forward``: every head
reads the target's final hidden state ``outputs[0]``, head i's logits at t are for token t + i + 2; the
fallback loader reads medusa_lm_head.pt with strict=False and builds 5 heads whatever the config says, as the
uploaded configs name too few), medusa/model/medusa_model_legacy.py (heads without LM heads, logits through
``base_model.lm_head``), medusa/train/train_legacy.py (config.json + medusa_lm_head.safetensors).

``[ResBlock(d)] * L`` repeats ONE block L times, so the L keys of a head hold one block (load_state_dict
copies each into it; the last wins). flashmm's MedusaHeads holds L blocks: the checkpoint's, which must
be equal (a checkpoint whose blocks differ was not written by that code, and it would run only the
last; refused). The number of heads is the number the weights hold. Where every head's LM head equals the
target's, the drafter shares the target's at bind (as vLLM's ``original_lm_head`` does).

Hydra's heads (zankner/Hydra) are read by flashmm.drafters.published_hydra.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from .files import DrafterFileError, blamed_on, read_json
from .medusa import Medusa
from .nets.medusa_net import MedusaHeads
from .published import CONFIG_FILE, UnsupportedDrafterFormat, read_first

MEDUSA_COMMIT = "e2a5d20c048a9b0a4092e6933c34313687422518"
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def medusa_heads(where: Path, state: dict[str, torch.Tensor], num_layers: int) -> MedusaHeads:
    """MedusaHeads holding the Medusa-1 state dict ``state`` (see the module docstring)."""
    parsed, unknown = {}, []
    for key, value in state.items():
        match = _KEY.match(key)
        if match is None:
            unknown.append(key)
        else:
            parsed[(int(match[1]), int(match[2]), match[3])] = value
    heads = sorted({k for k, _, _ in parsed})
    if unknown or not heads or heads != list(range(len(heads))):
        raise DrafterFileError(where, f"is not a Medusa head state dict ({{k}}.{{j}}.linear.weight / .bias, "
                                      f"{{k}}.{num_layers}.weight): heads {heads}, unexpected keys {unknown[:6]}")
    first = parsed.get((0, 0, "linear.weight"))
    if first is None or first.dim() != 2 or first.shape[0] != first.shape[1]:
        raise DrafterFileError(where, "has no square 0.0.linear.weight")
    d = first.shape[0]
    lm_heads = [parsed.get((k, num_layers, "weight")) for k in heads]
    own = [w is not None for w in lm_heads]
    if any(own) and not all(own):
        raise DrafterFileError(where, f"only heads {[k for k in heads if own[k]]} of {heads} have an LM head "
                                      f"({{k}}.{num_layers}.weight)")
    vocab = lm_heads[0].shape[0] if all(own) else 0
    want = {(k, j, name): shape for k in heads for j in range(num_layers)
            for name, shape in (("linear.weight", (d, d)), ("linear.bias", (d,)))}
    want.update({(k, num_layers, "weight"): (vocab, d) for k in heads if vocab})
    missing = sorted(f"{k}.{j}.{n}" for (k, j, n) in set(want) - set(parsed))
    extra = sorted(f"{k}.{j}.{n}" for (k, j, n) in set(parsed) - set(want))
    wrong = {f"{k}.{j}.{n}": tuple(parsed[k, j, n].shape) for (k, j, n) in want
             if (k, j, n) in parsed and tuple(parsed[k, j, n].shape) != want[k, j, n]}
    if missing or extra or wrong:
        raise DrafterFileError(where, f"does not match medusa_num_layers={num_layers} and width {d}: missing "
                                      f"{missing[:6]}, unexpected {extra[:6]}, wrong shapes {wrong}")
    for k in heads:
        for name in ("linear.weight", "linear.bias"):
            if not all(torch.equal(parsed[k, 0, name], parsed[k, j, name]) for j in range(1, num_layers)):
                raise UnsupportedDrafterFormat(
                    f"{where}: head {k}'s {num_layers} ResBlocks differ ({name}), but Medusa's medusa_model.py "
                    f"repeats one block ([ResBlock] * medusa_num_layers) and would run only the last; this "
                    f"checkpoint was not written by Medusa {MEDUSA_COMMIT[:7]}")
    net = MedusaHeads(d, num_heads=len(heads), num_layers=num_layers, vocab_size=vocab)
    with torch.no_grad():
        for k in heads:
            net.weight[k] = parsed[k, 0, "linear.weight"].float()
            net.bias[k] = parsed[k, 0, "linear.bias"].float()
            for j in range(1, num_layers):
                net.deeper_weight[k, j - 1] = parsed[k, j, "linear.weight"].float()
                net.deeper_bias[k, j - 1] = parsed[k, j, "linear.bias"].float()
            if vocab:
                net.lm_head_weight[k] = lm_heads[k].float()
    return net


def load_medusa(path, **options) -> "PublishedMedusa":
    """A PublishedMedusa from a FasterDecoding/Medusa folder; ``options`` go to Medusa (tree, max_draft_tokens, ...)."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    config = read_json(config_path)
    layers = config.get("medusa_num_layers", 1)
    if not isinstance(layers, int) or layers < 1:
        raise DrafterFileError(config_path, f"medusa_num_layers should be an integer >= 1, got {layers!r}")
    where, state = read_first(folder, MEDUSA_FILES, "Medusa")
    heads = medusa_heads(where, state, layers)
    named = config.get("medusa_num_heads")
    if isinstance(named, int) and named > heads.num_heads:
        raise DrafterFileError(where, f"holds {heads.num_heads} heads, config.json names {named}")
    with blamed_on(config_path, "the drafting options", options):
        return PublishedMedusa(heads, folder=folder, verifier=config.get("base_model_name_or_path"), **options)


class PublishedMedusa(Medusa):
    """A Medusa drafter read from a FasterDecoding/Medusa folder (``folder``: named by every refusal;
    ``verifier``: the base model its config names). ``bind`` refuses a target of another width or
    vocabulary, and shares the target's LM head where every head's own equals it."""

    def __init__(self, heads: MedusaHeads, *, folder: str | os.PathLike, verifier: str | None = None, **options):
        info = {"method": "medusa", "target": verifier, "source": os.fspath(folder),
                "format": f"FasterDecoding/Medusa {MEDUSA_COMMIT[:7]}"}
        super().__init__(heads, info=info, **options)
        self.folder = Path(folder)

    def bind(self, target) -> None:
        head = target.output_embeddings()
        weight = getattr(head, "weight", None)
        shape = None if weight is None else tuple(weight.shape)
        heads = self.heads
        wrong = []
        if shape is None or shape[-1] != heads.hidden_size:
            wrong.append(f"hidden size: drafter {heads.hidden_size}, target {shape and shape[-1]}")
        if heads.has_lm_heads and shape is not None and shape[0] != heads.vocab_size:
            wrong.append(f"vocabulary: drafter {heads.vocab_size}, target {shape[0]}")
        if wrong:
            raise ValueError(f"{self.folder}: these Medusa heads do not fit the target: " + "; ".join(wrong))
        if heads.has_lm_heads and getattr(head, "bias", None) is None and all(
                torch.equal(w, weight.detach().to(w.device, w.dtype)) for w in heads.lm_head_weight.detach()):
            del heads.lm_head_weight                  # every head reads the target's LM head: share it
            heads.vocab_size = 0
        super().bind(target)


__all__ = ["MEDUSA_COMMIT", "PublishedMedusa", "load_medusa", "medusa_heads"]
