"""Drafters published in another project's layout, read into flashmm drafters: vLLM's ``speculators``.

    flashmm.drafters.load("path/to/speculator")        # or flashmm.wrap(model, "path/to/speculator")

A speculators folder holds ``config.json`` with ``speculators_model_type`` (the algorithm) and
``speculators_config`` (algorithm, proposal methods, verifier), and the weights (``model.safetensors``, a
sharded ``model.safetensors.index.json``, or ``pytorch_model.bin`` read with ``weights_only=True``).
One function per algorithm reads it: eagle3 here, dflash / dflash2 / dspark / peagle / mtp by their drafters
(flashmm.drafters.dflash, .dflash2, .dspark, .peagle, .speculators_mtp, each naming the speculators 0.9.0 files
it follows); flashmm.drafters.formats tells which layout a folder holds and calls its reader. This module
holds what those readers share (the weights' readers, UnsupportedDrafterFormat) and speculators' EAGLE-3.

Followed: speculators 0.9.0 (the PyPI wheel; it records no git commit, and its models/eagle3/config.py,
core.py and model_definitions.py are byte-identical to commit c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b,
the one export.py was checked against), read, not copied:
models/eagle3/config.py and core.py (the config fields; forward: ``fc`` over the concatenated aux
states, layer 0 = ``cat(input_layernorm(embed), hidden_norm(h))`` into attention, residual ``h``,
``lm_head(norm(h))``; later train-time-test steps feed the pre-norm output back),
models/eagle3/model_definitions.py (layer classes for model_type llama and qwen3), model.py
(DraftVocabMixin: ``embed_tokens`` [V, d] saved with the head, ``d2t`` / ``t2d`` only when the draft
vocabulary is smaller), train/vocab_mapping.py (target id = row + d2t[row]) and models/utils.py
(``eagle_aux_hidden_state_layer_ids`` default to (2, n/2, n-3) of the verifier's n layers, ids up to n).
vLLM captures the aux state entering layer i (the residual stream; export.py names the vLLM files this
was read in), i.e. HF's ``output_hidden_states[i]``, flashmm's feature index; id n would be the last
layer's output before the final norm, which HF's ``hidden_states[n]`` is not (it is normed), so it is
refused.

What flashmm refuses from an EAGLE-3 speculator (its head is exactly one Llama layer): more than one
draft layer, a non-Llama layer (qwen3's q/k norms), attention or MLP biases, scaled RoPE, sliding
windows, ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``. Test fixtures and
how they were made: tests/fixtures/speculators/README.md (tools/fixtures/speculators_fixtures.py).
"""
from __future__ import annotations

import os
import pickle
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from .eagle3 import Eagle3Drafter
from .export import check_state
from .files import DrafterFileError, blamed_on, load_weights, read_json, read_safetensors
from .nets.eagle3_net import Eagle3Config, Eagle3Net

SPECULATORS_VERSION = "0.9.0"
CONFIG_FILE = "config.json"
_IGNORED_KEYS = ("verifier_lm_head.weight", "verifier_norm.weight")   # training-only copies of the verifier's


class UnsupportedDrafterFormat(ValueError):
    """A published drafter whose algorithm (or variant of it) flashmm cannot run exactly."""


def head_embedding_and_vocab(state: dict[str, torch.Tensor], cfg, where: str) -> torch.Tensor | None:
    """An EAGLE-3 head's own ``embed_tokens.weight`` taken out of ``state`` (checked against ``cfg``; None when it
    has none), and identity vocabulary maps put in when the head has none and drafts the whole vocabulary."""
    embedding = state.pop("embed_tokens.weight", None)
    if embedding is not None and tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise DrafterFileError(where, f"embed_tokens.weight is {tuple(embedding.shape)}, the config says "
                                      f"({cfg.vocab_size}, {cfg.hidden_size})")
    if "d2t" not in state and "t2d" not in state:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise DrafterFileError(where, f"has no d2t / t2d, but its draft vocabulary ({cfg.draft_vocab_size}) "
                                          f"is smaller than the target's ({cfg.vocab_size})")
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    return embedding


# ------------------------------------------------------------------------------------------ weights
def read_pickled(path: Path) -> dict[str, torch.Tensor]:
    """The {name: tensor} state dict pickled in ``path`` (``.bin`` / ``.pt``), read with
    ``torch.load(weights_only=True)``: tensors and plain containers, never code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as err:  # code in it, or corrupt
        raise DrafterFileError(path, f"cannot be read as plain tensors (weights_only=True): {err}") from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DrafterFileError(path, "is not a {name: tensor} state dict")
    return state


def read_first(folder: Path, names: tuple[str, ...], what: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the file, its tensors) of the first of ``names`` present in ``folder`` (safetensors as such, anything
    else with ``read_pickled``); FileNotFoundError naming the folder and ``what`` it holds otherwise."""
    for name in names:
        path = folder / name
        if path.is_file():
            return path, (read_safetensors(path) if name.endswith(".safetensors") else read_pickled(path))
    raise FileNotFoundError(f"{folder} holds a {what} config.json but no {' or '.join(names)}")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``folder``: model.safetensors, the shards a
    model.safetensors.index.json lists, or pytorch_model.bin (``torch.load(weights_only=True)``: tensors
    and plain containers, never code)."""
    if (folder / "model.safetensors").is_file():
        return read_safetensors(folder / "model.safetensors")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = read_json(index).get("weight_map")
        if not isinstance(shards, dict):
            raise DrafterFileError(index, "has no 'weight_map' object")
        state = {}
        for shard in sorted(set(shards.values())):
            state.update(read_safetensors(folder / shard))
        return state
    for name in ("pytorch_model.bin", "model.pt"):
        if (folder / name).is_file():
            return read_pickled(folder / name)
    raise FileNotFoundError(f"{folder} holds a drafter's config.json but no weights (model.safetensors, "
                            "model.safetensors.index.json or pytorch_model.bin)")


# ------------------------------------------------------------------------------------------ EAGLE-3
def _require(config_path: Path, where: str, value, want, why: str) -> None:
    if value != want:
        raise UnsupportedDrafterFormat(f"{config_path}: {where} is {value!r}; flashmm's EAGLE-3 head needs {want!r} "
                                       f"({why})")


def eagle3_config(config_path: Path, config: dict) -> Eagle3Config:
    """The Eagle3Config of a speculators ``eagle3`` config.json (refusing what flashmm's head cannot run)."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DrafterFileError(config_path, "has no 'transformer_layer_config' object")
    _require(config_path, "transformer_layer_config.model_type", layer.get("model_type"), "llama",
             "one Llama decoder layer; qwen3's q/k norms are not in it")
    _require(config_path, "transformer_layer_config.num_hidden_layers", layer.get("num_hidden_layers"), 1,
             "one draft layer")
    for flag in ("attention_bias", "mlp_bias"):
        _require(config_path, f"transformer_layer_config.{flag}", bool(layer.get(flag, False)), False, "no biases")
    _require(config_path, "transformer_layer_config.hidden_act", layer.get("hidden_act", "silu"), "silu", "SwiGLU")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    _require(config_path, "the RoPE type", rope.get("rope_type", rope.get("type", "default")), "default",
             "unscaled rotary positions")
    kinds = set(layer.get("layer_types") or ["full_attention"])
    _require(config_path, "transformer_layer_config.layer_types", kinds, {"full_attention"}, "full attention")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        _require(config_path, flag, bool(config.get(flag, False)), False, "the EAGLE-3 layer as published")
    layers = config.get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(layers, list) and layers and all(isinstance(i, int) and i >= 0 for i in layers)):
        raise DrafterFileError(config_path, f"eagle_aux_hidden_state_layer_ids should list the target layers the "
                                            f"head reads, got {layers!r} (speculators resolves an absent list from "
                                            "the verifier as [2, n // 2, n - 3]: write those ids into config.json)")
    hidden = layer.get("hidden_size")
    heads = layer.get("num_attention_heads")
    with blamed_on(config_path, "transformer_layer_config", errors=(KeyError, TypeError, ValueError)):
        theta = layer.get("rope_theta", rope.get("rope_theta", 10000.0))
        return Eagle3Config(
            hidden_size=int(hidden), target_hidden_size=int(config.get("target_hidden_size") or hidden),
            num_attention_heads=int(heads), num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads), intermediate_size=int(layer["intermediate_size"]),
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or layer["vocab_size"]),
            feature_layers=tuple(layers), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            max_position_embeddings=int(layer.get("max_position_embeddings", 8192)))


def eagle3_from_speculators(folder: Path, config: dict, **options) -> "SpeculatorsEagle3Drafter":
    """A SpeculatorsEagle3Drafter from a speculators ``eagle3`` folder: speculators' keys (``layers.0.*``,
    or ``midlayer.*`` as converted EAGLE-3 checkpoints have them) onto Eagle3Net's, the draft vocabulary maps
    as saved (identity when the draft vocabulary is the target's: speculators saves none then) and the
    head's own ``embed_tokens`` when it has one."""
    config_path = folder / CONFIG_FILE
    cfg = eagle3_config(config_path, config)
    state = {k: v for k, v in read_weights(folder).items() if k not in _IGNORED_KEYS}
    where = next((str(folder / n) for n in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                                           "model.pt") if (folder / n).is_file()), str(folder))
    embedding = head_embedding_and_vocab(state, cfg, where)
    prefix = "midlayer." if any(k.startswith("midlayer.") for k in state) else "layers.0."
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    with blamed_on(where, "the weights"):
        check_state(state, cfg, prefix)
    net = Eagle3Net(cfg)
    load_weights(net, {("midlayer." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state.items()},
                 where)
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    with blamed_on(config_path, "the drafting options", options):
        return SpeculatorsEagle3Drafter(net, folder=folder, embedding=embedding, verifier=verifier.get("name_or_path"),
                                        **options)


class PublishedEagle3Drafter(Eagle3Drafter):
    """An Eagle3Drafter read from another project's folder: the same drafting, plus what that layout adds.

    folder:      the folder it came from (named by every refusal).
    layout:      the layout's name, for messages and ``info["format"]`` (e.g. "speculators 0.9.0").
    embedding:   the head's own ``embed_tokens`` [V, d] (saved with the head), which it embeds drafted tokens
                 with instead of the target's input embeddings; None: the target's (as flashmm's own heads).
    verifier:    the target the folder names, for the record.
    default_layers: the folder names no feature layers: at ``bind`` they become the target's layers
                 (2, n // 2, n - 3), each the state entering that layer, in ascending order (the EAGLE
                 repository's and SGLang's default capture points).
    ``bind`` refuses a target the head was not made for, naming the folder and both values."""

    def __init__(self, net: Eagle3Net, *, folder: str | os.PathLike, layout: str,
                 embedding: torch.Tensor | None = None, verifier: str | None = None, default_layers: bool = False,
                 **options):
        super().__init__(net, info={"method": "eagle3", "target": verifier, "source": os.fspath(folder),
                                    "format": layout}, **options)
        self.folder, self.layout, self.default_layers = Path(folder), layout, default_layers
        self.embedding = None if embedding is None else nn.Embedding.from_pretrained(embedding.float(), freeze=True)

    def bind(self, target) -> None:
        cfg = self.net.cfg
        layers = target.model.config.get_text_config().num_hidden_layers
        wrong = [(what, ours, theirs) for what, ours, theirs in (
            ("hidden size of its features", cfg.target_hidden_size, target.hidden_size),
            ("vocabulary", cfg.vocab_size, target.vocab_size)) if ours != theirs]
        if self.default_layers:
            captured = sorted({i for i in (2, layers // 2, layers - 3) if 0 <= i < layers})
            if len(captured) != len(cfg.feature_layers):
                wrong.append(("feature layers (2, n // 2, n - 3 of the target's n layers, as distinct layers)",
                              f"{len(cfg.feature_layers)} features", f"{layers} layers give {captured}"))
            else:
                self.net.cfg = replace(cfg, feature_layers=tuple(captured))
                self.feature_layers = tuple(captured)
        elif max(cfg.feature_layers) >= layers:
            wrong.append(("feature layers (each below the target's layer count)", list(cfg.feature_layers),
                          f"{layers} layers"))
        if wrong:
            raise ValueError(f"{self.folder}: this {self.layout} EAGLE-3 head does not fit the target: " + "; ".join(
                f"{what}: drafter {ours}, target {theirs}" for what, ours, theirs in wrong))
        super().bind(target)
        if self.embedding is not None:
            self.embedding = self.embedding.to(self._embed.weight.device)
            self._embed = self.embedding

    def save(self, path, info: dict):
        """A flashmm folder (drafter.json) has no place for the head's own embeddings, so a head that has them
        is refused rather than saved as a different drafter; keep its published folder instead."""
        if self.embedding is not None:
            raise ValueError(f"{self.folder}: this {self.layout} EAGLE-3 head embeds with its own embed_tokens, "
                             "which a flashmm drafter folder cannot hold; load it from its own folder instead")
        if self.default_layers and self._embed is None:
            raise ValueError(f"{self.folder}: this {self.layout} EAGLE-3 head reads the target's layers "
                             "(2, n // 2, n - 3), fixed when it is bound; wrap it with its target before saving")
        return super().save(path, info)


class SpeculatorsEagle3Drafter(PublishedEagle3Drafter):
    """A PublishedEagle3Drafter read from a speculators folder (``verifier``:
    ``speculators_config.verifier.name_or_path``)."""

    def __init__(self, net: Eagle3Net, *, folder: str | os.PathLike, embedding: torch.Tensor | None = None,
                 verifier: str | None = None, **options):
        super().__init__(net, folder=folder, layout="speculators", embedding=embedding, verifier=verifier,
                         **options)
        self.info["format"] = f"speculators {SPECULATORS_VERSION}"


__all__ = ["NO_DRAFTER_YET", "SPECULATORS_READ", "SPECULATORS_VERSION", "PublishedEagle3Drafter",
           "SpeculatorsEagle3Drafter", "UnsupportedDrafterFormat", "eagle3_config", "eagle3_from_speculators",
           "is_speculators_folder", "load_published", "load_speculators", "published_format", "read_pickled",
           "read_weights"]
