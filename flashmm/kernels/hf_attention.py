"""Tree attention inside a Hugging Face model, through transformers' public interfaces.

``TreeAttentionSwitch(model)`` registers one attention function under the name
``"spec_tree_attention"`` (``AttentionInterface``; ``sdpa_mask`` under the same name in
``AttentionMaskInterface``) and, inside ``with switch:``, points the model's text attention at it.
Only tree forwards run inside the switch: the prefill, plain decoding and vision towers keep the
implementation the user loaded the model with (eager, sdpa, flash, ...).

A tree forward passes ``**tree_attention_kwargs(...)`` to the model: ``spec_tree`` (a
``TreeAttentionArgs``, reaching every attention layer through the ``**kwargs`` transformers 5
forwards) and ``attention_mask`` = the packed tree mask as an int32 [B, 1, N, W] tensor. A 4D
mask is returned untouched by transformers' mask builders, so no dense [B, 1, N, P + N] mask is
built or validated; the attention function reads the tree from ``spec_tree``.

Backends: "triton" (the kernel in attention.py; CUDA, or CPU under TRITON_INTERPRET=1)
and "torch" (SDPA with the dense boolean mask); "auto" picks triton on CUDA.
Sliding-window layers (the ``sliding_window`` kwarg models pass) hide prefix rows by position:
key k is visible from node i iff (prefix_len + depth_i) - k < window, which the kernel can do
while the tree is shallower than the window (``fits_window``). What the kernel cannot compute
(attention logit soft-capping, attention sinks) is found before generation by
``TreeAttentionSwitch``, which then raises ``TreeAttentionUnsupported`` naming the feature.

Batched decoding (flashmm.targets.batch) passes one tree per row, padded to the widest, and a prefix
with holes: ``prefix_valid`` [B, P] hides the slots a row does not use, and ``prefix_positions``
(the slots' position ids) place each row's window; since a row's real slots have increasing
positions, the window is still one lower bound per query, found by binary search.

The name avoids "flash": transformers treats any implementation containing it as FlashAttention.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flashmm.tree.token_tree import pack_mask, padded_trees

ATTENTION_NAME = "spec_tree_attention"
BACKENDS = ("auto", "triton", "torch")

__all__ = ["ATTENTION_NAME", "TreeAttentionArgs", "TreeAttentionSwitch", "TreeAttentionUnsupported",
           "fits_window", "resolve_backend", "tree_attention_forward", "tree_attention_kwargs",
           "unsupported_features"]


@dataclass(frozen=True)
class TreeAttentionArgs:
    """What every attention layer needs for one tree-verification forward.

    tree_mask:    int32 [B, N, ceil(N/32)] packed ancestor mask (bit j%32 of word j//32 of row i).
    depth:        int32 [B, N] node depths (root 0), for sliding windows.
    max_depth:    int, the deepest node.
    prefix_len:   int P, cache rows before the tree (the KV the layer sees has P + N rows).
    prefix_start: int32 [B] first non-padding prefix row (left padding), or None.
    backend:      "triton" or "torch".
    prefix_valid: bool [B, P] prefix rows that are real tokens of their row (holes hidden), or None.
    prefix_positions: int64 [B, P] position id of each prefix row, non-decreasing along a row (a
                  hole carries its predecessor's), or None: the row index.
    node_positions: int64 [B, N] position id of each node, or None: prefix_len + depth. Both
                  positions are only read by sliding-window layers.
    """

    tree_mask: torch.Tensor
    depth: torch.Tensor
    max_depth: int
    prefix_len: int
    prefix_start: torch.Tensor | None
    backend: str
    prefix_valid: torch.Tensor | None = None
    prefix_positions: torch.Tensor | None = None
    node_positions: torch.Tensor | None = None


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


class TreeAttentionUnsupported(Exception):
    """The tree kernel cannot compute this model's attention exactly; the message names why."""


def unsupported_features(model: torch.nn.Module) -> list[str]:
    """What in ``model``'s attention the tree kernel does not compute (empty when it can run):
    attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``) and attention sinks
    (gpt-oss's per-head ``sinks`` parameters). Sliding windows are checked per tree (fits_window)."""
    text_config = model.config.get_text_config()
    features = []
    softcap = getattr(text_config, "attn_logit_softcapping", None)
    if softcap is not None:
        features.append(f"attention logit soft-capping (attn_logit_softcapping={softcap})")
    if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
        features.append("attention sinks")
    return features


def fits_window(max_depth: int, sliding_window: int | None) -> bool:
    """Whether the kernel can apply ``sliding_window`` to a tree ``max_depth`` deep: it hides
    prefix rows per query but keeps every ancestor in the tree visible."""
    return sliding_window is None or max_depth < sliding_window


class TreeAttentionSwitch:
    """Routes ``model``'s text attention to the tree function inside ``with switch:`` only.

    Built once per wrapped model; raises TreeAttentionUnsupported when the kernel cannot run the
    model exactly (unsupported_features) or its modeling code does not call attention through
    transformers' AttentionInterface. Entering sets the text config's implementation name (what
    ``model.set_attn_implementation`` ends by setting, without its walk over every module: ~10 us
    against ~0.3 ms for 32 layers, paid twice per tree forward); leaving restores the name found
    on entry, so the user's implementation (or a change they made since) is never lost.
    """

    def __init__(self, model: torch.nn.Module):
        from transformers import AttentionInterface, PreTrainedModel
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        features = unsupported_features(model)
        if features:
            raise TreeAttentionUnsupported(" and ".join(features))
        AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        decoder = model if decoder is None else decoder          # the text model: its config is text_config
        self.config = decoder.config
        # Whether the modeling code reads AttentionInterface is for transformers to say: ask it
        # once through the public setter, then put every config it touched back as it was.
        touched = [(m.config, m.config._attn_implementation) for m in decoder.modules()
                   if isinstance(m, PreTrainedModel)]
        try:
            decoder.set_attn_implementation(ATTENTION_NAME)
            routes = self.config._attn_implementation == ATTENTION_NAME
        finally:
            for config, name in touched:
                config._attn_implementation = name
        if not routes:
            raise TreeAttentionUnsupported(f"modeling code of {type(decoder).__name__} that does not call "
                                           "attention through transformers' AttentionInterface")
        self._outside = None

    def __enter__(self):
        self._outside = self.config._attn_implementation
        self.config._attn_implementation = ATTENTION_NAME
        return self

    def __exit__(self, *exc):
        self.config._attn_implementation = self._outside
        self._outside = None
        return False


def tree_attention_kwargs(tree, prefix_len: int, batch_size: int, device: torch.device | str, *,
                          backend: str = "auto", padding_mask: torch.Tensor | None = None,
                          prefix_valid: torch.Tensor | None = None, prefix_positions: torch.Tensor | None = None,
                          root_positions: torch.Tensor | None = None) -> dict:
    """Model-forward keyword arguments for one tree-verification forward.

    tree:         TokenTree with N nodes (node 0 = root, not yet in the cache), shared by all rows;
                  or a list of B TokenTrees, one per row, padded to N = the largest node count
                  (a padding node sees the prefix and itself only; no node sees it).
    prefix_len:   rows already in the cache (P); the forward appends the N tree rows.
    padding_mask: optional int/bool [B, >= P] 2D attention mask of the prefix (1 = real token);
                  only left padding is supported (the first real row per sequence is kept).
    prefix_valid: optional bool [B, P]: prefix rows that are real tokens of their row; any pattern
                  (holes anywhere, as in a batched cache laid out by slot).
    prefix_positions, root_positions: optional int [B, P] and [B], given together: the position
                  ids of the prefix rows (increasing along each row's valid rows) and of each row's
                  root, for sliding windows over a prefix with holes. Default: row index, prefix_len.
    Returns {"attention_mask": int32 [B, 1, N, W], "spec_tree": TreeAttentionArgs}; pass them
    with input_ids [B, N], position_ids (prefix_len + depth) and the cache to ``model(...)``.
    """
    device = torch.device(device)
    if isinstance(tree, (list, tuple)):
        if len(tree) != batch_size:
            raise ValueError(f"got {len(tree)} trees for a batch of {batch_size} rows; pass one tree per row")
        allowed, depth = padded_trees(tree)
        tree_mask, depth = pack_mask(allowed).to(device), depth.to(device=device, dtype=torch.int32)
        max_depth = max(int(t.max_depth) for t in tree)
    else:
        packed = tree.packed_mask.to(device)                               # [N, W]
        tree_mask = packed[None].expand(batch_size, *packed.shape)         # [B, N, W]
        depth = tree.depth.to(device=device, dtype=torch.int32)[None].expand(batch_size, tree.num_nodes)
        max_depth = int(tree.max_depth)
    prefix_start = None
    if padding_mask is not None:
        if padding_mask.ndim != 2 or padding_mask.shape[0] != batch_size or padding_mask.shape[1] < prefix_len:
            raise ValueError(f"padding_mask must be [B, >= prefix_len] = [{batch_size}, >= {prefix_len}], "
                             f"got {tuple(padding_mask.shape)}")
        real = padding_mask[:, :prefix_len].to(device) != 0
        prefix_start = torch.where(real.any(1), real.int().argmax(1), prefix_len).to(torch.int32)
    if prefix_valid is not None:
        if prefix_valid.shape != (batch_size, prefix_len):
            raise ValueError(f"prefix_valid must be [B, prefix_len] = [{batch_size}, {prefix_len}], "
                             f"got {tuple(prefix_valid.shape)}")
        prefix_valid = prefix_valid.to(device=device, dtype=torch.bool)
    node_positions = None
    if (prefix_positions is None) != (root_positions is None):
        raise ValueError("pass prefix_positions and root_positions together (or neither)")
    if prefix_positions is not None:
        if prefix_positions.shape != (batch_size, prefix_len) or root_positions.shape != (batch_size,):
            raise ValueError(f"prefix_positions must be [B, P] = [{batch_size}, {prefix_len}] and root_positions "
                             f"[B] = [{batch_size}]; got {tuple(prefix_positions.shape)}, "
                             f"{tuple(root_positions.shape)}")
        prefix_positions = prefix_positions.to(device=device, dtype=torch.long)
        if prefix_valid is not None:  # holes take their predecessor's position: non-decreasing rows
            prefix_positions = prefix_positions.masked_fill(~prefix_valid, -1).cummax(1).values
        node_positions = root_positions.to(device=device, dtype=torch.long)[:, None] + depth
    args = TreeAttentionArgs(tree_mask=tree_mask, depth=depth, max_depth=max_depth,
                             prefix_len=int(prefix_len), prefix_start=prefix_start,
                             backend=resolve_backend(backend, device), prefix_valid=prefix_valid,
                             prefix_positions=prefix_positions, node_positions=node_positions)
    return {"attention_mask": tree_mask[:, None], "spec_tree": args}


def _query_prefix_start(args: TreeAttentionArgs, sliding_window: int | None) -> torch.Tensor | None:
    """int32 [B, N] first visible prefix row per query, or None when all rows are visible."""
    start = None if args.prefix_start is None else args.prefix_start[:, None].expand_as(args.depth)
    by_position = args.prefix_positions is not None
    if sliding_window is not None and (by_position or args.prefix_len + args.max_depth >= sliding_window):
        if not fits_window(args.max_depth, sliding_window):
            raise ValueError(f"tree depth {args.max_depth} reaches past the sliding window ({sliding_window}), "
                             "which tree attention does not apply inside the tree; verify this tree with a "
                             "4D additive mask (flashmm's targets do so by themselves)")
        if by_position:   # the first prefix row whose position is inside the node's window
            window_start = torch.searchsorted(args.prefix_positions.contiguous(),
                                              (args.node_positions - sliding_window + 1).contiguous())
        else:
            window_start = args.prefix_len + args.depth - sliding_window + 1
        start = window_start if start is None else torch.maximum(start, window_start)
    return None if start is None else start.to(torch.int32)


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           dropout: float = 0.0, scaling: float | None = None,
                           sliding_window: int | None = None, **kwargs):
    """AttentionInterface function for tree forwards (inside a TreeAttentionSwitch). query
    [B, Hq, N, D]; key, value [B, Hkv, P + N, D] (after the cache update). Returns
    (attn_output [B, N, Hq, D], None) like transformers' sdpa function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    args: TreeAttentionArgs | None = kwargs.pop("spec_tree", None)
    if args is None:
        raise RuntimeError("tree attention ran without its spec_tree argument: either a forward without "
                           "tree_attention_kwargs(...) ran inside a TreeAttentionSwitch, or this model's "
                           "forward does not pass **kwargs to its attention layers (then use attention='torch')")
    # unsupported_features() keeps these models off this path; this guards a model it does not know.
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise RuntimeError(f"{type(module).__name__} passes attention logit soft-capping or attention sinks, "
                           "which tree attention does not compute and flashmm did not detect before "
                           "generation; use attention='torch' with this model")
    bsz, _, n, _ = query.shape
    if key.shape[2] != args.prefix_len + n or args.tree_mask.shape[:2] != (bsz, n):
        raise ValueError(f"tree forward expected {args.prefix_len} cached + {n} new rows and a "
                         f"[{bsz}, {n}, W] tree mask; the layer sees {key.shape[2]} rows and "
                         f"{tuple(args.tree_mask.shape)} (is the cache length prefix_len?)")
    prefix_start = _query_prefix_start(args, sliding_window)
    if args.backend == "torch":
        from .attention import dense_tree_mask
        allowed = dense_tree_mask(args.tree_mask, args.prefix_len, prefix_start,
                                  args.prefix_valid)[:, None]                             # [B,1,N,P+N]
        return sdpa_attention_forward(module, query, key, value, allowed, dropout=dropout,
                                      scaling=scaling, **kwargs)
    from .attention import tree_attention
    out = query.new_empty(bsz, n, query.shape[1], query.shape[3])                       # [B, N, Hq, D]
    tree_attention(query, key, value, args.tree_mask, args.prefix_len, scaling, prefix_start, args.prefix_valid,
                   out=out.transpose(1, 2))
    return out, None
