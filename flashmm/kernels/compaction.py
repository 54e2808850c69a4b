"""KV compaction after verification: move the accepted path's rows right after the prefix.

For every KV tensor t [B, H, T, D] (all layers, keys and values) and every row b:

    t[b, :, prefix_len + i] <- t[b, :, prefix_len + path[b, i]]   for i < L with path[b, i] >= 0

Rows with path[b, i] == -1 (padding of shorter accepted paths) are left untouched; the caller
then truncates the cache to prefix_len + accepted length. Destinations precede or equal their
sources (path is increasing), so a naive in-place parallel copy could overwrite a row before
it is read: each program loads all of its L source rows, waits at a barrier, then stores.

All tensors are handled by one launch: a list of same-shaped tensors is addressed as
``base + offset[s]`` with integer element offsets from the first tensor (no pointer loads,
so the Triton interpreter runs it too).

File order: PyTorch reference -> Triton kernel -> launcher.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ._device import check_runnable

__all__ = ["kv_keep", "kv_keep_ref"]


# ---------------------------------------------------------------------------- reference
def kv_keep_ref(kv: Sequence[torch.Tensor] | torch.Tensor, prefix_len: int, path: torch.Tensor) -> None:
    """In-place reference: gather every source row first, then assign. path: int [B, L]."""
    tensors = list(kv.unbind(0)) if isinstance(kv, torch.Tensor) and kv.ndim == 5 else list(kv)
    for t in tensors:
        for b in range(path.shape[0]):
            keep = path[b] >= 0
            src = prefix_len + path[b][keep].to(t.device)
            dst = prefix_len + torch.arange(path.shape[1], device=t.device)[keep.to(t.device)]
            rows = t[b, :, src].clone()
            t[b, :, dst] = rows


# ---------------------------------------------------------------------------- kernel
@triton.jit
def _kv_keep_kernel(
    Base, Offsets, Path,
    stride_b, stride_h, stride_t, stride_d, stride_pb, stride_pl,
    num_heads, prefix_len, L, T, D,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    b = tl.program_id(1) // num_heads
    h = tl.program_id(1) % num_heads
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_L)
    src = tl.load(Path + b * stride_pb + rows * stride_pl, mask=rows < L, other=-1)
    move = (src >= 0) & (src != rows) & (prefix_len + src < T)   # identical rows need no copy
    mask = move[:, None] & (offs_d < D)[None, :]
    base = Base + tl.load(Offsets + s) + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    x = tl.load(base + (prefix_len + src)[:, None].to(tl.int64) * stride_t + offs_d[None, :] * stride_d,
                mask=mask)
    tl.debug_barrier()                           # every source row is read before any store
    tl.store(base + (prefix_len + rows)[:, None].to(tl.int64) * stride_t + offs_d[None, :] * stride_d,
             x, mask=mask)


# ---------------------------------------------------------------------------- launcher
def kv_keep(kv: Sequence[torch.Tensor] | torch.Tensor, prefix_len: int, path: torch.Tensor) -> None:
    """Move accepted rows in place for all layers in one launch.

    kv:         list of tensors [B, H, T, D] sharing shape, strides, dtype and device (e.g. every
                layer's keys and values of a DynamicCache), or one stacked tensor [S, B, H, T, D].
    prefix_len: rows [0, prefix_len) are the committed prefix (untouched).
    path:       int [B, L] tree node indices to keep, root first, strictly increasing per row,
                -1 padding allowed (VerifyResult.path). Sources past row T - 1 are ignored.
    """
    tensors = list(kv.unbind(0)) if isinstance(kv, torch.Tensor) and kv.ndim == 5 else list(kv)
    if not tensors:
        return
    first = tensors[0]
    for t in tensors:
        if t.ndim != 4 or t.shape != first.shape or t.stride() != first.stride() \
                or t.dtype != first.dtype or t.device != first.device:
            raise ValueError("kv tensors must all be [B, H, T, D] with one shape, stride, dtype and device; "
                             f"got {tuple(t.shape)} {t.stride()} {t.dtype} vs {tuple(first.shape)} {first.stride()}")
    bsz, heads, length, dim = first.shape
    if path.ndim != 2 or path.shape[0] != bsz:
        raise ValueError(f"path must be [B, L] with B = {bsz}, got {tuple(path.shape)}")
    if prefix_len + path.shape[1] > length:
        raise ValueError(f"cannot keep {path.shape[1]} rows after a prefix of {prefix_len} in {length} rows")
    path = path.to(first.device)
    num_rows = path.shape[1]
    if num_rows == 0 or bsz == 0:
        return
    check_runnable(_kv_keep_kernel, first.device)
    elem = first.element_size()
    deltas = [t.data_ptr() - first.data_ptr() for t in tensors]
    if any(delta % elem for delta in deltas):
        raise ValueError("kv tensors must be element-aligned with each other")
    offsets = torch.tensor([delta // elem for delta in deltas], dtype=torch.int64, device=first.device)
    block_l = max(16, triton.next_power_of_2(num_rows))
    block_d = max(16, min(triton.next_power_of_2(dim), 8192 // block_l))
    grid = (len(tensors), bsz * heads, triton.cdiv(dim, block_d))
    _kv_keep_kernel[grid](
        first, offsets, path, *first.stride(), *path.stride(),
        heads, prefix_len, num_rows, length, dim, BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4,
    )
