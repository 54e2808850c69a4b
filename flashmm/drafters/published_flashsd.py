"""FlashSD checkpoints (the published drafters of FLASH, arXiv 2505.12728), read into flashmm's EAGLE-1/2 drafting.

    flashmm.drafters.load("path/to/flashsd-drafter")   # or flashmm.wrap(vlm, "path/to/flashsd-drafter")

Followed (read, not copied): ZihuaEvan/FlashSD 598e999699b14be49610034f9a669976edf53980, flash/model/ee_model.py
(``EeModel``: what a checkpoint folder holds and how the drafter is fed), cnets.py (``Model``, its decoder layer
and ``topK_genrate``), configs.py (``EConfig``), utils.py (the decoding loop), choices.py (``mc_sim_7b_63``),
modeling_llava.py / modeling_qwen2_5_vl.py (what ``output_hidden_states`` holds), train/*_config.json,
train_llava.py / train_sar.py / llama_sar.py (what training writes), evaluation/merge_weight.py.

The folder ``EeModel.from_pretrained`` reads: ``config.json`` (EConfig: the target VLM's own config with
``architectures`` ``LlavaForConditionalGeneration`` or ``Qwen2_5_VLForConditionalGeneration``, ``hidden_size``,
``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``num_hidden_layers: 1``,
``rms_norm_eps``, ``vocab_size``, optionally ``bias``) and ``model.safetensors`` (``pytorch_model.bin``, what
merge_weight.py writes, is read too, with ``torch.load(weights_only=True)``) holding ``embed_tokens.weight``
[V, d], ``fc.weight`` [d, 2d] and ``fc.bias`` (unless ``bias: false``),
``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight`` and
``layers.0.post_attention_layernorm.weight``. That network is the EAGLE-1 head (flashmm.drafters.nets.eagle_net,
run by flashmm.drafters.eagle's EagleDrafter): ``fc(cat(embedding, feature))``, one Llama layer without an input
norm, the target's LM head on its output. What FlashSD feeds it, as flashmm's EagleDrafter does:

- the feature of position t is ``hidden_states[-1]`` of the target's language model, after its final norm;
- the embedding of a prompt position is ``hidden_states[0]``, what the language model consumed: the projected
  visual features at the image positions, the target's token embeddings elsewhere; the first generated token
  and every later one are embedded with the checkpoint's own ``embed_tokens`` (training copies the target's
  table there); a checkpoint without one embeds with the target's table (FlashSD would leave a random one);
- positions count the drafter's units from 0 (1-D rotary positions, also for Qwen2.5-VL's M-RoPE target).

Where FlashSD's head differs from the EAGLE repository's, this loader follows FlashSD: cnets.py builds its
rotary embedding with base 10000 whatever the config's ``rope_theta`` (Qwen2.5-VL's config says 1e6), and its
attention has no q/k/v biases. Drafting defaults to FlashSD's tree, ``tree="static"`` with the rank paths of
``mc_sim_7b_63`` (FLASHSD_TREE); EagleDrafter's other trees ("dynamic", "chain") can be asked for.

Not reproduced exactly, and why:

- Sampling. FlashSD draws each node's children without replacement from the drafter's distribution and
  verifies with EAGLE-1's recursive rule; flashmm drafts the same tree with the top tokens chosen
  deterministically and verifies with its multi-round tree rule. Both keep the target's distribution exactly
  (greedy output is identical; drafted tokens under sampling can differ).
- FLASH's own drafter, ``llama_sar.Model`` (a semi-autoregressive head, ``LlamaSemiARHead``, predicting ``k``
  features per pass, behind a learned latent compression of the image tokens), is only a training network at
  this commit: its forward reads an undefined ``compress_flag`` (a NameError before anything is computed) and
  its compression an undefined ``self.A`` and ``dim``, nothing in FlashSD drafts with it (EeModel builds
  cnets' ``Model``), and no decoding rule for its ``k`` outputs exists to follow. Its checkpoints
  (``layers.ar_proj.*`` weights, a config with ``k``) are refused by name.

Refused with UnsupportedDrafterFormat naming config.json: more than one layer, scaled RoPE, an activation
other than silu; at ``bind`` (ValueError naming the folder and both values): a target of another
architecture, hidden size or vocabulary than the checkpoint's config (a FlashSD config records no layer
count of its target: its ``num_hidden_layers`` is the drafter's).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .eagle import WEIGHT_FILES, EagleDrafter, EagleOptions, read_head_weights, weight_names
from .files import blamed_on, load_weights, read_json
from .nets.eagle_net import EagleConfig, EagleNet
from .published import CONFIG_FILE, UnsupportedDrafterFormat

FLASHSD_COMMIT = "598e999699b14be49610034f9a669976edf53980"
LAYOUT = "FlashSD"
#: the target classes EeModel.from_pretrained builds (the config's ``architectures[0]``)
TARGET_ARCHITECTURES = ("LlavaForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
#: FlashSD's draft tree (flash/model/choices.py ``mc_sim_7b_63``, which ee_model.eagenerate drafts): rank paths
FLASHSD_TREE = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
                (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
                (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1))
ROPE_BASE = 10000.0                             # cnets.LlamaRotaryEmbedding's default, the only base it uses


def _architecture(config: dict) -> str | None:
    names = config.get("architectures") or [None]
    return names[0] if isinstance(names, list) else None


def _semi_autoregressive(names: set[str] | None, config: dict) -> bool:
    """Whether weights named ``names`` (None: not listable) beside ``config`` are llama_sar's head."""
    return any(n.startswith("layers.ar_proj.") for n in names) if names is not None else "k" in config


def is_flashsd_folder(folder, config: dict) -> bool:
    """Whether ``folder`` (its config.json parsed as ``config``) holds a FlashSD checkpoint: a config naming one
    of FlashSD's target VLMs without q/k/v biases beside weights with ``fc.weight`` and without ViSpec's adaptor
    (``imadpt.q``; ViSpec's configs for the same targets say ``qkv_bias: true`` or ``LlavaNext...``), or weights
    with ``layers.ar_proj.*`` (llama_sar's semi-autoregressive head, which ``load_flashsd`` refuses by name).
    Weights that cannot be listed are judged by the config alone."""
    folder = Path(folder)
    if "draft_vocab_size" in config or not any((folder / name).is_file() for name in WEIGHT_FILES):
        return False
    names = weight_names(folder)
    if _semi_autoregressive(names, config):
        return True
    if _architecture(config) not in TARGET_ARCHITECTURES or config.get("qkv_bias"):
        return False
    return names is None or ("fc.weight" in names and "imadpt.q" not in names)


def _refuse(config_path: Path, what: str, value, why: str) -> UnsupportedDrafterFormat:
    return UnsupportedDrafterFormat(f"{config_path}: {what} is {value!r}; flashmm cannot run this {LAYOUT} "
                                    f"checkpoint exactly ({why})")


def flashsd_config(config_path: Path, config: dict) -> EagleConfig:
    """The EagleConfig of a FlashSD config.json, as EConfig and cnets.Model read it (rope base 10000, no q/k/v
    biases); refuses what flashmm cannot run exactly."""
    checks = (
        ("num_hidden_layers", config.get("num_hidden_layers"), 1,
         "one decoder layer; cnets gives every later layer an input norm, which flashmm's head has not"),
        ("hidden_act", config.get("hidden_act", "silu"), "silu", "SwiGLU"),
        ("rope_scaling", config.get("rope_scaling"), None, "cnets' linear / dynamic scaled rotary positions"),
    )
    for what, value, want, why in checks:
        if value != want:
            raise _refuse(config_path, what, value, why)
    heads = config.get("num_attention_heads")
    with blamed_on(config_path, "the drafter's sizes", errors=(KeyError, TypeError, ValueError)):
        return EagleConfig(
            hidden_size=int(config["hidden_size"]), num_attention_heads=int(heads),
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=ROPE_BASE,
            fc_bias=bool(config.get("bias", True)), qkv_bias=False)


def load_flashsd(path, **options) -> "FlashSDDrafter":
    """A FlashSDDrafter from FlashSD's folder ``path``; ``options`` go to EagleDrafter (default: FlashSD's static
    tree). UnsupportedDrafterFormat for a variant flashmm cannot run, DrafterFileError naming the file for a
    malformed one (a pickle that is not plain tensors among them)."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    config = read_json(config_path)
    if _semi_autoregressive(weight_names(folder), config):
        raise UnsupportedDrafterFormat(
            f"{folder}: a checkpoint of FlashSD's semi-autoregressive head (llama_sar.Model: layers.ar_proj.*, "
            f"config k={config.get('k')!r}); FlashSD {FLASHSD_COMMIT[:7]} trains it but never drafts with it (its "
            "forward reads an undefined compress_flag, its visual compression an undefined A), so there is no "
            "decoding of it to reproduce. flashmm reads the checkpoints FlashSD's EeModel runs (fc + layers.0.*)")
    architecture = _architecture(config)
    if architecture not in TARGET_ARCHITECTURES:
        raise _refuse(config_path, "architectures[0]", architecture,
                      f"FlashSD's EeModel drafts for {' and '.join(TARGET_ARCHITECTURES)}")
    cfg = flashsd_config(config_path, config)
    where, state, embedding = read_head_weights(folder, cfg.vocab_size, cfg.hidden_size)
    net = EagleNet(cfg)
    load_weights(net, state, where)
    if "options" not in options:
        tree = options.setdefault("tree", "static")
        if tree == "static":
            options.setdefault("paths", FLASHSD_TREE)
    with blamed_on(config_path, "the drafting options", options):
        return FlashSDDrafter(net, architecture=architecture, embedding=embedding, folder=folder,
                              verifier=config.get("_name_or_path") or None, **options)


class FlashSDDrafter(EagleDrafter):
    """An EagleDrafter read from a FlashSD folder (see the module docstring). architecture: the target class its
    config names; ``bind`` refuses a target of another class, hidden size or vocabulary, naming the folder and
    both values. The other arguments and options are EagleDrafter's."""

    def __init__(self, net: EagleNet, *, architecture: str, folder: str | os.PathLike,
                 embedding: torch.Tensor | None = None, verifier: str | None = None,
                 options: EagleOptions | None = None, **given):
        super().__init__(net, embedding=embedding, folder=folder, verifier=verifier, options=options, **given)
        self.architecture = architecture
        self.info["format"] = f"{LAYOUT} {FLASHSD_COMMIT[:7]}"

    def bind(self, target) -> None:
        cfg = self.net.cfg
        wrong = [(what, ours, theirs) for what, ours, theirs in (
            ("architecture", self.architecture, type(target.model).__name__),
            ("hidden size", cfg.hidden_size, target.hidden_size),
            ("vocabulary", cfg.vocab_size, target.vocab_size)) if ours != theirs]
        if wrong:
            raise ValueError(f"{self.folder}: this {LAYOUT} drafter does not fit the target: " + "; ".join(
                f"{what}: drafter {ours}, target {theirs}" for what, ours, theirs in wrong)
                + "; use the FlashSD checkpoint trained for this target")
        super().bind(target)


__all__ = ["FLASHSD_COMMIT", "FLASHSD_TREE", "LAYOUT", "TARGET_ARCHITECTURES", "FlashSDDrafter", "flashsd_config",
           "is_flashsd_folder", "load_flashsd"]
