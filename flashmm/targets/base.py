"""The target-adapter protocol: everything the engine needs from a model, nothing more.

Per-family knowledge (positions, visual spans, where hidden features come from) lives in one
adapter per family; the engine only calls the methods below.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..tree.token_tree import TokenTree


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
    target_cache:   one row decoded alone: ``with start.target_cache() as cache`` lends the target's
                    DynamicCache of this sequence for one draft (drafters that set needs_target_cache;
                    Target.drafting_cache); None where there is none to lend (a batch, CUDA graphs,
                    recurrent states).
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
    target_cache: Callable[[], AbstractContextManager] | None = None


@dataclass
class SequenceCache:
    """One sequence's cache for one generate call: made by the target's ``prefill``, handed back to its
    ``forward_tree`` and ``commit``, and owned by the call (flashmm.targets.session.SequenceSession), so
    nothing of a call stays on the target after it.

    kv:           the layers' cache: a DynamicCache, a graphs.SlotCache (CUDA graphs) or a
                  recurrent.RecurrentCache.
    verification: recurrent targets: the states' bookkeeping from a verification to its commit
                  (recurrent.RecurrentVerification); None elsewhere.
    rope_delta:   rope-index targets (Qwen-VL, GLM-4V, ...): after the prompt, the token at cache index i
                  has position i + rope_delta (in every rope axis); 0 for every other target.
    """

    kv: Any
    verification: Any = None
    rope_delta: int = 0

    @property
    def length(self) -> int:
        """Tokens of the sequence the cache stands for (a recurrent target's pending ones included)."""
        if self.verification is not None:
            return self.verification.length
        return self.kv.get_seq_length()



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
    """A wrapped model: every forward flashmm runs on it, and the layout of its caches.

    Lifecycle per sequence: ``out, seq = prefill(...)`` once, then repeatedly
    ``forward_tree(seq, tokens, tree)`` (appends N nodes after the ``seq.length`` rows held before it) and
    ``commit(seq, path, that length)`` (keeps only the accepted nodes). The sequence's state travels in
    ``seq`` (SequenceCache), which the caller owns: each call returns what it computed, and none leaves a
    value on the target for a later call to find.
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
                want_hidden: bool, want_attention: bool = False, **model_inputs) -> tuple[TargetOutput, SequenceCache]:
        """Run the prompt [1, T] → (its output: logits [1, 1, V], with want_attention last_attention [1, T] too;
        the sequence's cache, holding T positions)."""
        raise NotImplementedError

    #: what its drafters multiply their linear layers in, "fp32" or "bf16" (flashmm.targets.onednn.
    #: resolve_draft_precision; set by flashmm.wrap before the drafter binds)
    draft_precision: str = "fp32"

    def forward_tree(self, seq: SequenceCache, tokens: torch.Tensor, tree: TokenTree,
                     want_hidden: bool, argmax_only: bool = False) -> TargetOutput:
        """Score tokens [1, N] laid out as ``tree`` after ``seq``'s cache, which grows by N. argmax_only: only
        each node's argmax will be read; the logits may then be exact at the argmax alone
        (flashmm.targets.head_screen)."""
        raise NotImplementedError

    def commit(self, seq: SequenceCache, path: torch.Tensor, prefix_len: int) -> None:
        """Keep in ``seq`` the rows of the accepted nodes path [1, L] (root first) of the tree forwarded after
        ``prefix_len`` cached rows (``seq.length`` before that forward)."""
        raise NotImplementedError

    def lends_cache(self) -> bool:
        """Whether ``drafting_cache`` can lend a single sequence's cache to a drafter (self-speculation)."""
        return False

    def drafting_cache(self, seq: SequenceCache) -> AbstractContextManager:
        """``seq``'s DynamicCache lent for one draft, left as it was found on exit (see lends_cache)."""
        raise ValueError(f"{type(self).__name__} lends no cache to draft on")

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
        raise NotImplementedError

    def prompt_features(self, input_ids: torch.Tensor, input_embeds: torch.Tensor | None = None, **model_inputs):
        """(input_embeds [B,T,d] with visual features merged, visual_spans) for drafters that
        need them; text targets return (embeddings, []). ``input_embeds``: what a prefill of this
        prompt returned (``TargetOutput.input_embeds``), used instead of a second vision pass."""
        return self.input_embeddings()(input_ids), []
