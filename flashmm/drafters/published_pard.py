"""PARD drafts as AMD publishes them (amd/PARD-Llama-3.2-1B, amd/PARD-Qwen2.5-0.5B, ...), run by flashmm's Pard.

    flashmm.drafters.load("path/to/PARD-Qwen2.5-0.5B", depth=8)   # or flashmm.wrap(model, "path/to/PARD-...")

A published PARD draft is an ordinary Hugging Face causal-LM folder: ``config.json`` (a transformers
``model_type`` plus ``pard_token``, the id of the mask token in the draft's own vocabulary), the weights
(``model.safetensors``, shards listed by ``model.safetensors.index.json``, or ``pytorch_model.bin`` read with
``torch.load(weights_only=True)``) and tokenizer files, which are not read: the draft must share the target's
tokenizer, checked at bind as for any DraftModel (a padded output layer is fine; rows past the target's
vocabulary, where the mask token may sit, are never drafted).

Followed (read, not copied): AMD-AGI/PARD 6f279bf3f1680e0b5d71c562ca5b91bdeef4c038 (its pard/pard_infer.py and
pard/pard_train.py unchanged since 8a0d2bd08d35916e129b6b13ae5eade534bac934):
pard/pard_infer.py (``PardInfer.generate`` with ``para``: the draft reads the committed tokens followed by
draft_k − 1 copies of ``config.pard_token`` at the next positions, in one ordinary causal forward; the argmax of
its logits at the last draft_k positions are the draft_k drafted tokens; the mask rows are cut from its cache
afterwards; ``draft_k`` defaults to 12, as in the README and config/eval/*.yaml), pard/pard_train.py
(``config.pard_token`` is the first of ``unused_tokenids``, one id for every mask position: the mask is an
ordinary token of the draft's vocabulary, read through its input embeddings) and utils/vllm_infer.py (vLLM's
``num_speculative_tokens``, 8 there). The folder does not store K: ``depth`` is an option (DEFAULT_DEPTH).

So the Pard drafter runs it unchanged: its mask embedding is the draft's embedding of ``pard_token`` (what
feeding the token gives), its vocabulary map the identity (draft row i = target id i), fixed at bind from the
target's vocabulary size. PARD-2 drafts (``pard2`` / ``spd_type`` "pard2" in config.json) are refused: see
PARD2_REASON.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .draft_model import check_same_tokenizer
from .files import CONFIG_ERRORS, DrafterFileError, blamed_on, read_json
from .nets.reduced_vocab import ReducedVocabLM
from .pard import Pard
from .published import CONFIG_FILE, UnsupportedDrafterFormat, read_weights

PARD_COMMIT = "6f279bf3f1680e0b5d71c562ca5b91bdeef4c038"
#: positions drafted per forward when not given: pard/pard_infer.py's default draft_k
DEFAULT_DEPTH = 12
PARD2_REASON = ("a PARD-2 draft also reads the target's hidden states (pard/pard2_infer.py: a target_proj over "
                "pard2_target_layers added to its input embeddings), which flashmm's Pard drafter has no input for")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "model.pt")


def load_pard(path, depth: int = DEFAULT_DEPTH, dtype: torch.dtype = torch.float32, **options) -> "PublishedPard":
    """The Pard drafter of the published PARD folder ``path`` (see the module docstring): the draft LM built by
    transformers from its config.json (never remote code), its weights read strictly (a missing or unexpected
    tensor is refused naming the file; a tied output layer may be absent), in ``dtype``. ``depth``: positions
    drafted per forward (1 real + depth − 1 masks); ``options`` go to Pard (max_draft_tokens, adaptive, ...)."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    config = read_json(config_path)
    if config.get("pard2") or config.get("spd_type") == "pard2":
        raise UnsupportedDrafterFormat(f"{config_path}: {PARD2_REASON}")
    pard_token = config.get("pard_token")
    if not isinstance(pard_token, int) or isinstance(pard_token, bool):
        raise DrafterFileError(config_path, f"'pard_token' should be an integer (the mask token's id in the draft's "
                                            f"vocabulary), got {pard_token!r}")
    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedDrafterFormat(f"{config_path}: model_type {model_type!r} is not a transformers causal LM "
                                       "(AutoModelForCausalLM); a PARD draft is one")
    with blamed_on(config_path, "the draft's model config", errors=CONFIG_ERRORS):
        lm_config = AutoConfig.for_model(**config)
        lm = AutoModelForCausalLM.from_config(lm_config, dtype=dtype, attn_implementation="sdpa").eval()
    embedding = lm.get_input_embeddings()
    if not 0 <= pard_token < embedding.weight.shape[0]:
        raise DrafterFileError(config_path, f"pard_token {pard_token} is not a row of the draft's "
                                            f"{embedding.weight.shape[0]}-row vocabulary")
    where = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), folder)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in read_weights(folder).items()}
    load_strictly(lm, state, where)
    with torch.no_grad():  # the embedding module's output: the token as the draft reads it (scaled, if it scales)
        mask_embedding = embedding(torch.tensor([pard_token]))[0]
    info = {"method": "pard", "target": config.get("_name_or_path"), "source": os.fspath(folder),
            "format": f"AMD-AGI/PARD {PARD_COMMIT[:7]}", "pard_token": pard_token}
    with blamed_on(config_path, "the drafting options", options):
        return PublishedPard(lm, mask_embedding, folder=folder, depth=depth, info=info, **options)


def load_strictly(lm: torch.nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    """Load ``state`` into ``lm``, refusing (DrafterFileError naming ``where``) a missing tensor, an unexpected
    one or a mis-sized one. Tied parameters (one tensor under several names, e.g. a tied LM head) need only one
    of their names; when the file holds several, they must be equal."""
    names: dict[int, list[str]] = {}
    for name, parameter in lm.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    tied = {name: group for group in names.values() if len(group) > 1 for name in group}
    for group in {tuple(g) for g in tied.values()}:
        saved = [state[n] for n in group if n in state]
        if any(t.shape != saved[0].shape or not torch.equal(t, saved[0]) for t in saved[1:]):
            raise DrafterFileError(where, f"holds different tensors for the tied weights {list(group)}")
    try:
        result = lm.load_state_dict(state, strict=False)
    except RuntimeError as err:  # mis-sized tensors
        raise DrafterFileError(where, f"does not match config.json: {err}") from err
    missing = [k for k in result.missing_keys if not any(n in state for n in tied.get(k, ()))]
    if missing or result.unexpected_keys:
        raise DrafterFileError(where, f"does not match config.json: missing {missing}, "
                                      f"unexpected {list(result.unexpected_keys)}")


def identity_vocab(lm: torch.nn.Module, target_vocab: int) -> ReducedVocabLM:
    """``lm`` answering in target ids that are its own rows: row i = id i for i < min(rows, target_vocab); rows
    past the target's vocabulary are never output, target ids past the draft's rows read as row 0."""
    rows = lm.get_output_embeddings().weight.shape[0]
    return ReducedVocabLM(lm, torch.arange(min(rows, target_vocab)), target_vocab).to(next(lm.parameters()).device)


class PublishedPard(Pard):
    """Pard over a published PARD draft: a transformers causal LM whose mask input is its embedding of
    ``pard_token``, over the target's own token ids.

    Until bound it answers in its own vocabulary; ``bind`` refuses a target with another tokenizer (naming the
    folder and both vocabulary sizes or special ids) and maps the draft's rows onto the target's vocabulary.
    """

    def __init__(self, lm: torch.nn.Module, mask_embedding: torch.Tensor, *, folder: str | os.PathLike,
                 depth: int = DEFAULT_DEPTH, info: dict | None = None, **options):
        super().__init__(identity_vocab(lm, lm.get_output_embeddings().weight.shape[0]), mask_embedding,
                         depth=depth, info=info, **options)
        self.folder = Path(folder)

    def bind(self, target) -> None:
        lm = self.pard.lm
        try:  # on the draft's own rows: the identity map below would hide a different vocabulary size
            check_same_tokenizer(lm.config, target, lm.get_output_embeddings().weight.shape[0])
        except ValueError as err:
            raise ValueError(f"{self.folder}: {err}") from err
        self.model = identity_vocab(lm, target.vocab_size)
        super().bind(target)


__all__ = ["DEFAULT_DEPTH", "PARD_COMMIT", "PublishedPard", "identity_vocab", "load_pard", "load_strictly"]
