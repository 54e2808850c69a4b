"""The target's attention from the last prompt position over the prompt, read off its own prefill.

SpecVLM-style drafters keep only the visual tokens the target attends to most (FlashDrafter's
``visual_keep``); they ask for it with ``Drafter.needs_last_attention`` and get, with the prefill's other
values, ``SequenceStart.last_attention``: FloatTensor [B, T], float32,

    a[b, t] = mean over the language model's attention layers l and query heads h of
              softmax_t(q_{l,h,T-1} · k_{l,h,t} · scaling + mask[T-1, t])

(each row sums to 1; positions a row may not see, its padding, get 0). The queries and keys are the ones the
model's attention computes anyway, after its own projections, norms and rotary embedding (1-D or multimodal),
and the keys are read per query head through the model's GQA grouping: nothing is recomputed outside the
model.

How: ``LastAttentionProbe(model)`` registers, through transformers' public interfaces, one attention
function per implementation it wraps (``spec_last_attention_sdpa``, ``spec_last_attention_eager``; each
with that implementation's mask builder in ``AttentionMaskInterface``). Inside ``probe.reading()`` the
language model's config names it, and the forward passes ``**reading.kwargs`` (transformers 5 hands a
model's extra keyword arguments to every attention call); each call runs the model's own implementation
unchanged (its outputs are bitwise those of a forward without the probe) and adds the last query's
probabilities to the reading. Leaving the block restores the implementation found on entry.

Cost: per attention layer, one [H, 1, hd] × [hd, T] product and a softmax over T in float32, no copy of
the keys (SmolLM2-135M on a 64-frame clip, T = 4,569: 5 MFLOP per layer, 0.16 GFLOP in all, against
about 1.7 TFLOP for the prefill's forward); on a CPU the prefill of a text model then runs the model's own
forward rather than flashmm's fused step. eval/mm_video_prune.py times it (flash against flash_keep1).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from .support import UnsupportedModel, architecture

PROBE_PREFIX = "spec_last_attention_"   # transformers treats names containing "flash" as FlashAttention
WRAPPED = ("sdpa", "eager")
KWARG = "last_attention_reading"


class LastAttentionReading:
    """What one probed forward adds up: the sum over attention layers of the head-mean last-query
    probabilities, ``total`` FloatTensor [B, S] (S: the keys the layers saw), and how many layers added."""

    def __init__(self, inner: str):
        self.inner = inner          # the implementation the model had: "sdpa" or "eager"
        self.total: torch.Tensor | None = None
        self.layers = 0

    @property
    def kwargs(self) -> dict:
        """The forward's extra keyword arguments that reach every attention call."""
        return {KWARG: self}

    def add(self, module, query: torch.Tensor, key: torch.Tensor, attention_mask, scaling: float | None,
            softcap: float | None) -> None:
        """query [B, H, Q, hd] (rotary applied), key [B, Hkv, S, hd] (the cache's, after this layer's update),
        attention_mask: a bool [B, 1, Q, S] (True: visible), an additive float one, or None (causal, aligned
        top-left as SDPA's is_causal: the last query sees keys 0 .. Q-1)."""
        batch, heads, _, dim = query.shape
        k = key.detach().float()                                                   # [B, Hkv, S, hd]
        if attention_mask is None:
            k = k[:, :, : query.shape[2]]
        # query head h reads KV head h // groups (transformers' repeat_kv): group the queries, copy no keys
        q = query[:, :, -1].detach().float().view(batch, k.shape[1], -1, dim)      # [B, Hkv, groups, hd]
        scale = scaling if scaling is not None else dim ** -0.5
        scores = ((q @ k.transpose(-1, -2)) * scale).view(batch, heads, 1, -1)     # [B, H, 1, S]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            row = attention_mask[..., -1:, : scores.shape[-1]]                     # [B or 1, 1 or H, 1, S]
            scores = scores.masked_fill(~row, float("-inf")) if row.dtype == torch.bool else scores + row.float()
        probs = scores.softmax(-1).mean(dim=1)[:, 0]                               # [B, S]
        if self.total is None:
            self.total = probs
        elif self.total.shape != probs.shape:
            raise UnsupportedModel(f"{type(module).__name__} attended over {probs.shape[1]} keys where an earlier "
                                   f"layer attended over {self.total.shape[1]}: the probe cannot line its "
                                   "attention up with the prompt's positions; use the drafter without visual_keep")
        else:
            self.total = self.total + probs
        self.layers += 1

    def mean(self, length: int) -> torch.Tensor:
        """FloatTensor [B, length]: the mean over layers of the head-mean attention of the last query over
        the first ``length`` keys (the prompt)."""
        if self.total is None:
            raise UnsupportedModel("the prefill forward made no attention call through transformers' "
                                   "AttentionInterface, so the target's last-position attention cannot be read; "
                                   "use the drafter without visual_keep")
        if self.total.shape[1] < length:
            raise UnsupportedModel(f"the attention layers saw {self.total.shape[1]} keys, fewer than the prompt's "
                                   f"{length} positions; use the drafter without visual_keep")
        return self.total[:, :length] / self.layers


def probed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as ``spec_last_attention_<impl>``: the model's own ``impl``
    on the same arguments, after adding the last query's probabilities to the reading the forward passed."""
    reading: LastAttentionReading = kwargs[KWARG]
    reading.add(module, query, key, attention_mask, scaling, kwargs.get("softcap"))
    inner = _implementation(module, reading.inner)
    return inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _implementation(module, name: str):
    """The attention function ``name`` the module would have called: transformers' registered one, or for
    "eager" the ``eager_attention_forward`` of the module's own modeling file (its default)."""
    from transformers import AttentionInterface  # noqa: PLC0415

    if name != "eager":
        return AttentionInterface()[name]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModel(f"{type(module).__name__}'s modeling file has no eager_attention_forward to run "
                               "under the last-position attention probe; load the model with "
                               "attn_implementation='sdpa'")
    return eager


class LastAttentionProbe:
    """Reads the last prompt position's attention during ``model``'s forward (see the module docstring).

    Built once per target; raises UnsupportedModel when the model's attention has parts the probe does not
    compute (attention sinks) or its modeling code does not call attention through AttentionInterface."""

    def __init__(self, model: torch.nn.Module):
        from transformers import AttentionInterface, PreTrainedModel  # noqa: PLC0415
        from transformers.masking_utils import AttentionMaskInterface  # noqa: PLC0415

        if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
            raise UnsupportedModel(f"{architecture(model)} has attention sinks, which the last-position attention "
                                   "probe does not add to its softmax; use the drafter without visual_keep")
        masks = AttentionMaskInterface()
        for name in WRAPPED:
            AttentionInterface.register(PROBE_PREFIX + name, probed_attention)
            AttentionMaskInterface.register(PROBE_PREFIX + name, masks[name])
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        decoder = model if decoder is None else decoder
        self.config = decoder.config
        # whether the modeling code reads AttentionInterface is for transformers to say (as TreeAttentionSwitch asks)
        touched = [(m.config, m.config._attn_implementation) for m in decoder.modules() if isinstance(m, PreTrainedModel)]
        try:
            decoder.set_attn_implementation(PROBE_PREFIX + "sdpa")
            routes = self.config._attn_implementation == PROBE_PREFIX + "sdpa"
        finally:
            for config, name in touched:
                config._attn_implementation = name
        if not routes:
            raise UnsupportedModel(f"{architecture(model)}'s language model does not call attention through "
                                   "transformers' AttentionInterface, so its last-position attention cannot be read; "
                                   "use the drafter without visual_keep")

    @contextmanager
    def reading(self):
        """Yields a LastAttentionReading; the forward run inside passes its ``kwargs``."""
        outside = self.config._attn_implementation
        if outside not in WRAPPED:
            raise ValueError(f"the last-position attention probe wraps the {' or '.join(WRAPPED)} attention "
                             f"implementations, and the model runs {outside!r}: load it with "
                             "attn_implementation='sdpa' (or 'eager') to use visual_keep")
        reading = LastAttentionReading(outside)
        self.config._attn_implementation = PROBE_PREFIX + outside
        try:
            yield reading
        finally:
            self.config._attn_implementation = outside
