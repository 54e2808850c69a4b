"""Speculative decoding of recurrent and hybrid models (Mamba, Mamba-2, Jamba, Bamba, Falcon-H1,
Zamba2, Nemotron-H, Qwen3-Next, Qwen3.5, Kimi-Linear, LFM2, OLMo-hybrid, ...): their caches hold,
beside per-token key/value rows, per-layer convolution windows and SSM / linear-attention states
that every forward overwrites in place with the state after its last token.

A verification forward therefore leaves those states *after the whole draft*, rejected tokens
included, and unlike key/value rows they cannot be cropped. Serving engines keep one state per
draft position (vLLM's ``selective_state_update`` / gated-delta-rule kernels with
``num_accepted_tokens``, SGLang's intermediate-state buffers and ``last_steps``), which needs
kernels that emit them; transformers' kernels return only the final state. So flashmm replays
(as TensorRT-LLM's Mamba-2 rollback does):

1. before a verification forward, snapshot the states (a copy of every conv / recurrent tensor);
2. when the whole draft is accepted, the states are already right: nothing more to do;
3. otherwise restore the snapshot, crop the attention rows back to it, and keep the accepted
   tokens as *pending*: the next verification forward runs them in front of its draft (their
   logits dropped), so the replay costs extra tokens in the next forward, not an extra forward.

Drafts are verified as chains (one forward). A branching tree is verified one root-to-leaf
branch per forward, each from the snapshot: exact, but a forward per leaf, so chains are what
to draft for these models. Models whose multi-token forward restarts the scan from a zero state
(transformers' Mamba-1 mixers: Mamba, Falcon-Mamba, Jamba) are found by ``self_check`` and
verified one token per forward (``stepwise``), keeping a snapshot after every token: exact, but
no faster than ``model.generate``.

Everything goes through transformers' cache API (``LinearAttentionCacheLayerMixin``: ``conv_states``,
``recurrent_states``, ``has_previous_state``); no per-model code.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionAndFullAttentionLayer,
                                      LinearAttentionAndSlidingWindowAttentionLayer, LinearAttentionCacheLayerMixin)

from .failures import MODEL_ERRORS, describe, raised_by_model


def generate_cache_layers(text_config) -> list:
    """The layers of the DynamicCache ``generate`` builds for ``text_config``; [] with a warning naming why
    when transformers cannot build one from this config (flashmm then assumes plain key/value layers, and
    its self-check compares the model's logits through them with the model's own)."""
    try:
        return list(DynamicCache(config=text_config).layers)
    except MODEL_ERRORS as error:
        if not raised_by_model(error):
            raise
        warnings.warn(f"transformers cannot build the cache generate would use from this {type(text_config).__name__} "
                      f"({describe(error)}): flashmm assumes plain key/value cache layers, which its self-check "
                      "then verifies", stacklevel=2)
        return []


def recurrent_layer_kinds(text_config) -> list[str]:
    """Names of the recurrent (conv / SSM / linear-attention) layer classes of the cache transformers
    builds for ``text_config`` ([] for a plain key/value model or, with a warning, a config DynamicCache cannot
    read)."""
    layers = generate_cache_layers(text_config)
    return sorted({type(layer).__name__ for layer in layers if isinstance(layer, LinearAttentionCacheLayerMixin)})


def is_recurrent(model: torch.nn.Module) -> bool:
    return bool(recurrent_layer_kinds(model.config.get_text_config(decoder=True)))


class RecurrentCache(DynamicCache):
    """transformers' DynamicCache for a hybrid / recurrent model, with every attention layer kept at
    full length (sliding windows are applied by the model's masks, not by eviction, so the rows of a
    rejected draft can be cropped) and ``length``: how many tokens the states have absorbed.
    """

    def __init__(self, text_config):
        super().__init__(config=text_config)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
                self.layers[i] = LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
            elif isinstance(layer, DynamicSlidingWindowLayer):
                self.layers[i] = DynamicLayer()
        self.counted = 0  # tokens run through the cache, as counted by its callers
        self.history: list[StateSnapshot] = []  # snapshots a drafter keeps to rewind to
        self._text_config = text_config

    @property
    def length(self) -> int:
        """Tokens the cache holds: its attention rows where it has any (whoever ran the forward),
        else the count its callers keep in ``counted``."""
        rows = [layer.keys.shape[-2] for layer in self.layers
                if getattr(layer, "keys", None) is not None and layer.keys.numel()]
        return max(rows) if rows else self.counted

    def snapshot(self) -> "StateSnapshot":
        """A copy of every recurrent state as it is now (attention rows are not copied: they are cropped)."""
        states = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                states.append((i, _copy(layer.conv_states), _copy(layer.recurrent_states),
                               dict(layer.has_previous_state)))
        return StateSnapshot(self.length, states)

    def rewind(self, length: int) -> int:
        """Go back to the latest snapshot in ``history`` at most ``length`` tokens long (drafters keep one
        after every forward); later and earlier ones are dropped (a drafter's text only grows past it).
        Returns the length the cache is at now (0, with fresh states, when no snapshot is that short)."""
        kept = [snap for snap in self.history if snap.length <= length]
        if not kept:  # back to an empty cache
            self.layers, self.counted, self.history = RecurrentCache(self._text_config).layers, 0, []
            return 0
        self.restore(kept[-1])
        self.history = [kept[-1]]
        return kept[-1].length

    def restore(self, snapshot: "StateSnapshot") -> None:
        """Bring the cache back to ``snapshot``: its recurrent states, attention rows cropped to its length."""
        for i, conv, recurrent, previous in snapshot.states:
            layer = self.layers[i]
            _write(layer.conv_states, conv)
            _write(layer.recurrent_states, recurrent)
            layer.has_previous_state.update(previous)
        for layer in self.layers:
            keys = getattr(layer, "keys", None)
            if keys is not None and keys.numel() and keys.shape[-2] > snapshot.length:
                layer.keys = layer.keys[:, :, : snapshot.length]
                layer.values = layer.values[:, :, : snapshot.length]
        self.counted = snapshot.length


@dataclass
class StateSnapshot:
    """length: tokens absorbed; states: (layer index, conv states, recurrent states, has_previous_state)
    per recurrent layer, each a {state index: tensor copy or None}."""

    length: int
    states: list


def _copy(states: dict) -> dict:
    return {k: None if v is None else v.clone() for k, v in states.items()}


def _write(states: dict, saved: dict) -> None:
    """Put saved tensors back; in place where the shape matches (layers keep static addresses)."""
    for k, v in saved.items():
        if v is None:
            continue
        if states.get(k) is not None and states[k].shape == v.shape:
            states[k].copy_(v)
        else:
            states[k] = v.clone()


class StateOutsideCache(ValueError):
    """A stateful model whose forward keeps its recurrence outside transformers' cache layers."""


def continues_state(model: torch.nn.Module, tokens: torch.Tensor, argument: str) -> float:
    """Largest relative gap between the recurrent states after tokens [1, T] in one forward and after
    the same tokens in two (T - 3, then 3): ~1e-6 when a multi-token forward continues the state it is
    given, O(1) when it restarts the scan from zero (transformers' Mamba-1 mixers). Compared on the
    states, not the logits: a tiny random model's logits can hide a lost state."""
    text_config = model.config.get_text_config(decoder=True)
    whole, split = RecurrentCache(text_config), RecurrentCache(text_config)
    model(input_ids=tokens, use_cache=True, **{argument: whole})
    model(input_ids=tokens[:, :-3], use_cache=True, **{argument: split})
    model(input_ids=tokens[:, -3:], use_cache=True, **{argument: split})
    if not any(t is not None for _, conv, rec, _ in whole.snapshot().states for t in [*conv.values(), *rec.values()]):
        raise StateOutsideCache("its forward left no state in transformers' conv / recurrent cache layers (it keeps its "
                         "recurrence elsewhere), so flashmm cannot snapshot and restore it")
    gap = 0.0
    for (_, *want), (_, *got) in zip(whole.snapshot().states, split.snapshot().states):
        for want_states, got_states in zip(want[:2], got[:2]):
            for k, w in want_states.items():
                if w is not None and got_states.get(k) is not None:
                    w, g = w.float(), got_states[k].float()
                    gap = max(gap, float((w - g).abs().max() / w.abs().max().clamp_min(1e-6)))
    return gap


# ---------------------------------------------------------------------------- verification
class RecurrentVerification:
    """The state bookkeeping of one sequence on a recurrent target (see the module docstring).

    ``run(tokens, want_hidden)`` is the target's forward of tokens [1, n] at the end of the cache (the
    cache then holds n more) → (logits [1, n, V], last-layer hidden [1, n, d] or None).
    """

    def __init__(self, cache: RecurrentCache, stepwise: bool):
        self.cache = cache
        self.stepwise = stepwise
        self.pending = None      # LongTensor [1, p]: accepted tokens the states have not absorbed yet
        self._base = None        # StateSnapshot before the last verification
        self._fed = None         # LongTensor [1, p + N]: pending tokens and the last draft's nodes
        self._num_nodes = 0      # N
        self._per_token = None   # stepwise: StateSnapshot after each fed token
        self._tree_ran = False

    @property
    def length(self) -> int:
        """Tokens of the sequence so far, pending ones included (the next root's position)."""
        return self.cache.length + (0 if self.pending is None else self.pending.shape[1])

    def forward(self, run, tokens: torch.Tensor, tree, want_hidden: bool):
        """tokens [1, N] laid out as ``tree`` → (logits [1, N, V], hidden [1, N, d] or None)."""
        self._base, self._want_hidden = self.cache.snapshot(), want_hidden
        pending = tokens[:, :0] if self.pending is None else self.pending
        self.pending, self._num_nodes = None, tokens.shape[1]
        if tree.is_chain:
            self._fed = torch.cat([pending, tokens], 1)
            self._tree_ran = False
            logits, hidden = self._run(run, self._fed)
            skip = pending.shape[1]
            return logits[:, skip:], None if hidden is None else hidden[:, skip:]
        # a branching tree: each root-to-leaf branch from the snapshot, in its own forward
        self._tree_ran = True
        logits = hidden = None
        parents = tree.parents.tolist()
        for leaf in _leaves(parents):
            branch = _branch(parents, leaf)  # node indices root → leaf
            self.cache.restore(self._base)
            out_logits, out_hidden = self._run(run, torch.cat([pending, tokens[:, branch]], 1))
            out_logits, index = out_logits[:, pending.shape[1]:], torch.tensor(branch, device=tokens.device)
            if logits is None:
                logits = out_logits.new_zeros(1, tokens.shape[1], out_logits.shape[-1])
                hidden = None if out_hidden is None else out_hidden.new_zeros(1, tokens.shape[1], out_hidden.shape[-1])
            logits[:, index] = out_logits
            if hidden is not None:
                hidden[:, index] = out_hidden[:, pending.shape[1]:]
        self._fed = torch.cat([pending, tokens], 1)
        return logits, hidden

    def _run(self, run, fed: torch.Tensor):
        if not self.stepwise:
            return run(fed, self._want_hidden)
        self._per_token = []
        outs = []
        for j in range(fed.shape[1]):
            outs.append(run(fed[:, j : j + 1], self._want_hidden))
            self._per_token.append(self.cache.snapshot())
        hidden = None if outs[0][1] is None else torch.cat([h for _, h in outs], 1)
        return torch.cat([lg for lg, _ in outs], 1), hidden

    def commit(self, path: torch.Tensor) -> None:
        """Leave the states after exactly the pending tokens and the accepted nodes path [1, L] (root first)."""
        skip = self._fed.shape[1] - self._num_nodes  # pending tokens run in front of the draft
        accepted = torch.cat([self._fed[:, :skip], self._fed[:, skip + path[0].to(self._fed.device)]], 1)
        if not self._tree_ran and accepted.shape[1] == self._fed.shape[1]:
            return  # a chain accepted whole: the states are already after it
        if self.stepwise and not self._tree_ran:
            self.cache.restore(self._per_token[accepted.shape[1] - 1])
            return
        self.cache.restore(self._base)
        self.pending = accepted


def _leaves(parents: list[int]) -> list[int]:
    has_child = set(parents[1:])
    return [v for v in range(len(parents)) if v not in has_child]


def _branch(parents: list[int], leaf: int) -> list[int]:
    out = []
    while leaf >= 0:
        out.append(leaf)
        leaf = parents[leaf]
    return out[::-1]
