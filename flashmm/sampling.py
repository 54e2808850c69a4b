"""How scores become the distribution decoded from: transformers' own logits processors.

``SamplingParams`` carries the processors ``model.generate`` would build for the same settings
(transformers' classes, in transformers' order) and applies them to the scores of *any*
position, given that position's own prefix: a tree node's prefix is the committed text plus
the node's path. Greedy decoding takes the argmax of the processed scores, sampling draws from
their softmax, exactly as ``GenerationMixin._sample`` does at each step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation import logits_process as lp

# Processors that read only the scores, never the prefix: applied to all positions in one call.
PREFIX_FREE = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper,
               lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper, lp.TopHLogitsWarper,
               lp.LogitNormalization, lp.InfNanRemoveLogitsProcessor, lp.SuppressTokensLogitsProcessor)
# Processors that are pure functions of (prefix, scores): applied position by position.
PREFIX_DEPENDENT = (lp.RepetitionPenaltyLogitsProcessor, lp.NoRepeatNGramLogitsProcessor,
                    lp.SequenceBiasLogitsProcessor, lp.MinLengthLogitsProcessor,
                    lp.MinNewTokensLengthLogitsProcessor, lp.PrefixConstrainedLogitsProcessor,
                    lp.ForcedBOSTokenLogitsProcessor, lp.ForcedEOSTokenLogitsProcessor,
                    lp.ExponentialDecayLengthPenalty, lp.SuppressTokensAtBeginLogitsProcessor,
                    lp.WatermarkLogitsProcessor)


def warpers(temperature: float, top_k: int | None, top_p: float | None) -> lp.LogitsProcessorList:
    """transformers' warpers for temperature → top-k → top-p, built as ``_get_logits_processor`` does."""
    out = lp.LogitsProcessorList()
    if temperature != 1.0:
        out.append(lp.TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        out.append(lp.TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        out.append(lp.TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return out


@dataclass(frozen=True)
class SamplingParams:
    """How the target decodes: greedy or sampling, and the score processors.

    do_sample=False is greedy: argmax of the processed scores. temperature / top_k / top_p are
    the usual warpers (transformers' classes, its order); they apply only when sampling.
    processors: the complete processor list (a ``LogitsProcessorList``) when built from a
      GenerationConfig (``flashmm.engine.generation``: repetition penalty, min_p, bad words, ...); None
      builds it from temperature / top_k / top_p. The same list is applied to the target's p and
      to a sampling drafter's q.
    row_prefix: LongTensor [P] or None; tokens every prefix handed to the processors starts with
      (a batch row's left padding: the processors then see what ``model.generate`` shows them).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    processors: lp.LogitsProcessorList | None = field(default=None, compare=False, repr=False)
    row_prefix: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when do_sample=True, got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative int or None, got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.processors is None:
            built = warpers(self.temperature, self.top_k, self.top_p) if self.do_sample else lp.LogitsProcessorList()
            object.__setattr__(self, "processors", built)

    @property
    def is_plain(self) -> bool:
        """True when scores are the raw logits (no processor at all)."""
        return len(self.processors) == 0

    @property
    def needs_prefix(self) -> bool:
        return any(not isinstance(p, PREFIX_FREE) for p in self.processors)

    def plain(self) -> "SamplingParams":
        """The same decoding mode with no processors: for scores that are already processed."""
        return SamplingParams(do_sample=self.do_sample)

    def scores(self, logits: torch.Tensor, prefixes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Processed float32 scores [R, V] of logits [R, V].

        prefixes: R LongTensors [T_r] (on logits' device), the tokens before each position (the
        position's input_ids in ``model.generate``, without ``row_prefix``, which is prepended
        here); needed only when a processor reads the prefix.
        """
        x = logits.float().clone()
        if self.is_plain:
            return x
        if prefixes is not None and self.row_prefix is not None and self.row_prefix.numel():
            pad = self.row_prefix.to(x.device)
            prefixes = [torch.cat([pad, p]) for p in prefixes]
        for proc in self.processors:
            if isinstance(proc, PREFIX_FREE):
                x = proc(x.new_zeros((x.shape[0], 0), dtype=torch.long), x)
                continue
            if prefixes is None:
                raise ValueError(f"{type(proc).__name__} reads the prefix; pass prefixes to SamplingParams.scores")
            x = torch.cat([proc(p[None], x[r : r + 1]) for r, p in enumerate(prefixes)])
        return x

    def probs(self, logits: torch.Tensor, prefixes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """float32 [R, V]: softmax of the processed scores, or one-hot argmax when greedy."""
        x = self.scores(logits, prefixes)
        if not self.do_sample:
            return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
        return x.softmax(-1)


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed float32 scores of logits [..., V] for prefix-free params (removed entries -inf)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return params.scores(flat).view(logits.shape)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 probabilities [..., V] of the sampling distribution (one-hot argmax when greedy),
    for prefix-free params (the engine processes prefix-dependent scores before verifying)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return params.probs(flat).view(logits.shape)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row from probs [..., V] → LongTensor [...] on probs' device.

    The generator may live on another device than probs (a CPU generator with a CUDA model):
    the draw then happens on the generator's device and the token comes back to probs' device.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    if generator is not None and generator.device != flat.device:
        flat = flat.to(generator.device)
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.to(probs.device).view(probs.shape[:-1])
