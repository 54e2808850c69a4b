"""Triton kernels for speculative verification, each beside its PyTorch reference.

Imported lazily: ``import flashmm.kernels`` does not import triton. Kernel modules are loaded on
first attribute access, so ``TRITON_INTERPRET=1`` (CPU testing) only has to be set before the
first kernel is used.

  tree_attention(q, k, v, tree_mask, prefix_len, ...)      kernels/tree_attention.py
  verify_tree_greedy(tokens, parents, target_logits, ...)  kernels/verify_tree.py
  verify_tree_sampling(tokens, parents, p, q, ...)         kernels/verify_tree.py
  kv_keep(kv, prefix_len, path)                            kernels/kv_keep.py
  enable_tree_attention(model), tree_attention_kwargs(...) kernels/hf_attention.py
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "tree_attention": "tree_attention",
    "tree_attention_ref": "tree_attention",
    "dense_tree_mask": "tree_attention",
    "verify_tree_greedy": "verify_tree",
    "verify_tree_greedy_ref": "verify_tree",
    "verify_tree_sampling": "verify_tree",
    "verify_tree_sampling_ref": "verify_tree",
    "draw_verify_randoms": "verify_tree",
    "kv_keep": "kv_keep",
    "kv_keep_ref": "kv_keep",
    "enable_tree_attention": "hf_attention",
    "tree_attention_kwargs": "hf_attention",
    "resolve_backend": "hf_attention",
    "TreeAttentionArgs": "hf_attention",
    "ATTENTION_NAME": "hf_attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashmm.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
