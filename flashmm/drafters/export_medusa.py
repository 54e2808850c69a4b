"""Export trained Medusa heads to the layout vLLM serves (``speculative_config={"method": "medusa", ...}``).

    flashmm export-drafter assets/text_drafters/smollm2/medusa --format vllm-medusa --target smollm2 --out OUT

vLLM's Medusa model (read, not copied: vLLM 0.32, model_executor/models/medusa.py and
transformers_utils/configs/medusa.py): config.json with ``model_type: "medusa"``, ``num_heads``,
``num_hidden_layers`` (residual blocks per head), ``hidden_size``, ``vocab_size``,
``truncated_vocab_size`` and ``medusa_fc_bias``; weights ``blocks.{k}.layers.{j}.weight / .bias``
(x ← x + SiLU(W x + b)) and one LM head per head, or with ``original_lm_head: true`` one shared
``lm_head.weight``; an optional ``token_map`` (int64) names the target id of each LM-head row when
``truncated_vocab_size`` < ``vocab_size``.

flashmm's Medusa heads are one residual block each and read the target's own LM head, restricted to
the heads' vocabulary (``vocab``) when they were trained on one: exported as ``original_lm_head`` with
``lm_head.weight`` = those rows of the target's LM head and ``token_map`` = ``vocab``. The target's LM head
is therefore part of the export (``--target``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .saved import read_info


def medusa_state(heads: dict[str, torch.Tensor], lm_head: torch.Tensor,
                 token_map: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """flashmm Medusa weights (``weight`` [K, d, d], ``bias`` [K, d], optional ``vocab`` [Vd]) and the target's
    LM head [V, d] → (vLLM's Medusa state, its config.json). ``token_map=False`` writes the whole LM head and
    no token map (the heads then rank every token, not only their vocabulary): vLLM 0.32 fails to load a
    token_map ("Following weights were not initialized from checkpoint: {'token_map'}": its load_weights
    creates the parameter but does not report it loaded)."""
    weight, bias, vocab = heads["weight"], heads["bias"], heads.get("vocab")
    if not token_map:
        vocab = None
    count, size = weight.shape[0], weight.shape[-1]
    if lm_head.shape[1] != size:
        raise ValueError(f"the heads' hidden size is {size}, the target's LM head is {tuple(lm_head.shape)}")
    vocab_size = lm_head.shape[0]
    state = {}
    for k in range(count):
        state[f"blocks.{k}.layers.0.weight"] = weight[k].float().contiguous()
        state[f"blocks.{k}.layers.0.bias"] = bias[k].float().contiguous()
    rows = lm_head if vocab is None else lm_head[vocab]
    state["lm_head.weight"] = rows.float().contiguous()
    if vocab is not None:
        state["token_map"] = vocab.long().contiguous()
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": count, "num_hidden_layers": 1,
              "hidden_size": size, "vocab_size": vocab_size,
              "truncated_vocab_size": vocab_size if vocab is None else int(vocab.numel()),
              "medusa_fc_bias": True, "original_lm_head": True}
    return state, config


def export_medusa(folder, lm_head: torch.Tensor, out, token_map: bool = True) -> Path:
    """Write the Medusa heads in ``folder`` (flashmm layout), with the target's LM head ``lm_head``, to ``out``
    (``token_map``: see medusa_state)."""
    info = read_info(folder)
    if info["drafter"] != "medusa":
        raise ValueError(f"{folder} holds a {info['drafter']!r} drafter; --format vllm-medusa exports Medusa heads")
    target = info.get("target") if isinstance(info.get("target"), dict) else {}
    if target.get("vocab_size") not in (None, lm_head.shape[0]):
        raise ValueError(f"{folder} was trained for a target with {target['vocab_size']} tokens; the given target's "
                         f"LM head has {lm_head.shape[0]} rows")
    state, config = medusa_state(load_file(str(Path(folder) / "model.safetensors")), lm_head.detach(),
                                 token_map)
    config["flashmm"] = {"exported_from": str(folder)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out
