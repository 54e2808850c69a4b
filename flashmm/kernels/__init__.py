"""Triton kernels for speculative verification, each beside its PyTorch reference.

Imported lazily: ``import flashmm.kernels`` does not import triton. Kernel modules are loaded on
first attribute access, so ``TRITON_INTERPRET=1`` (CPU testing) only has to be set before the
first kernel is used.

  tree_attention(q, k, v, tree_mask, prefix_len, ...)      attention.py
  verify_tree_greedy(tokens, parents, target_logits, ...)  verification.py
  verify_tree_sampling(tokens, parents, p, q, ...)         verification.py
  kv_keep(kv, prefix_len, path)                            compaction.py
  TreeAttentionSwitch(model), tree_attention_kwargs(...)   hf_attention.py
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "tree_attention": "attention",
    "tree_attention_ref": "attention",
    "dense_tree_mask": "attention",
    "verify_tree_greedy": "verification",
    "verify_tree_greedy_ref": "verification",
    "verify_tree_sampling": "verification",
    "verify_tree_sampling_ref": "verification",
    "draw_verify_randoms": "verification",
    "kv_keep": "compaction",
    "kv_keep_ref": "compaction",
    "TreeAttentionSwitch": "hf_attention",
    "TreeAttentionUnsupported": "hf_attention",
    "unsupported_features": "hf_attention",
    "fits_window": "hf_attention",
    "tree_attention_kwargs": "hf_attention",
    "resolve_backend": "hf_attention",
    "TreeAttentionArgs": "hf_attention",
    "tree_attention_forward": "hf_attention",
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
