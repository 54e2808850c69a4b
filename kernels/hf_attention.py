"""Tree attention inside a Hugging Face model, through transformers' public interfaces.

``enable_tree_attention(model)`` registers one attention function under the name
``"spec_tree_attention"`` (``AttentionInterface``, plus ``sdpa_mask`` under the same name in
``AttentionMaskInterface`` so ordinary forwards build exactly the masks SDPA gets) and
switches the model to it with ``model.set_attn_implementation``. The function:

* runs transformers' own SDPA attention for every call that carries no tree arguments
  (prefill, plain decoding, vision towers), so those forwards are unchanged;
* runs tree attention when the model's forward received ``**tree_attention_kwargs(...)``:
  ``spec_tree`` (a ``TreeAttentionArgs``, reaching every attention layer through the
  ``**kwargs`` transformers 5 forwards) and ``attention_mask`` = the packed tree mask as an
  int32 [B, 1, N, W] tensor. A 4D mask is returned untouched by transformers' mask builders,
  so no dense [B, 1, N, P + N] mask is built or validated; the attention function reads the
  tree from ``spec_tree``.

Backends: "triton" (the kernel in attention.py; CUDA, or CPU under TRITON_INTERPRET=1)
and "torch" (SDPA with the dense boolean mask); "auto" picks triton on CUDA.
Sliding-window layers (the ``sliding_window`` kwarg models pass) hide prefix rows by position:
key k is visible from node i iff (prefix_len + depth_i) - k < window.

The name avoids "flash": transformers treats any implementation containing it as FlashAttention.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ATTENTION_NAME = "spec_tree_attention"
BACKENDS = ("auto", "triton", "torch")

__all__ = ["ATTENTION_NAME", "TreeAttentionArgs", "enable_tree_attention", "tree_attention_kwargs",
           "tree_attention_forward", "resolve_backend"]


@dataclass(frozen=True)
class TreeAttentionArgs:
    """What every attention layer needs for one tree-verification forward.

    tree_mask:    int32 [B, N, ceil(N/32)] packed ancestor mask (bit j%32 of word j//32 of row i).
    depth:        int32 [B, N] node depths (root 0), for sliding windows.
    max_depth:    int, the deepest node.
    prefix_len:   int P, cache rows before the tree (the KV the layer sees has P + N rows).
    prefix_start: int32 [B] first non-padding prefix row (left padding), or None.
    backend:      "triton" or "torch".
    """

    tree_mask: torch.Tensor
    depth: torch.Tensor
    max_depth: int
    prefix_len: int
    prefix_start: torch.Tensor | None
    backend: str


def resolve_backend(attention: str, device: torch.device | str) -> str:
    """Map "auto" | "triton" | "torch" to the backend used on ``device``."""
    if attention not in BACKENDS:
        raise ValueError(f"attention must be one of {BACKENDS}, got {attention!r}")
    device = torch.device(device)
    if attention == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if attention == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention='triton' needs a CUDA device (or TRITON_INTERPRET=1 for CPU "
                         f"testing); the model is on {device}. Use attention='auto' or 'torch'.")
    return attention


def enable_tree_attention(model: torch.nn.Module) -> str:
    """Register the tree attention function and switch ``model`` to it; returns the previous
    implementation name (pass it to ``model.set_attn_implementation`` to undo)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    text_config = model.config.get_text_config()
    previous = text_config._attn_implementation
    if previous != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    if text_config._attn_implementation != ATTENTION_NAME:
        raise TypeError(f"{type(model).__name__} cannot switch attention implementation (its modeling code "
                        "does not use transformers' AttentionInterface); use attention='torch' "
                        "(4D additive masks) with this model")
    return previous


def tree_attention_kwargs(tree, prefix_len: int, batch_size: int, device: torch.device | str, *,
                          backend: str = "auto", padding_mask: torch.Tensor | None = None) -> dict:
    """Model-forward keyword arguments for one tree-verification forward.

    tree:         TokenTree with N nodes (node 0 = root, not yet in the cache).
    prefix_len:   rows already in the cache (P); the forward appends the N tree rows.
    padding_mask: optional int/bool [B, >= P] 2D attention mask of the prefix (1 = real token);
                  only left padding is supported (the first real row per sequence is kept).
    Returns {"attention_mask": int32 [B, 1, N, W], "spec_tree": TreeAttentionArgs}; pass them
    with input_ids [B, N], position_ids (prefix_len + depth) and the cache to ``model(...)``.
    """
    device = torch.device(device)
    n = tree.num_nodes
    packed = tree.packed_mask.to(device)                               # [N, W]
    tree_mask = packed[None].expand(batch_size, *packed.shape)         # [B, N, W]
    depth = tree.depth.to(device=device, dtype=torch.int32)[None].expand(batch_size, n)
    prefix_start = None
    if padding_mask is not None:
        if padding_mask.ndim != 2 or padding_mask.shape[0] != batch_size or padding_mask.shape[1] < prefix_len:
            raise ValueError(f"padding_mask must be [B, >= prefix_len] = [{batch_size}, >= {prefix_len}], "
                             f"got {tuple(padding_mask.shape)}")
        real = padding_mask[:, :prefix_len].to(device) != 0
        prefix_start = torch.where(real.any(1), real.int().argmax(1), prefix_len).to(torch.int32)
    args = TreeAttentionArgs(tree_mask=tree_mask, depth=depth, max_depth=int(tree.max_depth),
                             prefix_len=int(prefix_len), prefix_start=prefix_start,
                             backend=resolve_backend(backend, device))
    return {"attention_mask": tree_mask[:, None], "spec_tree": args}


def _query_prefix_start(args: TreeAttentionArgs, sliding_window: int | None) -> torch.Tensor | None:
    """int32 [B, N] first visible prefix row per query, or None when all rows are visible."""
    start = None if args.prefix_start is None else args.prefix_start[:, None].expand_as(args.depth)
    if sliding_window is not None and args.prefix_len + args.max_depth >= sliding_window:
        if args.max_depth >= sliding_window:
            raise NotImplementedError(f"tree depth {args.max_depth} reaches past the sliding window "
                                      f"({sliding_window}); draft shallower trees")
        window_start = args.prefix_len + args.depth - sliding_window + 1
        start = window_start if start is None else torch.maximum(start, window_start)
    return None if start is None else start.to(torch.int32)


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           dropout: float = 0.0, scaling: float | None = None,
                           sliding_window: int | None = None, **kwargs):
    """AttentionInterface function. query [B, Hq, N, D]; key, value [B, Hkv, P + N, D] (after the
    cache update). Returns (attn_output [B, N, Hq, D], None) like transformers' sdpa function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    args: TreeAttentionArgs | None = kwargs.pop("spec_tree", None)
    if args is None:
        if attention_mask is not None and attention_mask.dtype == torch.int32:
            raise RuntimeError("a packed tree mask reached attention without its spec_tree argument: this "
                               "model's forward does not pass **kwargs to its attention layers; use "
                               "attention='torch' (4D additive masks) with it")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("tree attention supports neither logit soft-capping nor attention sinks; "
                                  "use attention='torch' with this model")
    bsz, _, n, _ = query.shape
    if key.shape[2] != args.prefix_len + n or args.tree_mask.shape[:2] != (bsz, n):
        raise ValueError(f"tree forward expected {args.prefix_len} cached + {n} new rows and a "
                         f"[{bsz}, {n}, W] tree mask; the layer sees {key.shape[2]} rows and "
                         f"{tuple(args.tree_mask.shape)} (is the cache length prefix_len?)")
    prefix_start = _query_prefix_start(args, sliding_window)
    if args.backend == "torch":
        from .attention import dense_tree_mask
        allowed = dense_tree_mask(args.tree_mask, args.prefix_len, prefix_start)[:, None]  # [B,1,N,P+N]
        return sdpa_attention_forward(module, query, key, value, allowed, dropout=dropout,
                                      scaling=scaling, **kwargs)
    from .attention import tree_attention
    out = query.new_empty(bsz, n, query.shape[1], query.shape[3])                       # [B, N, Hq, D]
    tree_attention(query, key, value, args.tree_mask, args.prefix_len, scaling, prefix_start,
                   out=out.transpose(1, 2))
    return out, None
