"""Hydra heads in zankner/Hydra's layout, read exactly into flashmm's Hydra drafting (the MLP heads).

    flashmm.drafters.load("path/to/hydra-heads")      # or flashmm.wrap(model, "path/to/hydra-heads")

A Hydra folder holds ``config.json`` (HydraConfig.save_pretrained: ``hydra_num_heads``, ``hydra_num_layers``,
``hydra_head_arch``, ``grounded_heads``, ``hidden_state_offset``, ``base_model_name_or_path``; a missing field
takes HydraConfig's default: 4, 1, "mlp", false, 0) and ``hydra_lm_head.pt``, what hydra/train/train.py writes
(``torch.save(hydra_head.state_dict())``) and hydra_model.py's ``from_pretrained`` reads, here with
``torch.load(weights_only=True)``; ``hydra_lm_head.safetensors`` (a conversion) is read first when present.

The state dict of ``HydraMLP`` for K heads, L layers, width d and vocabulary V:

    hydra_mlp.{k}.0.linear.weight [d, (k + 2) d], .bias [d]          grounded: head k's ResBlock(d, k + 1)
    hydra_mlp.{k}.0.res_connection.weight [d, (k + 2) d], .bias [d]
    hydra_mlp.{k}.{j}.linear.weight [d, d], .bias [d]                j = 1 .. L-1 grounded, 0 .. L-1 ungrounded
    hydra_lm_head.{k}.weight [V, d], .bias [V]                        the head's own LM head
    input_embed_fn.weight [V, d]                                      the base model's embedding (below)

What the heads compute is in flashmm.drafters.nets.hydra_published_net. ``[ResBlock(d)] * n`` repeats ONE
block, so a head's square-block keys hold one block (load_state_dict copies each into it): they must be
equal, and a conversion that kept only some of them (safetensors drops shared tensors) reads the same. K is
the config's ``hydra_num_heads``, as from_pretrained builds it; weights of further heads go unused, as its
``load_state_dict(strict=False)`` leaves them; a missing key, which that call would leave at its random
initialisation, is refused. ``input_embed_fn.weight`` is there because HydraMLP registers the base model's
embedding module it is handed; training freezes it, so the heads embed through the target's, and the saved
copy's shape is checked against the target's at ``wrap``.

Followed (read, not copied): zankner/Hydra 3f39fbd2c22552e788b62dfd29a12b07ad63abfe,
hydra/model/hydra_heads/mlp_head.py (ResBlock; HydraMLP: ``forward``, where head i reads [h_t; E(x_{t+1}) ..
E(x_{t+i+1})], and ``_grounded_proposal``, where the root is the target's token and each node's children
come from the next head on that node's own path), hydra/model/hydra_model.py (HydraConfig, ``from_pretrained``,
the heads read the final normed state ``outputs[0]`` when ``hidden_state_offset`` is 0), hydra/train/train.py
(what is saved). Drafting is flashmm's Hydra (a chain or a static tree from rank accuracies) rather than
Hydra's ``hydra_choices`` trees, verified as any deterministic draft (typical acceptance, Hydra's own, is
``verifier="typical_lossy"``).

Refused with UnsupportedDrafterFormat naming config.json: ``hydra_head_arch`` "prefix-mlp" (Hydra++: a Llama
decoder layer over the whole prefix's states, with its own cache, feeds the MLP heads), "cross-attn" and
"eagle-attn" (attention heads); ``hidden_state_offset`` other than 0 (the heads read an earlier layer's state).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from .files import DrafterFileError, blamed_on, read_json
from .hydra import Hydra
from .nets.hydra_published_net import HydraMLPHeads
from .published import CONFIG_FILE, UnsupportedDrafterFormat, read_first

HYDRA_COMMIT = "3f39fbd2c22552e788b62dfd29a12b07ad63abfe"
HYDRA_FILES = ("hydra_lm_head.safetensors", "hydra_lm_head.pt")
#: the head architectures of zankner/Hydra flashmm does not run, with what each one is
UNREAD_ARCHS = {
    "prefix-mlp": "Hydra++'s heads: a Llama decoder layer over the whole prefix's hidden states (its own KV "
                  "cache, hydra/model/hydra_heads/prefix_mlp_head.py) feeds the MLP heads",
    "cross-attn": "attention heads over the prefix (hydra/model/hydra_heads/cross_attention_head.py)",
    "eagle-attn": "an EAGLE-style decoder layer (hydra/model/hydra_heads/eagle_head.py)",
}
_MLP_KEY = re.compile(r"^hydra_mlp\.(\d+)\.(\d+)\.(linear|res_connection)\.(weight|bias)$")
_LM_KEY = re.compile(r"^hydra_lm_head\.(\d+)\.(weight|bias)$")
EMBEDDING_KEY = "input_embed_fn.weight"


def _head_of(key: str) -> int | None:
    """The head number a HydraMLP key belongs to, or None for a key of no head."""
    match = _MLP_KEY.match(key) or _LM_KEY.match(key)
    return None if match is None else int(match[1])


def hydra_mlp_heads(where: Path, state: dict[str, torch.Tensor], num_heads: int, num_layers: int,
                    grounded: bool) -> HydraMLPHeads:
    """HydraMLPHeads holding the HydraMLP state dict ``state`` of file ``where`` (see the module docstring);
    DrafterFileError naming the file when its keys or shapes do not match the config's K, L and grounding."""
    lm = state.get("hydra_lm_head.0.weight")
    if lm is None or lm.dim() != 2:
        raise DrafterFileError(where, "is not a Hydra MLP head state dict: no hydra_lm_head.0.weight [V, d]")
    vocab, d = lm.shape
    described = f"hydra_num_heads={num_heads}, hydra_num_layers={num_layers}, grounded_heads={grounded}, width {d}"
    held = sorted({_head_of(key) for key in state if _LM_KEY.match(key)})
    if held[-1] + 1 < num_heads:
        raise DrafterFileError(where, f"holds {held[-1] + 1} heads (hydra_lm_head.{{k}}), config.json names "
                                      f"{num_heads}")
    want = {}                                          # key → shape, every key the K heads need
    for k in range(num_heads):
        if grounded:
            for part in ("linear", "res_connection"):
                want[f"hydra_mlp.{k}.0.{part}.weight"], want[f"hydra_mlp.{k}.0.{part}.bias"] = (d, (k + 2) * d), (d,)
        want[f"hydra_lm_head.{k}.weight"], want[f"hydra_lm_head.{k}.bias"] = (vocab, d), (vocab,)
    # the square block's copies: hydra_mlp.{k}.{j}.linear.{part} for j in ``repeated``, per (head, part)
    repeated = range(1 if grounded else 0, num_layers)
    copies = {(k, part): [f"hydra_mlp.{k}.{j}.linear.{part}" for j in repeated] for k in range(num_heads)
              for part in ("weight", "bias")}
    square_shapes = {key: (d, d) if part == "weight" else (d,) for (_, part), keys in copies.items() for key in keys}
    unexpected = sorted(key for key in state if key not in want and key not in square_shapes
                        and key != EMBEDDING_KEY and not (_head_of(key) is not None and _head_of(key) >= num_heads))
    missing = sorted(set(want) - set(state))
    saved = {head_part: [key for key in keys if key in state] for head_part, keys in copies.items()}
    missing += [f"hydra_mlp.{k}.{{{repeated.start}..{num_layers - 1}}}.linear.{part}"
                for (k, part), keys in saved.items() if copies[k, part] and not keys]
    wrong = {key: tuple(state[key].shape) for key, shape in {**want, **square_shapes}.items()
             if key in state and tuple(state[key].shape) != shape}
    embedding = state.get(EMBEDDING_KEY)
    if embedding is not None and (embedding.dim() != 2 or embedding.shape[1] != d):
        wrong[EMBEDDING_KEY] = tuple(embedding.shape)
    if missing or unexpected or wrong:
        raise DrafterFileError(where, f"does not match {described}: missing {missing[:6]}, "
                                      f"unexpected {unexpected[:6]}, wrong shapes {wrong}")
    for (k, part), keys in saved.items():
        if not all(torch.equal(state[keys[0]], state[key]) for key in keys[1:]):
            raise UnsupportedDrafterFormat(
                f"{where}: head {k}'s square ResBlocks differ ({', '.join(keys)}), but Hydra's mlp_head.py repeats "
                f"one block ([ResBlock] * n) and would run only the last; this checkpoint was not written by Hydra "
                f"{HYDRA_COMMIT[:7]}")
    net = HydraMLPHeads(d, num_heads, num_layers, vocab, grounded)
    with torch.no_grad():
        for k in range(num_heads):
            if grounded:
                for linear, part in ((net.entry[k], "linear"), (net.entry_residual[k], "res_connection")):
                    linear.weight.copy_(state[f"hydra_mlp.{k}.0.{part}.weight"].float())
                    linear.bias.copy_(state[f"hydra_mlp.{k}.0.{part}.bias"].float())
            if net.repeats:
                net.block[k].weight.copy_(state[saved[k, "weight"][0]].float())
                net.block[k].bias.copy_(state[saved[k, "bias"][0]].float())
            net.lm_head[k].weight.copy_(state[f"hydra_lm_head.{k}.weight"].float())
            net.lm_head[k].bias.copy_(state[f"hydra_lm_head.{k}.bias"].float())
    return net


def _config_value(config_path: Path, config: dict, name: str, default, kind: type, least: int | None = None):
    """config.json's ``name`` (HydraConfig's ``default`` when absent), checked to be a ``kind`` >= ``least``."""
    value = config.get(name, default)
    if type(value) is not kind or (least is not None and value < least):
        bound = f" >= {least}" if least is not None else ""
        raise DrafterFileError(config_path, f"{name} should be a {kind.__name__}{bound}, got {value!r}")
    return value


def load_hydra(path, **options) -> "PublishedHydra":
    """A PublishedHydra from a zankner/Hydra folder whose heads are Hydra's MLP heads; ``options`` go to Hydra
    (tree, max_draft_tokens, ...). UnsupportedDrafterFormat naming config.json for the head architectures
    and hidden-state offsets flashmm does not run; DrafterFileError naming the file for a malformed one."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    config = read_json(config_path)
    arch = config.get("hydra_head_arch", "mlp")
    if arch != "mlp":
        what = UNREAD_ARCHS.get(arch, f"no architecture Hydra {HYDRA_COMMIT[:7]} defines")
        raise UnsupportedDrafterFormat(f"{config_path}: a Hydra checkpoint with hydra_head_arch {arch!r} ({what}); "
                                       "flashmm runs Hydra's 'mlp' heads only")
    num_heads = _config_value(config_path, config, "hydra_num_heads", 4, int, least=1)
    num_layers = _config_value(config_path, config, "hydra_num_layers", 1, int, least=1)
    grounded = _config_value(config_path, config, "grounded_heads", False, bool)
    offset = _config_value(config_path, config, "hidden_state_offset", 0, int)
    if offset != 0:
        raise UnsupportedDrafterFormat(
            f"{config_path}: hidden_state_offset {offset}: these heads read the state {offset} layers before the "
            "last one; flashmm's head drafters read the target's final normed state (hidden_state_offset 0)")
    where, state = read_first(folder, HYDRA_FILES, "Hydra")
    heads = hydra_mlp_heads(where, state, num_heads, num_layers, grounded)
    embedding = state.get(EMBEDDING_KEY)
    with blamed_on(config_path, "the drafting options", options):
        return PublishedHydra(heads, folder=folder, verifier=config.get("base_model_name_or_path"),
                              embedding_shape=None if embedding is None else tuple(embedding.shape), **options)


class PublishedHydra(Hydra):
    """Hydra's published MLP heads (HydraMLPHeads) drafting as flashmm's Hydra does, each head scored by its own
    LM head. ``folder``: named by every refusal; ``verifier``: the base model its config names;
    ``embedding_shape``: (V, d) of the checkpoint's copy of the base model's embedding, or None. ``bind``
    refuses a target of another width or vocabulary, naming both."""

    def __init__(self, heads: HydraMLPHeads, *, folder: str | os.PathLike, verifier: str | None = None,
                 embedding_shape: tuple[int, int] | None = None, **options):
        info = {"method": "hydra", "target": verifier, "source": os.fspath(folder),
                "format": f"zankner/Hydra {HYDRA_COMMIT[:7]} ({'grounded' if heads.grounded else 'ungrounded'} "
                          f"mlp heads, {heads.num_layers} layers)"}
        super().__init__(heads, info=info, **options)
        self.folder, self.embedding_shape = Path(folder), embedding_shape

    def bind(self, target) -> None:
        weight = getattr(target.output_embeddings(), "weight", None)
        shape = None if weight is None else tuple(weight.shape)
        table = getattr(target.input_embeddings(), "weight", None)
        embedding = None if table is None else tuple(table.shape)
        heads, wrong = self.heads, []
        if shape is None or shape[-1] != heads.hidden_size:
            wrong.append(f"hidden size: drafter {heads.hidden_size}, target {shape and shape[-1]}")
        if shape is not None and shape[0] != heads.vocab_size:
            wrong.append(f"vocabulary: drafter {heads.vocab_size}, target {shape[0]}")
        if self.embedding_shape is not None and embedding != self.embedding_shape:
            wrong.append(f"input embedding: drafter {self.embedding_shape}, target {embedding}")
        if wrong:
            raise ValueError(f"{self.folder}: these Hydra heads do not fit the target: " + "; ".join(wrong))
        super().bind(target)

    def head_logits(self, k: int, states: torch.Tensor) -> torch.Tensor:
        return self.heads.head_logits(k, states)

    def draft_cost(self, tree) -> float:
        """The heads' cost for ``tree`` in target decoding steps: the weights of the heads it runs (each with
        its own LM head, none reading the target's) over the target's."""
        return sum(self.heads.head_size(k) for k in range(tree.max_depth)) / max(self._target_weights, 1)


__all__ = ["HYDRA_COMMIT", "PublishedHydra", "UNREAD_ARCHS", "hydra_mlp_heads", "load_hydra"]
