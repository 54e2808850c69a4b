"""Any Hugging Face causal LM as a speculative target, with no per-model code.

Tree steps pass the model a 4D additive mask (prefix fully visible, tree by ancestry),
``position_ids = prefix_len + depth`` and our own ``DynamicCache``, all through the model's
public forward arguments. Sliding-window layers get a mask with the window applied (a dict
keyed by layer type when a model mixes full and sliding layers, as Gemma 3 does).
"""
from __future__ import annotations

import torch

from .. import cache as kv
from ..tree import TokenTree
from .base import Target, TargetOutput


class CausalLMTarget(Target):
    """Adapter for ``*ForCausalLM`` models (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, ...).

    Multimodal adapters subclass it and override ``prefill`` and ``tree_position_ids``.
    """

    def __init__(self, model: torch.nn.Module, attention: str = "auto"):
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise TypeError(
                f"{type(model).__name__} has no language-model head; flashmm needs a causal LM "
                "(e.g. AutoModelForCausalLM) or a supported vision-language model")
        self.model = model
        self.text_config = model.config.get_text_config()
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.hidden_size = self.text_config.hidden_size
        self.attention = attention
        self._cache = None
        self._tree_prefix_len = None
        layer_types = getattr(self.text_config, "layer_types", None) or []
        window = getattr(self.text_config, "sliding_window", None)
        if not layer_types and window and getattr(self.text_config, "use_sliding_window", True):
            layer_types = ["sliding_attention"]
        self._mask_types = sorted(set(layer_types)) or ["full_attention"]
        self._window = window

    # ------------------------------------------------------------------ lifecycle
    @property
    def cache_len(self) -> int:
        return 0 if self._cache is None else kv.cache_len(self._cache)

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    def prefill(self, input_ids, attention_mask, want_hidden, **model_inputs) -> TargetOutput:
        self._cache = kv.new_cache()
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=self._cache,
                         use_cache=True, output_hidden_states=want_hidden, logits_to_keep=1, **model_inputs)
        hidden = out.hidden_states[-1] if want_hidden else None
        return TargetOutput(out.logits[:, -1:], hidden)

    def forward_tree(self, tokens: torch.Tensor, tree: TokenTree, want_hidden: bool) -> TargetOutput:
        """tokens [B, N] → logits [B, N, V] (and last-layer hidden [B, N, d])."""
        prefix_len = self.cache_len
        self._tree_prefix_len = prefix_len
        args = dict(input_ids=tokens, past_key_values=self._cache, use_cache=True,
                    output_hidden_states=want_hidden)
        if not tree.is_chain or self._window is not None:
            # A chain needs nothing but the model's own causal mask; a tree needs ours.
            args["attention_mask"] = self.tree_attention_mask(tree, prefix_len)
            args["position_ids"] = self.tree_position_ids(tree, prefix_len, tokens.shape[0])
        out = self.model(**args)
        hidden = out.hidden_states[-1] if want_hidden else None
        return TargetOutput(out.logits, hidden)

    def commit(self, path: torch.Tensor) -> None:
        kv.keep_rows(self._cache, self._tree_prefix_len, path)

    def release(self) -> None:
        """Drop the cache (frees memory between generations)."""
        self._cache = None

    # ------------------------------------------------------------------ masks and positions
    def tree_position_ids(self, tree: TokenTree, prefix_len: int, batch_size: int) -> torch.Tensor:
        """LongTensor [B, N]: prefix_len + depth."""
        return tree.positions(prefix_len).to(self.device)[None].expand(batch_size, -1)

    def tree_attention_mask(self, tree: TokenTree, prefix_len: int):
        """4D additive mask [1, 1, N, prefix_len + N], or a dict of them by layer type."""
        dtype = self.model.dtype
        full = tree.attention_bias(prefix_len, dtype, self.device)
        masks = {}
        for layer_type in self._mask_types:
            if layer_type == "sliding_attention" and self._window is not None:
                masks[layer_type] = self._apply_window(full, tree, prefix_len)
            else:
                masks[layer_type] = full
        if len(masks) == 1:
            return next(iter(masks.values()))
        return masks

    def _apply_window(self, bias: torch.Tensor, tree: TokenTree, prefix_len: int) -> torch.Tensor:
        # HF sliding windows: key position k is visible from query position q iff q - k < window.
        q_pos = tree.positions(prefix_len).to(bias.device)  # [N]
        k_pos = torch.cat([torch.arange(prefix_len, device=bias.device), q_pos])  # [P+N]
        outside = (q_pos[:, None] - k_pos[None, :]) >= self._window
        return bias.masked_fill(outside[None, None], torch.finfo(bias.dtype).min)
