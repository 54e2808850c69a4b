"""The target-adapter protocol: everything the engine needs from a model, nothing more.

Per-family knowledge (positions, visual spans, where hidden features come from) lives in one
adapter per family; the engine only calls the methods below.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tree.token_tree import TokenTree
from .verify_cost import measure_verify_cost


@dataclass
class TargetOutput:
    """logits: FloatTensor [B, N, V] (N = 1 after prefill: the last prompt position);
    hidden_states: FloatTensor [B, N', d] last-layer features or None (prefill: all T prompt
    positions; tree step: the N tree nodes);
    input_embeds: a multimodal prefill's (asked for hidden states): the embeddings its language model
    consumed [B, T, d], visual features merged in, else None;
    last_attention: a prefill's (asked for it): FloatTensor [B, T], float32, the attention of the last prompt
    position over the prompt, mean over layers and heads (flashmm.targets.last_attention), else None."""

    logits: torch.Tensor
    hidden_states: torch.Tensor | None = None
    input_embeds: torch.Tensor | None = None
    last_attention: torch.Tensor | None = None


@dataclass
class SequenceStart:
    """What a drafter learns when a new sequence starts: the values a target's prefill returns for one row.

    input_ids:      LongTensor [B, T]; the prompt (multimodal placeholders already expanded).
    hidden_states:  FloatTensor [B, T, d] or None; target last-layer features of the prompt
                    (only filled when the drafter sets needs_hidden_states); [B, T, n * d] when it
                    sets feature_layers (n indices): those output_hidden_states, concatenated.
    input_embeds:   FloatTensor [B, T, d] or None; the target's input embeddings of the prompt,
                    visual features at the visual positions (multimodal targets; hidden drafters).
    visual_spans:   list of (start, end) half-open index ranges of visual tokens in input_ids.
    model_inputs:   the extra model inputs given to generate (pixel_values, image_grid_thw, ...).
    last_attention: FloatTensor [B, T] (float32) or None; the target's attention from the last prompt
                    position over the prompt's positions, mean over its attention layers and query heads
                    (each row sums to 1; flashmm.targets.last_attention), read off the prefill's own
                    forward; only filled when the drafter sets needs_last_attention.
    """

    input_ids: torch.Tensor
    hidden_states: torch.Tensor | None = None
    input_embeds: torch.Tensor | None = None
    visual_spans: list[tuple[int, int]] = field(default_factory=list)
    model_inputs: dict = field(default_factory=dict)
    last_attention: torch.Tensor | None = None



def select_hidden(hidden_states, want) -> torch.Tensor | None:
    """A forward's ``output_hidden_states`` tuple → what the drafter asked for (``want``, see
    drafters.base.hidden_request): None when falsy, the last entry [B, N, d] when True, else the
    entries at the indices ``want`` concatenated on the feature axis [B, N, len(want) * d]."""
    if not want:
        return None
    if want is True:
        return hidden_states[-1]
    return torch.cat([hidden_states[i] for i in want], dim=-1)


class Target:
    """A wrapped model plus its KV cache for one generation.

    Lifecycle per sequence: prefill(...) once, then repeatedly forward_tree(tokens, tree)
    (appends N nodes after the cache_len rows held before it) and commit(path, that cache_len)
    (keeps only the accepted nodes). Each call returns what it computed; none leaves a value for a
    later call to find.
    """

    model: torch.nn.Module
    vocab_size: int
    hidden_size: int
    #: the backend of the tree forwards' linear layers ("torch" or "onednn", see flashmm.targets.onednn)
    linear_backend: str = "torch"
    #: why the model's forwards do not run flashmm's fused step (flashmm.targets.fused); None: they do
    unfused: str | None = "only a causal-LM target's text forwards are fused"

    # --- sequence lifecycle -------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                want_hidden: bool, want_attention: bool = False, **model_inputs) -> TargetOutput:
        """Run the prompt [B, T]; cache holds T positions afterwards; logits [B, 1, V]; with want_attention,
        last_attention [B, T] too."""
        raise NotImplementedError

    def forward_tree(self, tokens: torch.Tensor, tree: TokenTree, want_hidden: bool) -> TargetOutput:
        """Score tokens [B, N] laid out as ``tree`` after the cache; cache grows by N."""
        raise NotImplementedError

    def commit(self, path: torch.Tensor, prefix_len: int) -> None:
        """Keep the cache rows of the accepted nodes path [B, L] (root first) of the tree forwarded after
        ``prefix_len`` cached rows (``cache_len`` before that forward)."""
        raise NotImplementedError

    @property
    def cache_len(self) -> int:
        raise NotImplementedError

    # --- facts drafters may need ----------------------------------------------------
    def input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def output_embeddings(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def verify_cost(self, batch: int = 1):
        """The seconds of one forward of N tree tokens after a cached prefix, on this machine and
        through this target's linear backend (flashmm.tree.cost.VerifyCost; measured once
        per model, device, dtype, threads, backend and batch, then read from the disk cache); per
        row when ``batch`` rows are forwarded together. Raises what the model raises when its
        cache cannot be timed this way."""
        linear = "fused" if self.unfused is None else self.linear_backend
        return measure_verify_cost(self.model, linear=linear, batch=batch)

    def prompt_features(self, input_ids: torch.Tensor, input_embeds: torch.Tensor | None = None, **model_inputs):
        """(input_embeds [B,T,d] with visual features merged, visual_spans) for drafters that
        need them; text targets return (embeddings, []). ``input_embeds``: what a prefill of this
        prompt returned (``TargetOutput.input_embeds``), used instead of a second vision pass."""
        return self.input_embeddings()(input_ids), []
