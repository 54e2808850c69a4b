"""ViSpec draft heads (arXiv 2509.15235) in KangJialiang/ViSpec's layout, run by flashmm's EAGLE drafting.

    flashmm.wrap(vlm, "path/to/ViSpec-llava-v1.6-vicuna-7b-hf", processor=processor)   # or drafters.load(dir)

A ViSpec head is an EAGLE-1/2 head (fc + one Llama layer over the target's final-normed feature, scored by the
target's LM head) plus a vision adaptor that compresses each image of the prompt into a few units and a global
visual feature added to every unit after it (what it computes: flashmm.drafters.nets.vispec_net). It drafts
as EAGLE-2 does (ViSpec's ``topK_genrate`` is EAGLE-2's dynamic tree), so ViSpecDrafter is flashmm's
EagleDrafter (dynamic, static or chain trees, ``adaptive``; drafts carry q = None and the verifier keeps the
target's distribution, greedy or sampled) with ViSpec's units; the defaults are ViSpec's evaluation defaults
(``--depth 3 --top-k 8``: depth=4 here, which counts the root's pass; its ``--total-token 30`` is
max_draft_tokens=29, else the engine's cap SpecConfig.max_draft_tokens applies).

The folder (KangJialiang/ViSpec d0240c8719ac279fc307834d06789cc3049b5622, read, not copied:
vispec/model/cnets_ours.py ``Model`` / ``ImgAdaptor``, spec_model_ours.py ``SpecModel`` (which files it reads,
the ``bias`` key, the features: ``outputs.hidden_states[-1]`` of the base model, after its final norm; the
prompt's embeddings: the target's, image features merged, the image mask: image or video placeholder ids),
utils.py ``initialize_tree`` / ``update_inference_inputs``, train/*_config.json, train/main_mtp.py):
``config.json`` as vispec/train/{llava_1.6_7B,qwen2.5_vl_7B,...}_config.json (a one-layer text config flattened
under a VLM's ``architectures`` / ``model_type``: hidden_size, num_attention_heads, num_key_value_heads,
intermediate_size, vocab_size, rms_norm_eps, rope_theta when present (else 10000), ``qkv_bias`` when present,
``bias`` (fc and img_fc, default true)), and ``pytorch_model.bin`` (read with ``torch.load(weights_only=True)``)
or ``model.safetensors`` holding ``fc.*``, ``layers.0.*``, ``imadpt.{q,k_proj,v_proj,o_proj}.*``, ``img_fc.*``
and ``embed_tokens.weight`` (the target's table, frozen in training; without it the target's is used). The
number of adaptor queries (ViSpec's ``--num-q``, not in config.json) is read off ``imadpt.q``.

Refused by name: more than one layer, scaled RoPE (``rope_scaling``), an activation other than silu
(UnsupportedDrafterFormat naming config.json); a target whose hidden size or vocabulary differs (at bind,
naming the folder and both values); weights that do not match the config or are not plain tensors
(DrafterFileError naming the file).

Where flashmm differs from the reference code, deliberately:
- Prompts with several images: cnets_ours.py builds the map from its compressed units back to positions from
  the *first* image's segment sizes (``h_s[0]``, ``h_s[1]``) for every image, so unless the text before each
  image is as long as the text before the first, the map has the wrong number of rows and its forward fails
  on mismatched shapes. Only the last unit's output is ever read and the cache does not depend on that map:
  flashmm computes what the code computes wherever it runs, and the same for any images.
- A prompt with both images and a video: spec_model_ours.py's Qwen2.5-VL path replaces the image mask by the
  video mask, so its images are read as text; flashmm compresses every visual run (image or video).
- LLaVA-1.5 targets: ``SpecModel.specgenerate`` merges image features and builds the image mask for
  LLaVA-NeXT and Qwen2.5-VL only; for a LlavaForConditionalGeneration it hands the head neither, so the head
  reads the ``<image>`` token's table row at every placeholder and never runs its adaptor (g stays zero),
  although its training data (ge_data/ge_data_all_llava_*.py: ``hidden_states[0]`` and the image mask, for
  every LLaVA) has both. flashmm runs the method as trained, for every vision-language target alike.
- Precision: the reference runs the head in the target's dtype; flashmm in float32 (drafts may differ in the
  last bits; the output never does: the target verifies).
- Length: the reference's rotary table stops at ``max_position_embeddings`` (it fails past it); flashmm's
  does not.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .base import SequenceStart, register
from .eagle import WEIGHT_FILES, EagleDrafter, EagleOptions, eagle_config, read_head_weights, weight_names
from .files import DrafterFileError, blamed_on, load_weights, read_json
from .head_base import committed_embeds
from .nets.vispec_net import ViSpecConfig, ViSpecNet
from .published import CONFIG_FILE

VISPEC_COMMIT = "d0240c8719ac279fc307834d06789cc3049b5622"
LAYOUT = "ViSpec (KangJialiang/ViSpec)"


@dataclass(frozen=True)
class ViSpecOptions(EagleOptions):
    """EagleOptions with ViSpec's evaluation defaults (``--depth 3 --top-k 8``; depth counts the root's pass)."""

    depth: int = 4


def image_runs(visual_spans: list[tuple[int, int]], prompt_len: int) -> list[tuple[int, int]]:
    """The prompt's visual spans (half-open token ranges) → half-open runs of units whose next token is a
    visual placeholder (unit t reads token t + 1; token 0 is read by no unit), adjacent spans merged as one
    mask's runs are."""
    runs: list[tuple[int, int]] = []
    for start, end in sorted(visual_spans):
        a, b = max(start - 1, 0), min(end, prompt_len) - 1
        if b <= a:
            continue
        if runs and runs[-1][1] >= a:
            runs[-1] = (runs[-1][0], max(runs[-1][1], b))
        else:
            runs.append((a, b))
    return runs


@register
class ViSpecDrafter(EagleDrafter):
    """An EagleDrafter over a ViSpecNet: the prompt's units are made once with its images compressed
    (ViSpecNet.prompt_units), and every later unit, committed or drafted, reads the prompt's global visual
    feature. ``net``, ``embedding``, ``folder``, ``verifier`` and the options (ViSpecOptions) as EagleDrafter's."""

    name = "vispec"
    net_class = ViSpecNet
    options_class = ViSpecOptions
    layout = LAYOUT

    def __init__(self, net: ViSpecNet, **kwargs):
        super().__init__(net, **kwargs)
        self.info["format"] = f"{LAYOUT} {VISPEC_COMMIT[:7]}"

    @classmethod
    def from_dir(cls, path, **options) -> "ViSpecDrafter":
        """The head in ViSpec's folder ``path`` (see the module docstring)."""
        return load_vispec(path, **options)

    def _reset(self) -> None:
        super()._reset()
        self._image_runs: list[tuple[int, int]] = []     # the prompt's image runs, in units
        self._global_visual = None                      # [d] after the prompt's units: its last image's g

    def begin(self, start: SequenceStart) -> None:
        super().begin(start)
        if start.visual_spans and start.input_embeds is None:
            raise RuntimeError("ViSpecDrafter needs the target's input embeddings of a prompt with images "
                               "(SequenceStart.input_embeds): its adaptor reads the images' features")
        self._image_runs = image_runs(list(start.visual_spans), start.input_ids.shape[1])

    def head_pass(self, embeds, features, positions, mask, past=None):
        if self._global_visual is None:
            raise RuntimeError("ViSpecDrafter drafted before the prompt's units were made")
        return self.net(embeds, features, positions, mask, past, global_visual=self._global_visual)

    def _sync(self, committed: torch.Tensor) -> None:
        """The first sync of a sequence makes the prompt's units (images compressed, as ViSpec's first pass
        does); later ones add committed units as EAGLE's do."""
        if self._past is not None:
            return super()._sync(committed)
        root = committed.shape[1] - 1
        if self._next != 0 or self._pending is None or self._pending.shape[0] < root:
            raise RuntimeError(f"ViSpecDrafter is out of step with the target: {root} prompt positions, "
                               f"{0 if self._pending is None else self._pending.shape[0]} features")
        embeds = committed_embeds(self._embed, self._prompt_embeds, committed[0, 1: root + 1], 1)    # [root, d]
        inputs, positions, self._global_visual = self.net.prompt_units(embeds, self._pending[:root], self._image_runs)
        count = inputs.shape[0]
        mask = torch.ones(1, count, count, dtype=torch.bool, device=inputs.device).tril()
        out, self._past = self.net.layers[0](inputs[None], positions[None], mask, None)
        self._pending, self._next = self._pending[root:], root
        self._root_out = out[0, -1]                     # unit root - 1 reads the root token: never an image's


# ------------------------------------------------------------------------------------------ the folder
def is_vispec_folder(folder, config: dict) -> bool:
    """Whether ``folder`` (its config.json parsed as ``config``) holds a ViSpec head: weights with the vision
    adaptor's ``imadpt.q``; weights that cannot be listed (a pickle the loader will refuse) are judged by the
    config: one layer under a vision-language model's ``architectures``, as ViSpec's train/*_config.json."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        return False
    names = weight_names(folder)
    if names is not None:
        return "imadpt.q" in names
    architectures = config.get("architectures") or []
    return (config.get("num_hidden_layers") == 1 and "draft_vocab_size" not in config
            and any(str(a).endswith("ForConditionalGeneration") for a in architectures))


def load_vispec(path, **options) -> ViSpecDrafter:
    """A ViSpecDrafter from ViSpec's folder ``path``; ``options`` go to ViSpecDrafter. UnsupportedDrafterFormat
    for a variant flashmm cannot run, DrafterFileError naming the file for a malformed one (a pickle that is
    not plain tensors among them)."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    config = read_json(config_path)
    base = eagle_config(config_path, config, head="ViSpec head")
    where, state, embedding = read_head_weights(folder, base.vocab_size, base.hidden_size)
    queries = state.get("imadpt.q")
    if queries is None or queries.dim() != 3:
        raise DrafterFileError(where, "has no imadpt.q [num_q, heads, head_dim] (the vision adaptor's queries): "
                                      "not a ViSpec head")
    with blamed_on(where, "imadpt.q"):
        cfg = ViSpecConfig(**base.to_dict(), num_queries=int(queries.shape[0]))
    net = ViSpecNet(cfg)
    load_weights(net, state, where)
    name = config.get("base_model_name_or_path") or config.get("_name_or_path") or None
    with blamed_on(config_path, "the drafting options", options):
        return ViSpecDrafter(net, embedding=embedding, folder=os.fspath(folder), verifier=name, **options)


__all__ = ["LAYOUT", "VISPEC_COMMIT", "ViSpecDrafter", "ViSpecOptions", "image_runs", "is_vispec_folder",
           "load_vispec"]
