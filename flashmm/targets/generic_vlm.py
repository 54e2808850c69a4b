"""One adapter for every vision-language model whose images and videos become runs of a
placeholder token: no per-family code.

What it relies on is what transformers' ``*ForConditionalGeneration`` VLMs share:

- the config names the placeholder ids (``image_token_id`` / ``image_token_index``,
  ``video_token_id`` / ``video_token_index``);
- the model's forward embeds the prompt, writes the vision features over the placeholder
  embeddings (one feature per placeholder token) and hands the result to its language model
  (``get_decoder()``) as ``inputs_embeds``; the model checks itself that features and placeholders
  have the same count (``get_placeholder_mask``);
- after the prompt every token is text, so tree steps are CausalLMTarget's.

``PlaceholderVLMTarget`` serves the families with 1-D positions (Gemma 3, PaliGemma, Mistral 3 /
Pixtral, Idefics2/3, SmolVLM, InternVL, Llama 4, Aya Vision, LLaVA-NeXT-Video, Video-LLaVA,
VipLLaVA, Cohere2-Vision, ...). Positions are what ``generate`` gives (``prepare_inputs_for_generation``
may shift them: PaliGemma's are 1-based). ``RopeIndexVLMTarget`` serves multimodal-RoPE families
(GLM-4V, ERNIE-4.5-VL, PaddleOCR-VL, ...) through the model's own ``get_rope_index``, called
as ``generate`` calls it. Models whose images enter through cross-attention layers (Mllama), or
whose config names no placeholder (GIT, Kosmos-2.5, MiniCPM-V: ``UnplacedMediaTarget``), are served
for text only: media are refused with the reason.

Checks: before the forward, placeholders without media (or media without placeholders) raise
MediaMismatchError; the per-item count is the model's own check (rephrased); after the prefill,
every placeholder must have been overwritten by a vision feature (a model that leaves some as
token embeddings, e.g. fewer features than placeholders merged silently, is an error too).
"""
from __future__ import annotations

import inspect
import warnings

import torch

from ..tree.token_tree import TokenTree
from . import register_adapter
from .base import SequenceCache, TargetOutput
from .cache import cache_argument
from .failures import MODEL_ERRORS, describe, raised_by_model
from .support import UnsupportedModel, architecture, generate_position_ids, takes_position_ids
from .text import CausalLMTarget
from .visual import VisualTarget, _config_id

# forward arguments that carry media, by placeholder kind (Video-LLaVA names its images pixel_values_images)
MEDIA_KEYS = {"image": ("pixel_values", "pixel_values_images", "image_patches", "image_embeds"),
              "video": ("pixel_values_videos", "video_embeds")}


def placeholder_ids(config) -> dict[str, int]:
    """{"image": id, "video": id} of the placeholders ``config`` names (kinds it lacks are left out)."""
    ids = {"image": _config_id(config, "image_token_id", "image_token_index"),
           "video": _config_id(config, "video_token_id", "video_token_index")}
    return {kind: token for kind, token in ids.items() if token is not None}


def rope_index_owner(model: torch.nn.Module):
    """The module whose ``get_rope_index`` generate uses (``model.model`` or the model), or None."""
    for owner in (getattr(model, "model", None), model):
        if owner is not None and callable(getattr(owner, "get_rope_index", None)):
            return owner
    return None


def rope_axes(model: torch.nn.Module) -> int:
    """How many rotary axes a multimodal-RoPE model's positions have (R of [R, B, T]): one per entry of its
    text config's ``mrope_section`` (HunYuan-VL has more than 3), else 3 (temporal, height, width)."""
    config = model.config.get_text_config()
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, name, None)
        if isinstance(rope, dict) and rope.get("mrope_section"):
            return len(rope["mrope_section"])
    return 3


def cross_attention_decoder(model: torch.nn.Module) -> bool:
    """Whether the language model takes vision states through cross-attention (Mllama), not placeholders."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None:
        return False
    params = inspect.signature(decoder.forward).parameters
    return "cross_attention_states" in params or "encoder_hidden_states" in params


def is_placeholder_vlm(model: torch.nn.Module) -> bool:
    """Adapter predicate: a model whose config names a placeholder id and whose forward takes media."""
    if not placeholder_ids(model.config):
        return False
    params = inspect.signature(model.forward).parameters
    return any(key in params for keys in MEDIA_KEYS.values() for key in keys)


def media_keys(model_inputs: dict) -> list[str]:
    """Names of the media tensors among forward kwargs (pixels, patches, image / video / audio inputs)."""
    words = ("pixel", "image", "video", "patches", "audio", "input_features")
    return [k for k, v in model_inputs.items() if torch.is_tensor(v) and any(w in k for w in words)]


def has_media(model_inputs: dict) -> bool:
    """Whether a prompt's inputs carry media: a media tensor, or multimodal token types marking some
    (MiniCPM-V sizes its images by ``target_sizes``, Qwen-VL by ``image_grid_thw``: any of them counts)."""
    types = model_inputs.get("mm_token_type_ids")
    return bool(media_keys(model_inputs)) or (torch.is_tensor(types) and bool((types != 0).any()))


def takes_media(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes pixels (pixel_values, flattened_patches, image_patches, ...)."""
    params = inspect.signature(model.forward).parameters
    return any(key in params for keys in MEDIA_KEYS.values() for key in keys) \
        or any("pixel" in name or "patches" in name for name in params)


def generate_position_offset(model: torch.nn.Module) -> int:
    """How far ``prepare_inputs_for_generation`` shifts the positions generate computed (PaliGemma: +1;
    most models: 0)."""
    from transformers import DynamicCache  # noqa: PLC0415

    if not takes_position_ids(model) or not hasattr(model, "prepare_inputs_for_generation"):
        return 0
    ids = torch.tensor([[1, 2]], device=model.get_output_embeddings().weight.device)
    positions = torch.arange(2, device=ids.device)[None]
    cache = {cache_argument(model, "prepare_inputs_for_generation"): DynamicCache()}
    try:
        prepared = model.prepare_inputs_for_generation(ids, position_ids=positions, attention_mask=torch.ones_like(ids),
                                                       use_cache=True, **cache)
    except MODEL_ERRORS as error:
        if not raised_by_model(error):
            raise
        warnings.warn(f"{architecture(model)}: its prepare_inputs_for_generation fails on a 2-token prompt "
                      f"({describe(error)}), so flashmm gives it generate's positions unshifted; its self-check "
                      "then compares them with the model's own", stacklevel=2)
        return 0
    shifted = prepared.get("position_ids")
    if not torch.is_tensor(shifted) or shifted.shape != positions.shape:
        return 0
    offset = shifted - positions
    if not bool((offset == offset.flatten()[0]).all()):
        return 0
    return int(offset.flatten()[0])


@register_adapter(lambda model: is_placeholder_vlm(model) and rope_index_owner(model) is None)
class PlaceholderVLMTarget(VisualTarget):
    """Any VLM with 1-D positions whose media fill runs of placeholder tokens (see the module
    docstring); a model with a cross-attention language model decodes text only."""

    def __init__(self, model, processor=None, attention: str = "auto", linear: str = "auto"):
        self.placeholders = placeholder_ids(model.config)
        self.cross_attention = cross_attention_decoder(model)
        self.merges_embeds = not self.cross_attention
        self.check_filled_on_prefill = self.merges_embeds  # one [1, T, d] copy per prompt
        self.position_offset = self.generate_offset(model)
        super().__init__(model, processor=processor, attention=attention, linear=linear)

    @staticmethod
    def generate_offset(model) -> int:
        """The constant generate adds to 1-D positions (generate_position_offset)."""
        return generate_position_offset(model)

    # ------------------------------------------------------------------ checks
    def check_media(self, input_ids: torch.Tensor, model_inputs: dict) -> None:
        """Placeholders of each kind need media of that kind and the other way round; the count per
        image is left to the model's own check (and the fill check after the prefill)."""
        given = {kind: [k for k in keys if model_inputs.get(k) is not None] for kind, keys in MEDIA_KEYS.items()}
        if self.cross_attention and (given["image"] or given["video"]):
            raise UnsupportedModel(
                f"flashmm cannot decode {architecture(self.model)} with images: its images enter the language model "
                "through cross-attention layers, not placeholder tokens, and flashmm's tree steps do not carry the "
                "cross-attention mask; run it with model.generate (text-only prompts are served)")
        if "image" in given and "video" not in self.placeholders:
            given["image"] += given.pop("video")  # a model that marks video frames with its image token
        for kind, token in self.placeholders.items():
            count = int((input_ids == token).sum())
            what = f"{kind} placeholders and {kind}s differ"
            if count and not given.get(kind):
                raise self._media_error(what, f"the prompt has {count} {kind} tokens (id {token}) but none of "
                                        f"{', '.join(MEDIA_KEYS[kind])} was given")
            if given.get(kind) and not count:
                raise self._media_error(what, f"{given[kind][0]} was given but the prompt has no {kind} tokens "
                                        f"(id {token})")

    def prompt_features(self, input_ids: torch.Tensor, input_embeds: torch.Tensor | None = None, **model_inputs):
        """VisualTarget's; a cross-attention model (text only) gives its token embeddings and no spans."""
        if self.cross_attention:
            return self.input_embeddings()(input_ids), []
        return super().prompt_features(input_ids, input_embeds, **model_inputs)

    def check_filled(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> None:
        """input_ids [B, T], embeds [B, T, d] (what the language model got): every placeholder must carry
        a vision feature, not its own token embedding."""
        mask = self.visual_token_mask(input_ids)
        if not bool(mask.any()):
            return
        plain = self.input_embeddings()(input_ids[mask])  # [M, d]
        unfilled = int((embeds[mask] == plain.to(embeds.dtype)).all(-1).sum())
        if unfilled:
            raise self._media_error("visual placeholders and media differ",
                                    f"{unfilled} of {int(mask.sum())} placeholder tokens reached the language model "
                                    "without a vision feature (fewer features than placeholders)")

    # ------------------------------------------------------------------ positions
    def model_kwargs(self, input_ids, attention_mask, model_inputs: dict) -> dict:
        """Media + the position_ids generate gives the prompt (shifted as the model's
        prepare_inputs_for_generation shifts them)."""
        kwargs = dict(model_inputs)
        if "position_ids" not in kwargs:
            positions = generate_position_ids(self.model, input_ids, attention_mask).get("position_ids")
            if positions is not None:
                kwargs["position_ids"] = positions + self.position_offset
        return kwargs

    def tree_position_ids(self, tree: TokenTree, prefix_len: int, batch_size: int, rope_delta: int = 0) -> torch.Tensor:
        """LongTensor [B, N]: prefix_len + depth (+ the model's generate offset)."""
        return super().tree_position_ids(tree, prefix_len, batch_size, rope_delta) + self.position_offset

    def batch_prompt(self, input_ids, attention_mask, model_inputs: dict):
        """VisualTarget's, with the model's generate offset on every position."""
        kwargs, offset = super().batch_prompt(input_ids, attention_mask, model_inputs)
        return kwargs, offset + self.position_offset

    @property
    def explicit_chain_positions(self) -> bool:  # a shifted position scheme is never left to the model
        return self.position_offset != 0


@register_adapter(lambda model: is_placeholder_vlm(model) and rope_index_owner(model) is not None)
class RopeIndexVLMTarget(PlaceholderVLMTarget):
    """Multimodal-RoPE VLMs beyond Qwen-VL (GLM-4V, ERNIE-4.5-VL, PaddleOCR-VL, Qwen3.5, ...): the
    prompt's positions [R, B, T] and ``rope_delta`` [B, 1] come from the model's own
    ``get_rope_index``, called with the processor's tensors exactly as ``generate`` calls it (the
    model's cached ``rope_deltas`` are neither read nor written); after the prompt every token is
    text at ``cache index + rope_delta`` in every row, as in QwenVLTarget."""

    explicit_chain_positions = True

    def __init__(self, model, processor=None, attention: str = "auto", linear: str = "auto"):
        #: the rotary axes of the model's positions (R in [R, B, T]): one per mrope_section entry
        self.rope_rows = rope_axes(model)
        super().__init__(model, processor=processor, attention=attention, linear=linear)

    @staticmethod
    def generate_offset(model) -> int:
        """0: rope-index positions carry their own offset (rope_delta)."""
        return 0

    def prompt_position_ids(self, input_ids: torch.Tensor, attention_mask, model_inputs: dict):
        """(position_ids LongTensor [R, B, T], rope_delta LongTensor [B, 1]) of the prompt: text
        positions in every row without media (as generate), else ``get_rope_index``."""
        if not has_media(model_inputs):
            text = generate_position_ids(self.model, input_ids, attention_mask).get("position_ids")
            text = torch.arange(input_ids.shape[1], device=input_ids.device)[None] if text is None else text
            delta = torch.zeros(input_ids.shape[0], 1, dtype=torch.long, device=input_ids.device)
            return text.expand(input_ids.shape[0], -1)[None].expand(self.rope_rows, -1, -1), delta
        if model_inputs.get("mm_token_type_ids") is None and "mm_token_type_ids" in self._rope_index_params():
            raise ValueError(f"{type(self.model).__name__} needs mm_token_type_ids to place its images (multimodal "
                             "RoPE): pass every tensor its processor returned, mm_token_type_ids included")
        kwargs = {k: v for k, v in model_inputs.items() if k != "position_ids"}
        params = self._rope_index_params()
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        owner = rope_index_owner(self.model)
        if attention_mask is None:  # some get_rope_index (Qwen3-Omni) index the mask without checking it
            attention_mask = torch.ones_like(input_ids)
        positions, delta = owner.get_rope_index(input_ids, attention_mask=attention_mask, **kwargs)
        if positions.shape[0] != self.rope_rows:
            raise UnsupportedModel(f"{architecture(self.model)}'s get_rope_index gave {positions.shape[0]} rotary "
                                   f"axes where its config's mrope_section names {self.rope_rows}; flashmm cannot "
                                   "place its positions after the prompt: run it with model.generate")
        return positions, delta

    def _rope_index_params(self):
        return inspect.signature(rope_index_owner(self.model).get_rope_index).parameters

    def model_kwargs(self, input_ids, attention_mask, model_inputs: dict) -> dict:
        kwargs = dict(model_inputs)
        if "position_ids" not in kwargs:
            kwargs["position_ids"] = self.prompt_position_ids(input_ids, attention_mask, model_inputs)[0]
        return kwargs

    def tree_position_ids(self, tree: TokenTree, prefix_len: int, batch_size: int, rope_delta: int = 0) -> torch.Tensor:
        """LongTensor [R, B, N]: prefix_len + rope_delta + depth, equal in every rotary axis."""
        positions = tree.positions(prefix_len + rope_delta).to(self.device)  # [N]
        return positions[None, None].expand(self.rope_rows, batch_size, -1)

    def batch_prompt(self, input_ids, attention_mask, model_inputs: dict):
        """Media + the padded batch's positions [R, B, T] from get_rope_index (as generate);
        offset: each row's rope delta."""
        model_inputs = {k: v for k, v in model_inputs.items() if k != "position_ids"}
        self.check_media(input_ids, model_inputs)
        positions, delta = self.prompt_position_ids(input_ids, attention_mask, model_inputs)
        return {**model_inputs, "position_ids": positions}, delta.reshape(-1)

    def batch_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, W] → [R, B, W], equal in every row."""
        return positions[None].expand(self.rope_rows, -1, -1)

    def prefill(self, input_ids, attention_mask, want_hidden, want_attention=False, **model_inputs) -> tuple[TargetOutput, SequenceCache]:
        """input_ids [1, T]; any position_ids given are replaced by the model's own rope index."""
        model_inputs.pop("position_ids", None)
        audio = [k for k in media_keys(model_inputs) if "audio" in k or "input_features" in k]
        if audio:
            raise UnsupportedModel(f"flashmm cannot decode {architecture(self.model)} with {', '.join(audio)}: "
                                   "audio moves multimodal-RoPE positions in ways this adapter does not reproduce; "
                                   "run it with model.generate (images, videos and text are served)")
        self.check_media(input_ids, model_inputs)
        positions, delta = self.prompt_position_ids(input_ids, attention_mask, model_inputs)
        out, seq = super().prefill(input_ids, attention_mask, want_hidden, want_attention,
                                   position_ids=positions, **model_inputs)
        seq.rope_delta = int(delta.reshape(-1)[0])
        return out, seq


@register_adapter(lambda model: takes_media(model) and not placeholder_ids(model.config))
class UnplacedMediaTarget(CausalLMTarget):
    """A model that takes images but whose config names no placeholder token: GIT prepends its image
    embeddings before the text (so text positions do not count them), Kosmos-2.5 and MiniCPM-V place
    features by masks or bounds of their own. flashmm cannot tell where its media sit in the cache,
    so it decodes such a model's text prompts and refuses media (before this, GIT with an image
    decoded different tokens from generate)."""

    def __init__(self, model, processor=None, attention: str = "auto", linear: str = "auto"):
        super().__init__(model, attention=attention, linear=linear)

    def prefill(self, input_ids, attention_mask, want_hidden, want_attention=False, **model_inputs) -> tuple[TargetOutput, SequenceCache]:
        self.refuse_media(model_inputs)
        return super().prefill(input_ids, attention_mask, want_hidden, want_attention, **model_inputs)

    def batch_prompt(self, input_ids, attention_mask, model_inputs: dict):
        self.refuse_media(model_inputs)
        return super().batch_prompt(input_ids, attention_mask, model_inputs)

    def refuse_media(self, model_inputs: dict) -> None:
        media = media_keys(model_inputs)
        if media:
            raise UnsupportedModel(
                f"flashmm cannot decode {architecture(self.model)} with {', '.join(media)}: its config names no "
                "image/video placeholder token, so flashmm cannot place the media's positions in its cache and "
                "verify drafts after them exactly; run it with model.generate (text-only prompts are served)")
