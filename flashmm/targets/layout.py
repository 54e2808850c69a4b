"""Which keys each attention layer of a model sees, read from its config as transformers reads it.

transformers 5.x decides a layer's attention pattern from the (text) config in one way, shared by the
masks ``generate`` builds (``masking_utils.create_masks_for_generate``, and the forwards of models
without ``layer_types``, e.g. Mistral, Qwen3-MoE, Phi-3: ``create_sliding_window_causal_mask`` whenever
``config.sliding_window`` is not None) and by the cache it builds (``cache_utils.get_layer_types_and_kwargs``):

1. ``layer_types`` when the config has them ("full_attention", "sliding_attention", "chunked_attention", ...);
2. else every layer slides when ``sliding_window`` is not None;
3. else every layer is chunked when ``attention_chunk_size`` is not None;
4. else every layer attends to the whole causal prefix.

``use_sliding_window`` is not read there: configs that have it (Qwen2, Qwen3, Qwen3-MoE, ...) apply it once,
in their constructor, by setting ``sliding_window`` to None; a config edited after loading keeps the window it
was given, and ``generate`` applies it. A model whose own forward reads its config another way (e.g. one
that never applies a window its config names) gives other logits than flashmm's masks on a prompt longer
than that window: ``longest_window`` sizes the self-check's prompt (flashmm.targets.support) to catch it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SLIDING, CHUNKED, FULL = "sliding_attention", "chunked_attention", "full_attention"


@dataclass(frozen=True)
class AttentionLayout:
    """The attention patterns of a model's layers.

    mask_types: the layer types a tree forward passes masks for, sorted ("full_attention", ...).
    window:     a sliding layer's query at position q sees keys at positions k with q - window < k <= q;
                None when no layer slides.
    chunk:      a chunked layer's query at position q sees keys at k <= q with k // chunk == q // chunk
                (positions counted from the row's first real token); None when no layer is chunked.
    """

    mask_types: tuple[str, ...]
    window: int | None
    chunk: int | None

    @property
    def restricted(self) -> bool:
        """Whether some layer sees less than the whole causal prefix (a window or a chunk applies)."""
        return (SLIDING in self.mask_types and self.window is not None) or \
            (CHUNKED in self.mask_types and self.chunk is not None)

    def visible(self, layer_type: str, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """BoolTensor [..., Q, K]: whether a query at q_pos [..., Q] may see a key at k_pos [..., K] under
        ``layer_type``'s window or chunk (causality and tree ancestry are the caller's); None when the
        layer type restricts nothing."""
        if layer_type == SLIDING and self.window is not None:
            return (q_pos[..., :, None] - k_pos[..., None, :]) < self.window
        if layer_type == CHUNKED and self.chunk is not None:
            return torch.div(q_pos[..., :, None], self.chunk, rounding_mode="floor") == \
                torch.div(k_pos[..., None, :], self.chunk, rounding_mode="floor")
        return None


def attention_layout(text_config) -> AttentionLayout:
    """The AttentionLayout transformers gives ``text_config`` (the module docstring's rules)."""
    window = getattr(text_config, "sliding_window", None)
    chunk = getattr(text_config, "attention_chunk_size", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        layer_types = [SLIDING if window is not None else CHUNKED if chunk is not None else FULL]
    return AttentionLayout(mask_types=tuple(sorted(set(layer_types))) or (FULL,), window=window, chunk=chunk)


def longest_window(config) -> int | None:
    """The longest sliding window or attention chunk ``config`` (or its text config) names, whatever its
    layers use (None when it names none): a prompt longer than this shows whether the model's forward
    applies it as flashmm does."""
    named = [getattr(part, key, None) for part in (config, config.get_text_config())
             for key in ("sliding_window", "attention_chunk_size")]
    sizes = [size for size in named if isinstance(size, int) and not isinstance(size, bool) and size > 0]
    return max(sizes, default=None)
