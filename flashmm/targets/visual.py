"""What every vision-language target shares: visual-token masks and spans, prompt features,
input checks, and processor/model agreement.

An adapter (generic_vlm.py for any placeholder-token VLM; llava.py, qwen_vl.py where a family
checks more) subclasses ``VisualTarget`` and supplies ``check_media`` (placeholders vs media,
before any forward), optionally ``check_filled`` (after it) and, where positions are not 1-D,
``prompt_position_ids`` / ``tree_position_ids``. Tree steps after the prefill are pure text for
every family, so they reuse CausalLMTarget's tree forward.
"""
from __future__ import annotations

import contextlib

import torch

from .base import SequenceCache, TargetOutput, select_hidden
from .support import UnsupportedModel, architecture
from .text import CausalLMTarget


class MediaMismatchError(ValueError):
    """The prompt's visual placeholders and the media given do not match."""


class _EmbedsCaptured(Exception):
    """Raised by the capture hook to stop a forward once the merged input embeddings exist."""

    def __init__(self, embeds: torch.Tensor):
        super().__init__("input embeddings captured")
        self.embeds = embeds


def token_runs(row: torch.Tensor) -> list[tuple[int, int]]:
    """Half-open (start, end) ranges of the True runs of a BoolTensor [T]."""
    flags = row.to(torch.int8)
    edges = torch.diff(flags, prepend=flags.new_zeros(1), append=flags.new_zeros(1))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends))


class VisualTarget(CausalLMTarget):
    """Base adapter of a ``*ForConditionalGeneration`` vision-language model.

    Subclasses set ``processor_classes`` (names of the transformers processor classes that
    produce this model's inputs) and implement ``check_media``.
    """

    processor_classes: tuple[str, ...] = ()

    def __init__(self, model: torch.nn.Module, processor=None, attention: str = "auto",
                 linear: str = "auto"):
        super().__init__(model, attention=attention, linear=linear)
        config = model.config
        self.image_token_id = _config_id(config, "image_token_id", "image_token_index")
        self.video_token_id = _config_id(config, "video_token_id", "video_token_index")
        self.visual_token_ids = torch.tensor([t for t in (self.image_token_id, self.video_token_id) if t is not None])
        if self.visual_token_ids.numel() == 0:
            raise TypeError(f"{type(model).__name__}'s config names no image or video token id")
        self.processor = processor
        if processor is not None:
            self.check_processor(processor)

    # ------------------------------------------------------------------ facts for drafters
    def visual_token_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] → BoolTensor [B, T], True at image and video placeholder tokens."""
        return torch.isin(input_ids, self.visual_token_ids.to(input_ids.device))

    def visual_spans(self, input_ids: torch.Tensor) -> list[tuple[int, int]]:
        """Half-open (start, end) runs of visual tokens in input_ids [1, T] (one run per image,
        per video, or per Qwen3-VL video frame group)."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"visual_spans takes one sequence [1, T], got {tuple(input_ids.shape)}")
        return token_runs(self.visual_token_mask(input_ids)[0])

    def prompt_features(self, input_ids: torch.Tensor, input_embeds: torch.Tensor | None = None, **model_inputs):
        """(input_embeds [B, T, d]: the embeddings the language model consumed, visual features
        merged at the visual positions; visual_spans). ``input_embeds``: what this prompt's prefill
        returned (``TargetOutput.input_embeds``); without them the model's vision path runs alone."""
        embeds = input_embeds if input_embeds is not None else self._capture_embeds(input_ids, model_inputs)
        return embeds, self.visual_spans(input_ids)

    # ------------------------------------------------------------------ lifecycle
    #: the language model gets the merged embeddings as inputs_embeds (False: cross-attention models)
    merges_embeds = True
    #: the prefill captures them even without want_hidden, to run check_filled on them
    check_filled_on_prefill = False

    def prefill(self, input_ids, attention_mask, want_hidden, want_attention=False, **model_inputs) -> tuple[TargetOutput, SequenceCache]:
        """input_ids [1, T] with placeholders expanded, plus the processor's media tensors.

        Checks placeholders against media first. With want_hidden the merged input embeddings
        are returned (``input_embeds``), so hidden-state drafters cost no second vision pass; with
        want_attention the last position's attention over the prompt (``last_attention`` [1, T]), read
        off this same forward.
        """
        self.check_media(input_ids, model_inputs)
        model_inputs = self.model_kwargs(input_ids, attention_mask, model_inputs)
        seq = self.new_sequence(input_ids.shape[1])
        attention_mask = self.prompt_attention(seq, input_ids, attention_mask)
        with (self.watching_prompt(input_ids, bool(want_hidden)) as captured, self._linears,
              self.reading_attention(want_attention) as reading, self.fused_language_model(reading)):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                             output_hidden_states=bool(want_hidden), logits_to_keep=1,
                             **{self.cache_argument: seq.kv}, **model_inputs, **(reading.kwargs if reading else {}))
        self.prompt_written(seq, input_ids)
        hidden = select_hidden(out.hidden_states, want_hidden)
        return TargetOutput(out.logits[:, -1:], hidden, captured[0] if captured and want_hidden else None,
                            last_attention=None if reading is None else reading.mean(input_ids.shape[1])), seq

    @contextlib.contextmanager
    def watching_prompt(self, input_ids: torch.Tensor, want_embeds: bool):
        """Around the prefill forward of input_ids [B, T]: yields a list that afterwards holds the merged
        input embeddings [B, T, d] the language model got (when wanted, or to check them), checked by
        check_filled; the model's own feature/placeholder count error is rephrased."""
        captured = []
        capture = self.merges_embeds and (want_embeds or self.check_filled_on_prefill)
        watch = self._language_model_input(captured.append) if capture else contextlib.nullcontext()
        try:
            with watch:
                yield captured
        except ValueError as err:
            # Counts the pre-checks cannot know (anyres tiles) are checked by the model itself.
            if "tokens do not match" in str(err):
                raise self._media_error("visual placeholders and media differ",
                                        f"the model's own count check failed ({err})") from err
            raise
        if captured:
            self.check_filled(input_ids, captured[0])

    def batch_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict):
        """CausalLMTarget's, after the placeholders of every row are checked against the batch's media
        (the model scatters the media over the placeholders in row order, as in generate); families
        with their own positions (model_kwargs) keep them."""
        self.check_media(input_ids, model_inputs)
        kwargs, offset = super().batch_prompt(input_ids, attention_mask, {})
        return {**kwargs, **self.model_kwargs(input_ids, attention_mask, model_inputs)}, offset

    # ------------------------------------------------------------------ family hooks
    def model_kwargs(self, input_ids: torch.Tensor, attention_mask, model_inputs: dict) -> dict:
        """The extra forward arguments of the prefill (families add explicit position_ids)."""
        return dict(model_inputs)

    def check_media(self, input_ids: torch.Tensor, model_inputs: dict) -> None:
        """Raise MediaMismatchError when placeholders and media disagree."""
        raise NotImplementedError

    def check_filled(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> None:
        """After a prefill that captured embeds [B, T, d]: raise MediaMismatchError when a placeholder
        got no vision feature (families whose counts are checked exactly before the forward skip it)."""

    def check_processor(self, processor) -> None:
        """Raise ValueError when ``processor`` cannot have produced this model's inputs."""
        name = type(processor).__name__
        if self.processor_classes and not any(cls.__name__ in self.processor_classes
                                              for cls in type(processor).__mro__):
            raise ValueError(
                f"processor {name} does not produce inputs for {type(self.model).__name__} "
                f"(expected {' or '.join(self.processor_classes)}); load the processor of the same "
                "checkpoint as the model: AutoProcessor.from_pretrained(<model checkpoint>)")
        for kind, model_id in (("image", self.image_token_id), ("video", self.video_token_id)):
            token = getattr(processor, f"{kind}_token", None)
            if model_id is None or token is None:
                continue
            proc_id = getattr(processor, f"{kind}_token_id", None)
            if proc_id is None:
                proc_id = processor.tokenizer.convert_tokens_to_ids(token)
            if proc_id != model_id:
                raise ValueError(
                    f"the processor's {kind} token {token!r} has id {proc_id} but the model's config expects "
                    f"{kind}_token_id={model_id}: processor and model come from different checkpoints; load both "
                    "from the same one")

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _media_error(what: str, detail: str) -> MediaMismatchError:
        return MediaMismatchError(
            f"{what}: {detail}. Build input_ids and the media tensors in one call of the model's processor, "
            "processor(text=..., images=[...], videos=[...]), with one placeholder in the text per image or video")

    def _capture_embeds(self, input_ids: torch.Tensor, model_inputs: dict) -> torch.Tensor:
        """Run the model only up to its language model; return the inputs_embeds [B, T, d] it gets."""
        self.check_media(input_ids, model_inputs)
        kwargs = self.model_kwargs(input_ids, None, model_inputs)

        def stop(embeds):
            raise _EmbedsCaptured(embeds)

        try:
            with torch.no_grad(), self._language_model_input(stop):
                self.model(input_ids=input_ids, use_cache=False, **kwargs)
        except _EmbedsCaptured as captured:
            return captured.embeds
        raise UnsupportedModel(f"flashmm cannot decode {architecture(self.model)}: its forward never called its "
                               "language model (get_decoder()), where flashmm reads the text and media embeddings "
                               "it merged; run it with model.generate")

    @contextlib.contextmanager
    def _language_model_input(self, callback):
        """While active, callback(inputs_embeds [B, T, d]) sees what the model hands its language
        model (``get_decoder()``): token embeddings with the visual features merged in. The hook
        lives only inside this block."""
        def hook(module, args, kwargs):
            embeds = kwargs.get("inputs_embeds")
            if embeds is None:
                raise UnsupportedModel(f"flashmm cannot decode {architecture(self.model)}: its forward called its "
                                       "language model without inputs_embeds, where flashmm reads the text and media "
                                       "embeddings it merged; run it with model.generate")
            callback(embeds.detach().clone())

        handle = self.model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


def instance_of(*class_names: str):
    """Adapter predicate: is the model an instance of one of these transformers classes (by name,
    so classes a transformers version lacks are skipped)?"""
    def predicate(model) -> bool:
        import transformers

        classes = tuple(getattr(transformers, name) for name in class_names if hasattr(transformers, name))
        return isinstance(model, classes)
    return predicate


def _config_id(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


def count_runs(mask_row: torch.Tensor) -> list[int]:
    """Lengths of the True runs of a BoolTensor [T]."""
    return [end - start for start, end in token_runs(mask_row)]
