"""Any Hugging Face causal LM as a speculative target, with no per-model code.

Tree steps pass the model a 4D additive mask (prefix fully visible, tree by ancestry),
``position_ids = prefix_len + depth`` and our own ``DynamicCache``, all through the model's
public forward arguments. Sliding-window layers get a mask with the window applied (a dict
keyed by layer type when a model mixes full and sliding layers, as Gemma 3 does).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .. import cache as kv
from ..onednn import OneDNNLinears, resolve_linear_backend
from ..tree import TokenTree
from .base import Target, TargetOutput


class CausalLMTarget(Target):
    """Adapter for ``*ForCausalLM`` models (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, ...).

    Multimodal adapters subclass it and override ``prefill`` and ``tree_position_ids``.
    """

    def __init__(self, model: torch.nn.Module, attention: str = "auto", linear: str = "auto"):
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise TypeError(
                f"{type(model).__name__} has no language-model head; flashmm needs a causal LM "
                "(e.g. AutoModelForCausalLM) or a supported vision-language model")
        self.model = model
        self.text_config = model.config.get_text_config()
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.hidden_size = self.text_config.hidden_size
        from ..kernels import resolve_backend  # noqa: PLC0415 (imports no triton)

        self.backend = resolve_backend(attention, self.device)
        self.linear_backend = resolve_linear_backend(linear, model)
        self._linears = nullcontext()
        self._previous_attention = None
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

    #: chains are verified with the model's own causal mask unless positions are non-trivial
    explicit_chain_positions = False

    def start_sequence(self) -> None:
        """A fresh cache; with the Triton backend, the model's attention switched to the tree
        kernel for this generation only (release() restores the user's implementation); with
        the oneDNN linear backend, the layers its tree forwards route (see flashmm.onednn)."""
        self._cache = kv.new_cache()
        if self.linear_backend == "onednn":
            self._linears = OneDNNLinears(self.model)
        if self.backend == "triton" and self._previous_attention is None:
            from ..kernels import enable_tree_attention  # noqa: PLC0415

            self._previous_attention = enable_tree_attention(self.model)

    def prefill(self, input_ids, attention_mask, want_hidden, **model_inputs) -> TargetOutput:
        self.start_sequence()
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=self._cache,
                         use_cache=True, output_hidden_states=want_hidden, logits_to_keep=1, **model_inputs)
        hidden = out.hidden_states[-1] if want_hidden else None
        return TargetOutput(out.logits[:, -1:], hidden)

    def forward_tree(self, tokens: torch.Tensor, tree: TokenTree, want_hidden: bool) -> TargetOutput:
        """tokens [B, N] → logits [B, N, V] (and last-layer hidden [B, N, d])."""
        prefix_len = self.cache_len
        self._tree_prefix_len = prefix_len
        args = dict(input_ids=tokens, past_key_values=self._cache, use_cache=True,
                    output_hidden_states=want_hidden, **self.tree_forward_args(tree, prefix_len, tokens.shape[0]))
        with self._linears:
            out = self.model(**args)
        hidden = out.hidden_states[-1] if want_hidden else None
        return TargetOutput(out.logits, hidden)

    def tree_forward_args(self, tree: TokenTree, prefix_len: int, batch_size: int) -> dict:
        """Mask and position arguments of one tree forward (public model-forward kwargs only)."""
        if self.backend == "triton":
            from ..kernels import tree_attention_kwargs  # noqa: PLC0415

            return dict(position_ids=self.tree_position_ids(tree, prefix_len, batch_size),
                        **tree_attention_kwargs(tree, prefix_len, batch_size, self.device, backend="triton"))
        if tree.is_chain and self._window is None and not self.explicit_chain_positions:
            return {}  # a chain needs nothing but the model's own causal mask
        return dict(attention_mask=self.tree_attention_mask(tree, prefix_len),
                    position_ids=self.tree_position_ids(tree, prefix_len, batch_size))

    def commit(self, path: torch.Tensor) -> None:
        if self.backend == "triton":
            kv.keep_rows_kernel(self._cache, self._tree_prefix_len, path)
        else:
            kv.keep_rows(self._cache, self._tree_prefix_len, path)

    def release(self) -> None:
        """Drop the cache and give the model back its own attention implementation."""
        self._cache = None
        if self._previous_attention is not None:
            self.model.set_attn_implementation(self._previous_attention)
            self._previous_attention = None

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
