"""Run a slice of a decoder-only model's own layers: the building block of self-speculation.

``LayerRunner(model)`` exposes the pieces of a Llama-like ``*ForCausalLM`` (embedding, rotary
embedding, decoder layers, final norm, LM head) so a caller can run layers [a, b) on a given
``DynamicCache`` (each layer reads and appends its own entry, ``cache.layers[i]``), with a 4D
additive mask (prefix visible, tree by ancestry: what flashmm.targets.text builds), position
ids and the model's rotary embeddings; then the final norm + LM head on any layer's output.
Run over every layer it equals the model's own forward (tests/test_self_spec.py, fp32).

Every sub-layer can be skipped (SWIFT): ``skip_attention`` / ``skip_mlp`` hold the layer indices
whose attention / MLP block is replaced by the identity (the residual passes through, and a layer
whose attention is skipped neither reads nor writes its cache entry).

Only the families whose decoder layer is exactly ``x + attn(norm(x))`` then ``x + mlp(norm(x))``
with one final norm are accepted (SUPPORTED below); others raise naming them.
"""
from __future__ import annotations

from collections.abc import Collection

import torch
from transformers import DynamicCache

from ..tree.token_tree import TokenTree
from . import cache as kv
from .layout import SLIDING, attention_layout

#: model_type of the families whose layers LayerRunner composes (pre-norm attention + MLP, one final norm)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def check_supported(model: torch.nn.Module) -> None:
    """Raise ValueError unless ``model`` is a text causal LM of a family LayerRunner can slice."""
    model_type = getattr(model.config, "model_type", None)
    inner = getattr(model, "model", None)
    if model_type not in SUPPORTED or not all(hasattr(inner, a) for a in ("layers", "norm", "rotary_emb")):
        raise ValueError(f"self-speculation runs the target's own layers one by one and supports the decoder-only "
                         f"families {SUPPORTED} (Llama / SmolLM2, Mistral, Qwen2, Qwen3); got "
                         f"{type(model).__name__} (model_type {model_type!r}): use another drafter for it")


class LayerRunner:
    """The layers of a supported ``*ForCausalLM``, callable in slices (no copies of its weights)."""

    def __init__(self, model: torch.nn.Module):
        check_supported(model)
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers[: model.config.num_hidden_layers])
        self.lm_head = model.get_output_embeddings()
        # the sliding window read as generate reads it (flashmm.targets.layout), applied to every layer: these
        # masks serve drafting only (a model that mixes full and sliding layers drafts through approximate masks;
        # the target verifies with its exact ones)
        layout = attention_layout(model.config)
        self.window = layout.window if SLIDING in layout.mask_types else None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] → input embeddings [B, T, d]."""
        return self.inner.embed_tokens(input_ids)

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        """(cos, sin) of position_ids [B, T] for hidden [B, T, d]: computed once, shared by every layer."""
        return self.inner.rotary_emb(hidden, position_ids=position_ids)

    def run(self, hidden: torch.Tensor, start: int, end: int, cache: DynamicCache | None,
            attention_mask: torch.Tensor | dict | None, position_ids: torch.Tensor,
            rotary=None, skip_attention: Collection[int] = (), skip_mlp: Collection[int] = ()) -> torch.Tensor:
        """Layers [start, end) on hidden [B, T, d] → [B, T, d].

        cache: layer i reads rows [0, P) of cache.layers[i] and appends the T new rows (None: no cache).
        attention_mask: additive float [B or 1, 1, T, P + T], or a dict of them by layer type
          ("full_attention" / "sliding_attention"); None only for T == 1 (attends to everything).
        position_ids: LongTensor [B, T]; rotary: rotary(hidden, position_ids) if already computed.
        """
        if attention_mask is None and hidden.shape[1] > 1:
            raise ValueError("LayerRunner.run needs an explicit mask for more than one query row "
                             "(build it with causal_bias or TokenTree.attention_bias)")
        rotary = self.rotary(hidden, position_ids) if rotary is None else rotary
        for index in range(start, end):
            layer = self.layers[index]
            if index not in skip_attention:
                mask = attention_mask
                if isinstance(mask, dict):
                    mask = mask[getattr(layer, "attention_type", "full_attention")]
                attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden), attention_mask=mask,
                                              position_ids=position_ids, use_cache=cache is not None,
                                              position_embeddings=rotary,
                                              **{kv.cache_argument(layer.self_attn): cache})
                hidden = hidden + attended
            if index not in skip_mlp:
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Any layer's output [B, T, d] → the model's final norm + LM head → logits [B, T, V]."""
        return self.lm_head(self.inner.norm(hidden))

    def tree_mask(self, tree: TokenTree, prefix_len: int) -> torch.Tensor:
        """Additive mask [1, 1, N, prefix_len + N] of ``tree`` after a prefix (sliding window applied)."""
        bias = tree.attention_bias(prefix_len, self.dtype, self.device)
        if self.window is None:
            return bias
        q_pos = tree.positions(prefix_len).to(self.device)  # [N]
        k_pos = torch.cat([torch.arange(prefix_len, device=self.device), q_pos])  # [P + N]
        outside = (q_pos[:, None] - k_pos[None, :]) >= self.window
        return bias.masked_fill(outside[None, None], torch.finfo(bias.dtype).min)

    def causal_mask(self, length: int, prefix_len: int) -> torch.Tensor:
        """Additive mask [1, 1, length, prefix_len + length] of a chain of ``length`` rows."""
        return self.tree_mask(TokenTree.chain(length - 1), prefix_len)


def crop_layers(cache: DynamicCache, layers, length: int) -> None:
    """Truncate the cache entries of ``layers`` (indices) to their first ``length`` rows."""
    for index in layers:
        if index >= len(cache.layers):
            continue
        layer = cache.layers[index]
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def layer_len(cache: DynamicCache, index: int) -> int:
    """Rows held by cache entry ``index`` (0 if it has none yet)."""
    if index >= len(cache.layers) or getattr(cache.layers[index], "keys", None) is None:
        return 0
    return cache.layers[index].keys.shape[2]
