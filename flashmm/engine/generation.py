"""``model.generate``'s argument surface, prepared by transformers' own code.

``prepare`` runs the same preparation steps as ``GenerationMixin.generate`` (transformers 5.x):
the generation config merged from ``model.generation_config``, ``generation_config=`` and keyword
overrides; the model-kwargs check that catches typos; special tokens and the attention mask
inferred from padding; ``num_return_sequences`` expansion; ``max_length`` / ``min_length``; the
logits processors and stopping criteria. flashmm then decodes each row speculatively with those
objects and ``finish`` returns what ``model.generate`` returns (a LongTensor, or a
``GenerateDecoderOnlyOutput`` with ``sequences``, ``scores`` and ``logits``).

What flashmm cannot honour exactly is refused here, before anything runs, naming the argument.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import EosTokenCriteria, GenerateDecoderOnlyOutput, MaxLengthCriteria
from transformers.generation.configuration_utils import GenerationMode

from ..sampling import PREFIX_DEPENDENT, PREFIX_FREE, SamplingParams

_MODE_ERRORS = {
    GenerationMode.ASSISTED_GENERATION: (
        "assisted generation (assistant_model, prompt_lookup_num_tokens, assistant_early_exit, use_mtp) "
        "is what flashmm replaces: pass a flashmm drafter to flashmm.wrap(model, drafter) instead"),
    GenerationMode.CONTRASTIVE_SEARCH: "contrastive search (penalty_alpha with top_k > 1)",
    GenerationMode.DOLA_GENERATION: "DoLa decoding (dola_layers)",
    GenerationMode.BEAM_SEARCH: "beam search (num_beams > 1)",
    GenerationMode.BEAM_SAMPLE: "beam sampling (num_beams > 1 with do_sample=True)",
    GenerationMode.GROUP_BEAM_SEARCH: "group beam search (num_beam_groups > 1)",
    GenerationMode.CONSTRAINED_BEAM_SEARCH: "constrained beam search (constraints / force_words_ids)",
}
# Keys flashmm sets itself on every forward; a user value would be silently replaced.
_OWN_KEYS = ("cache", "past_key_values", "cache_params", "cache_position", "position_ids", "inputs_embeds",
             "logits_to_keep")


@dataclass
class GenerationPlan:
    """One ``generate`` call, prepared.

    input_ids:       LongTensor [B, T]; rows as model.generate holds them (left padding kept,
                     expanded for num_return_sequences).
    attention_mask:  LongTensor [B, T]; 1 on real tokens (given, or inferred from padding).
    model_inputs:    extra model inputs (pixel_values, image_grid_thw, ...), for every row.
    config:          the prepared GenerationConfig (max_length already includes the prompt).
    processors:      per row, the LogitsProcessorList model.generate would apply.
    stopping:        StoppingCriteriaList (max length, EOS, stop strings, max time, the user's).
    """

    model: torch.nn.Module
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    model_inputs: dict
    config: GenerationConfig
    processors: list[LogitsProcessorList]
    stopping: StoppingCriteriaList
    streamer: object | None = None
    has_eos_criteria: bool = True

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_new_tokens(self) -> int:
        return max(self.config.max_length - self.input_ids.shape[1], 0)

    @property
    def pad_token_id(self) -> int:
        pad = self.config._pad_token_tensor
        return 0 if pad is None else int(pad.flatten()[0])

    def sampling(self, row: int) -> SamplingParams:
        """The row's decoding rule: transformers' processors, its padding as every prefix's start."""
        config = self.config
        padding = self.input_ids[row, : self.padding(row)]
        return SamplingParams(do_sample=bool(config.do_sample), temperature=config.temperature or 1.0,
                              top_k=config.top_k or None, top_p=config.top_p, processors=self.processors[row],
                              row_prefix=padding)

    def padding(self, row: int) -> int:
        """How many left-padding positions row ``row`` has."""
        return int((self.attention_mask[row] == 0).long().cumprod(0).sum())

    def stop(self, ids: torch.Tensor) -> bool:
        """ids [1, T] (padding included) → True when model.generate would stop after its last token."""
        eos = self._eos_only
        if eos is not None:
            return int(ids[0, -1]) in eos
        return bool(self.stopping(ids, None)[0])

    @functools.cached_property
    def _eos_only(self) -> frozenset | None:
        """The EOS ids when ``stopping`` holds nothing but generate's own length and EOS criteria (the length one
        is max_new_tokens, which every row keeps before asking ``stop``): ``stop`` then reads the last token
        alone, 2 µs a token instead of 90 for the criteria's tensor calls. None for any other criterion."""
        eos = None
        for criterion in self.stopping:
            if type(criterion) is EosTokenCriteria and eos is None:
                eos = frozenset(criterion.eos_token_id.flatten().tolist())
            elif not (type(criterion) is MaxLengthCriteria and criterion.max_length == self.config.max_length):
                return None
        return eos if eos is not None else frozenset()


def prepare(model, inputs: torch.Tensor | None, generation_config: GenerationConfig | None,
            logits_processor, stopping_criteria, prefix_allowed_tokens_fn, streamer, unsupported: dict,
            kwargs: dict) -> GenerationPlan:
    """Mirror GenerationMixin.generate's steps 1-8 and refuse what flashmm cannot decode exactly.

    unsupported: generate's named arguments flashmm refuses when set (assistant_model, ...).
    kwargs: every other keyword argument given to generate (GenerationConfig fields, model inputs).
    """
    for name, value in unsupported.items():
        if value is not None and value is not False:
            raise ValueError(f"flashmm cannot honour generate(..., {name}=...): {_refusal(name)}")
    if not hasattr(model, "_prepare_generation_config"):
        raise TypeError(f"{type(model).__name__} has no transformers `generate`; flashmm needs a GenerationMixin model")
    kwargs = dict(kwargs)
    tokenizer = kwargs.pop("tokenizer", None)
    if kwargs.pop("assistant_tokenizer", None) is not None:
        raise ValueError(f"flashmm cannot honour generate(..., assistant_tokenizer=...): {_refusal('assistant_model')}")
    has_default_max_length = (kwargs.get("max_length") is None and (generation_config is None or
                              generation_config.max_length is None) and model.generation_config.max_length is None)
    has_default_min_length = (kwargs.get("min_length") is None and (generation_config is None or
                              generation_config.min_length is None) and model.generation_config.min_length is None)
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    mode = config.get_generation_mode()
    if mode in _MODE_ERRORS:
        raise ValueError(f"flashmm cannot honour {_MODE_ERRORS[mode]}; call model.generate for it")
    for name in ("output_attentions", "output_hidden_states"):
        if getattr(config, name):
            raise ValueError(f"flashmm cannot honour {name}=True (its forwards score draft trees, not single "
                             "tokens); call model.generate for attentions or hidden states")
    if config.token_healing:
        raise ValueError("flashmm cannot honour token_healing=True; heal the prompt first or call model.generate")
    if config.guidance_scale is not None and config.guidance_scale != 1:
        raise ValueError("flashmm cannot honour guidance_scale (classifier-free guidance runs a second, unconditional "
                         "decoding beside the speculative one); call model.generate for it")
    model._validate_model_kwargs(model_kwargs.copy())
    for key in _OWN_KEYS:
        if model_kwargs.get(key) is not None:
            raise ValueError(f"flashmm cannot honour generate(..., {key}=...): it builds its own cache, positions and "
                             "inputs for speculative forwards; pass input_ids (and attention_mask) only")

    kwargs_has_mask = model_kwargs.get("attention_mask") is not None
    input_ids, input_name, model_kwargs = model._prepare_model_inputs(inputs, config.bos_token_id, model_kwargs)
    if input_name != "input_ids" or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError("flashmm needs input_ids as a non-empty LongTensor [batch, seq_len]; got "
                         f"{input_name} of shape {tuple(input_ids.shape)}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got a {input_ids.dtype} tensor")
    # model.generate takes any integer dtype (int32 from numpy or ONNX tokenizers) and returns int64 ids
    input_ids = input_ids.long()
    device = input_ids.device
    model._prepare_special_tokens(config, kwargs_has_mask, device=device, batch_size=input_ids.shape[0])
    if not kwargs_has_mask:
        model_kwargs["attention_mask"] = model._prepare_attention_mask_for_generation(input_ids, config, model_kwargs)
    mask = model_kwargs["attention_mask"]
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be [batch, seq_len] = {tuple(input_ids.shape)}, got {tuple(mask.shape)}")
    empty = (mask == 0).all(1).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask row(s) {empty} are all zeros: such a row has no prompt token to condition "
                         "on (an empty prompt padded to the batch's length?), and model.generate decodes it with every "
                         "prompt position masked out, which flashmm does not reproduce; drop the row, or give it at "
                         "least one token (e.g. the BOS token)")
    right = (mask[:, -1] == 0).nonzero().flatten().tolist()
    if right:
        raise ValueError(f"attention_mask row(s) {right} have right padding; decoder-only generation needs left "
                         "padding (tokenizer.padding_side = 'left')")

    expand = config.num_return_sequences or 1
    extra = {k: v for k, v in model_kwargs.items()
             if k not in ("attention_mask", "use_cache") and v is not None}
    input_ids = input_ids.repeat_interleave(expand, dim=0)
    mask = mask.repeat_interleave(expand, dim=0)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    config = model._prepare_generated_length(config, has_default_max_length, has_default_min_length,
                                             "input_ids", input_ids.shape[1], input_ids)
    model._validate_generated_length(config, input_ids.shape[1], has_default_max_length)
    user_processors = logits_processor if logits_processor is not None else LogitsProcessorList()
    processors = []
    for row in range(input_ids.shape[0]):
        row_fn = None
        if prefix_allowed_tokens_fn is not None:  # the row's own batch id, not its position in a tree batch
            row_fn = functools.partial(_row_prefix_fn, prefix_allowed_tokens_fn, row)
        row_mask = mask[row : row + 1]
        built = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=input_ids.shape[1],
            encoder_input_ids=input_ids[row : row + 1], prefix_allowed_tokens_fn=row_fn,
            logits_processor=LogitsProcessorList(user_processors), device=device,
            model_kwargs={"attention_mask": None if bool((row_mask == 1).all()) else row_mask})
        _check_processors(built, user_processors)
        processors.append(built)
    stopping = model._get_stopping_criteria(config, stopping_criteria=stopping_criteria or StoppingCriteriaList(),
                                            tokenizer=tokenizer)
    return GenerationPlan(model=model, input_ids=input_ids, attention_mask=mask, model_inputs=extra,
                          config=config, processors=processors, stopping=stopping, streamer=streamer,
                          has_eos_criteria=any(hasattr(c, "eos_token_id") for c in stopping))


def finish(plan: GenerationPlan, rows: list[list[int]], row_scores: list[list[torch.Tensor]] | None,
           row_logits: list[list[torch.Tensor]] | None):
    """New tokens per row → what model.generate returns for the plan's settings.

    Rows that stopped early are right-filled with pad_token_id (as model.generate fills finished
    rows); their scores / logits at those steps are zeros (model.generate scores its pad inputs
    there, which flashmm never runs).
    """
    if plan.streamer is not None:
        plan.streamer.end()
    ids = plan.input_ids
    width = max((len(r) for r in rows), default=0)
    out = ids.new_full((ids.shape[0], ids.shape[1] + width), plan.pad_token_id)
    out[:, : ids.shape[1]] = ids
    for b, r in enumerate(rows):
        out[b, ids.shape[1] : ids.shape[1] + len(r)] = torch.tensor(r, dtype=out.dtype)
    if not plan.config.return_dict_in_generate:
        return out
    return GenerateDecoderOnlyOutput(sequences=out, scores=_steps(row_scores, width),
                                     logits=_steps(row_logits, width))


def _steps(per_row: list[list[torch.Tensor]] | None, width: int):
    """Per-row lists of [V] tensors → a tuple of ``width`` tensors [B, V] (zeros past a row's end)."""
    if per_row is None:
        return None
    first = next(t for r in per_row for t in r)
    out = []
    for step in range(width):
        out.append(torch.stack([r[step] if step < len(r) else first.new_zeros(first.shape) for r in per_row]))
    return tuple(out)


def _row_prefix_fn(fn, row: int, batch_id: int, ids: torch.Tensor):
    return fn(row, ids)


def _check_processors(built: LogitsProcessorList, user: LogitsProcessorList) -> None:
    """Refuse a processor transformers built that is not a pure function of (prefix, scores)."""
    user_ids = {id(p) for p in user}
    for proc in built:
        if id(proc) in user_ids or isinstance(proc, PREFIX_FREE + PREFIX_DEPENDENT):
            continue
        raise ValueError(f"flashmm cannot honour the setting that adds {type(proc).__name__} (it keeps state "
                         "across decoding steps, so scoring draft trees would change its output); "
                         "call model.generate for it")


def _refusal(name: str) -> str:
    return {
        "assistant_model": "assisted generation is what flashmm replaces: pass a flashmm drafter to "
                           "flashmm.wrap(model, drafter) instead",
        "negative_prompt_ids": "classifier-free guidance runs a second, unconditional decoding; call model.generate",
        "negative_prompt_attention_mask": "classifier-free guidance runs a second, unconditional decoding; "
                                          "call model.generate",
        "custom_generate": "a custom decoding loop replaces flashmm's; call model.generate",
        "synced_gpus": "flashmm decodes on one process per model; shard inputs across processes instead",
    }.get(name, "not supported")

