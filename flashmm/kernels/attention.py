"""Tree attention: N tree tokens attend a shared prefix (no mask) and their own ancestors.

Layout is the one transformers' attention functions see after a cache update:

    q          [B, Hq, N, D]       the N tree tokens (node 0 = root)
    k, v       [B, Hkv, P + N, D]  rows [0, P) the prefix, rows [P, P + N) the tree nodes
    tree_mask  int32 [B, N, W]     W = ceil(N / 32); bit (j % 32) of word j // 32 of row i is set
                                   iff node i may attend node j (ancestors and itself)
    o          [B, Hq, N, D]       in q's dtype

Optional ``prefix_start`` int32 [B, N]: query i of row b sees prefix rows
[prefix_start[b, i], P) only. It expresses left padding (the first real row) and sliding
windows (P + depth_i - window + 1) with one lower bound per query.

Optional ``prefix_valid`` bool/int8 [B, P]: prefix row p of row b is seen only where
prefix_valid[b, p] is set. It expresses holes inside the prefix (a batched cache laid out by
slot, where rows that kept fewer tokens than others leave unused slots); it combines with
prefix_start (a row must pass both).

GQA: the G = Hq / Hkv query heads that share a KV head are packed into the M tile
(row r = node * G + head_in_group), so each KV head's rows are read once per tile.
Long prefixes are split across programs (flash-decoding) and merged by a second kernel when
there are too few (tile, batch, kv-head) programs to fill the GPU.

File order: PyTorch reference -> Triton kernels -> launcher.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._device import check_runnable

__all__ = ["tree_attention", "tree_attention_ref", "dense_tree_mask", "launch_config", "split_count"]


# ---------------------------------------------------------------------------- reference
def dense_tree_mask(tree_mask: torch.Tensor, prefix_len: int, prefix_start: torch.Tensor | None = None,
                    prefix_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Unpack tree_mask int32 [B, N, W] into the dense visibility mask bool [B, N, P + N].

    prefix_start: int32/int64 [B, N] or None; prefix rows below it are hidden for that query.
    prefix_valid: bool/int [B, P] or None; prefix rows where it is 0 are hidden for every query.
    """
    bsz, n, _ = tree_mask.shape
    shifts = torch.arange(32, device=tree_mask.device, dtype=torch.int32)
    bits = (tree_mask[..., None] >> shifts) & 1                      # [B, N, W, 32]
    tree_part = bits.flatten(-2)[..., :n].bool()                     # [B, N, N]
    prefix_part = torch.ones(bsz, n, prefix_len, dtype=torch.bool, device=tree_mask.device)
    if prefix_start is not None:
        cols = torch.arange(prefix_len, device=tree_mask.device)
        prefix_part = cols >= prefix_start[..., None].to(tree_mask.device)  # [B, N, P]
    if prefix_valid is not None:
        prefix_part = prefix_part & (prefix_valid.to(tree_mask.device) != 0)[:, None, :]
    return torch.cat([prefix_part, tree_part], dim=-1)


def tree_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor,
                       prefix_len: int, sm_scale: float | None = None,
                       prefix_start: torch.Tensor | None = None,
                       prefix_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 reference of ``tree_attention`` (same arguments, same output shape and dtype)."""
    bsz, hq, n, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    allowed = dense_tree_mask(tree_mask.expand(bsz, -1, -1), prefix_len,
                              None if prefix_start is None else prefix_start.expand(bsz, n),
                              None if prefix_valid is None else prefix_valid.expand(bsz, prefix_len))
    kf = k.float().repeat_interleave(group, dim=1)                   # [B, Hq, P+N, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale              # [B, Hq, N, P+N]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ vf).to(q.dtype)


# ---------------------------------------------------------------------------- kernels
@triton.jit
def _online_softmax_step(qk, valid, v, m_i, l_i, acc, INPUT_PRECISION: tl.constexpr):
    """One flash-attention update in base 2; rows with nothing visible yet stay at m=-inf, l=0."""
    qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)     # avoid (-inf) - (-inf)
    p = tl.exp2(qk - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    Q, K, V, Mask, PrefixStart, PrefixValid, Out, PartAcc, PartM, PartL,
    qk_scale,                                   # sm_scale * log2(e)
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_mb, stride_mn, stride_mw,
    stride_sb, stride_sn,
    stride_pvb, stride_pvp,
    stride_ob, stride_oh, stride_on, stride_od,
    num_kv_heads, num_q_heads, N, P, D, chunk,  # chunk: prefix rows per split (multiple of BLOCK_N)
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_PREFIX_START: tl.constexpr, HAS_PREFIX_VALID: tl.constexpr, SPLIT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    num_splits = tl.num_programs(2)
    b = (pid_bh // num_kv_heads).to(tl.int64)    # batch offsets can pass 2^31 elements
    kvh = pid_bh % num_kv_heads

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # packed (node, head in group)
    node = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = node < N
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + node[:, None] * stride_qn
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    # ---- stage 1: this split's slice of the prefix; no mask loads but the optional per-row
    # prefix_valid flags (one BLOCK_N vector per key tile, shared by the tile's queries)
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, P)
    if HAS_PREFIX_START:
        row_lo = tl.load(PrefixStart + b * stride_sb + node * stride_sn, mask=row_ok, other=P)
        lo = tl.maximum(lo, (tl.min(row_lo, 0) // BLOCK_N) * BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        kt = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None] * stride_kd,
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)          # [BLOCK_D, BLOCK_N]
        vv = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                     mask=col_ok[:, None] & d_ok[None, :], other=0.0)          # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, kt, input_precision=INPUT_PRECISION) * qk_scale
        valid = col_ok[None, :]
        if HAS_PREFIX_START:
            valid = valid & (cols[None, :] >= row_lo[:, None])
        if HAS_PREFIX_VALID:
            real = tl.load(PrefixValid + b * stride_pvb + cols * stride_pvp, mask=col_ok, other=0)
            valid = valid & (real != 0)[None, :]
        m_i, l_i, acc = _online_softmax_step(qk, valid, vv, m_i, l_i, acc, INPUT_PRECISION)

    # ---- stage 2 (last split only): the tree rows, visibility from the packed mask bits.
    # Ancestors precede their descendants, so columns past this tile's last node are skipped.
    if pid_s == num_splits - 1:
        tree_hi = tl.minimum(N, (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
        for start in range(0, tree_hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            kt = tl.load(k_base + (P + cols[None, :]) * stride_kt + offs_d[:, None] * stride_kd,
                         mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            vv = tl.load(v_base + (P + cols[:, None]) * stride_vt + offs_d[None, :] * stride_vd,
                         mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            words = tl.load(Mask + b * stride_mb + node[:, None] * stride_mn
                            + (cols // 32)[None, :] * stride_mw,
                            mask=row_ok[:, None] & col_ok[None, :], other=0)
            valid = ((words >> (cols % 32)[None, :]) & 1) != 0
            qk = tl.dot(q, kt, input_precision=INPUT_PRECISION) * qk_scale
            m_i, l_i, acc = _online_softmax_step(qk, valid, vv, m_i, l_i, acc, INPUT_PRECISION)

    if SPLIT:
        # Partial results, merged by _tree_attention_combine_kernel. Row id = (b*Hq + head)*N + node.
        part_row = (b * num_q_heads + head) * N + node
        total_rows = tl.num_programs(1) // num_kv_heads * num_q_heads * N
        tl.store(PartM + pid_s * total_rows + part_row, m_i, mask=row_ok)
        tl.store(PartL + pid_s * total_rows + part_row, l_i, mask=row_ok)
        tl.store(PartAcc + (pid_s * total_rows + part_row[:, None]) * BLOCK_D + offs_d[None, :], acc,
                 mask=row_ok[:, None])
    else:
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]   # padding rows: avoid 0/0
        tl.store(Out + b * stride_ob + head[:, None] * stride_oh + node[:, None] * stride_on
                 + offs_d[None, :] * stride_od, o.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _tree_attention_combine_kernel(
    PartAcc, PartM, PartL, Out,
    stride_ob, stride_oh, stride_on, stride_od,
    total_rows, num_q_heads, N, D, num_splits,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the per-split (m, l, acc) of each output row (log-sum-exp in base 2)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < total_rows
    offs_d = tl.arange(0, BLOCK_D)
    m_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m_max = tl.maximum(m_max, tl.load(PartM + s * total_rows + rows, mask=row_ok, other=float("-inf")))
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        w = tl.exp2(tl.load(PartM + s * total_rows + rows, mask=row_ok, other=float("-inf")) - m_use)
        l_sum += w * tl.load(PartL + s * total_rows + rows, mask=row_ok, other=0.0)
        acc += w[:, None] * tl.load(PartAcc + (s * total_rows + rows[:, None]) * BLOCK_D + offs_d[None, :],
                                    mask=row_ok[:, None], other=0.0)
    o = acc / tl.where(row_ok, l_sum, 1.0)[:, None]
    b = (rows // (num_q_heads * N)).to(tl.int64)
    head = (rows // N) % num_q_heads
    node = rows % N
    tl.store(Out + b[:, None] * stride_ob + head[:, None] * stride_oh + node[:, None] * stride_on
             + offs_d[None, :] * stride_od, o.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d < D)[None, :])


# ---------------------------------------------------------------------------- launcher
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def launch_config(dtype: torch.dtype, head_dim: int, rows: int) -> dict:
    """Tile sizes, warps, stages and dot precision for ``rows`` = N * (Hq / Hkv) packed rows.

    fp16/bf16 at D <= 128 follow a sweep on an H100 (eval/results/bench_kernels_h100.md): more
    rows at D = 128 take taller tiles, so each KV head's prefix is re-read by fewer programs;
    128-row tiles need 8 warps. D > 128 and fp32 (IEEE dots, exactness first) use smaller tiles.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32 or block_d > 128:
        max_m = 32 if dtype == torch.float32 and block_d >= 128 else 64
        return dict(BLOCK_D=block_d, BLOCK_M=min(max_m, max(16, triton.next_power_of_2(rows))), BLOCK_N=32,
                    num_warps=8, num_stages=2, INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
    tall = rows > 128 and block_d == 128           # at D <= 64 the 64-row tile measured faster
    block_m = 128 if tall else max(16, min(64, triton.next_power_of_2(rows)))
    return dict(BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=64, num_warps=8 if block_m == 128 else 4,
                num_stages=3, INPUT_PRECISION="tf32")


def split_count(prefix_len: int, programs: int, sms: int) -> int:
    """Prefix splits (flash-decoding) so that a launch of ``programs`` tiles fills one wave of SMs.

    Never more programs than SMs: a second, nearly empty wave doubles the time (measured on an
    H100: 144 programs on 132 SMs ran 1.6x slower than 128). Each split costs a partial-result
    write and the combine kernel, so prefixes under 1024 rows are not split, and a split keeps at
    least 256 prefix rows.
    """
    if sms <= 1 or prefix_len < 1024:
        return 1
    return max(1, min(sms // programs, prefix_len // 256))


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor,
                   prefix_len: int, sm_scale: float | None = None,
                   prefix_start: torch.Tensor | None = None, prefix_valid: torch.Tensor | None = None, *,
                   out: torch.Tensor | None = None,
                   block_m: int | None = None, block_n: int | None = None,
                   num_splits: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None) -> torch.Tensor:
    """Attention of N tree tokens over prefix + tree KV; see the module docstring for layout.

    q: [B, Hq, N, D]; k, v: [B, Hkv, prefix_len + N, D] (any strides); Hq % Hkv == 0.
    tree_mask: int32 [B, N, ceil(N/32)] (a [N, W] or [1, N, W] mask is broadcast over B).
    prefix_start: int [B, N] or [B] or None (first visible prefix row per query).
    prefix_valid: bool or int8 [B, prefix_len] or None (0 hides that prefix row from all of the
    row's queries: holes in a slot-laid batched cache); None costs nothing.
    sm_scale: softmax scale, default 1/sqrt(D).
    out: optional [B, Hq, N, D] tensor of q's dtype to write into (any strides).
    block_m, block_n, num_splits, num_warps, num_stages: tuning overrides (tile rows, key rows per
    step, prefix splits, warps per program, software-pipelining depth).
    Returns o [B, Hq, N, D] in q's dtype.
    """
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B,Hq,N,D] and k, v [B,Hkv,P+N,D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    bsz, hq, n, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != bsz or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if not 0 <= prefix_len or k.shape[2] != prefix_len + n:
        raise ValueError(f"k has {k.shape[2]} rows; expected prefix_len + N = {prefix_len} + {n}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one of {_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    words = (n + 31) // 32
    if tree_mask.dtype != torch.int32:
        raise TypeError(f"tree_mask must be int32 packed words, got {tree_mask.dtype}")
    if tree_mask.ndim == 2:
        tree_mask = tree_mask[None]
    if tree_mask.shape[1:] != (n, words) or tree_mask.shape[0] not in (1, bsz):
        raise ValueError(f"tree_mask must be [B, N, ceil(N/32)] = [{bsz}, {n}, {words}], "
                         f"got {tuple(tree_mask.shape)}")
    if tree_mask.device != q.device or k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v and tree_mask must be on one device; got {q.device}, {k.device}, "
                         f"{v.device}, {tree_mask.device}")
    tree_mask = tree_mask.expand(bsz, n, words)
    if prefix_start is not None:
        if prefix_start.ndim == 1:
            prefix_start = prefix_start[:, None]
        prefix_start = prefix_start.to(device=q.device, dtype=torch.int32).expand(bsz, n)
    if prefix_valid is not None:
        if prefix_valid.dtype not in (torch.bool, torch.int8):
            raise TypeError(f"prefix_valid must be bool or int8 (1 = a real prefix row), got {prefix_valid.dtype}")
        if prefix_valid.ndim != 2 or prefix_valid.shape[0] not in (1, bsz) or prefix_valid.shape[1] != prefix_len:
            raise ValueError(f"prefix_valid must be [B, prefix_len] = [{bsz}, {prefix_len}], "
                             f"got {tuple(prefix_valid.shape)}")
        if prefix_valid.device != q.device:
            raise ValueError(f"prefix_valid is on {prefix_valid.device}; q is on {q.device}")
        prefix_valid = prefix_valid.view(torch.int8).expand(bsz, prefix_len)   # bool -> int8: same bytes
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if n == 0 or bsz == 0:
        return out

    check_runnable(_tree_attention_kernel, q.device)
    group = hq // hkv
    rows = n * group
    config = launch_config(q.dtype, d, rows)
    block_d = config["BLOCK_D"]
    block_m = block_m or config["BLOCK_M"]
    block_n = block_n or config["BLOCK_N"]
    m_blocks = triton.cdiv(rows, block_m)
    programs = m_blocks * bsz * hkv
    if num_splits is None:
        num_splits = split_count(prefix_len, programs, _num_sms(q.device))
    num_splits = max(1, min(int(num_splits), triton.cdiv(max(prefix_len, 1), block_n)))
    chunk = triton.cdiv(triton.cdiv(max(prefix_len, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(prefix_len, chunk))
    split = num_splits > 1

    if split:
        total_rows = bsz * hq * n
        part_acc = torch.empty(num_splits, total_rows, block_d, device=q.device, dtype=torch.float32)
        part_m = torch.empty(num_splits, total_rows, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    start = prefix_start if prefix_start is not None else tree_mask  # unused when absent
    real = prefix_valid if prefix_valid is not None else tree_mask
    grid = (m_blocks, bsz * hkv, num_splits)
    _tree_attention_kernel[grid](
        q, k, v, tree_mask, start, real, out, part_acc, part_m, part_l,
        scale * 1.4426950408889634,
        *q.stride(), *k.stride(), *v.stride(), *tree_mask.stride(),
        *(prefix_start.stride() if prefix_start is not None else (0, 0)),
        *(prefix_valid.stride() if prefix_valid is not None else (0, 0)),
        *out.stride(),
        hkv, hq, n, prefix_len, d, chunk,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_PREFIX_START=prefix_start is not None, HAS_PREFIX_VALID=prefix_valid is not None, SPLIT=split,
        INPUT_PRECISION=config["INPUT_PRECISION"],
        num_warps=num_warps or config["num_warps"], num_stages=num_stages or config["num_stages"],
    )
    if split:
        block_r = 16
        _tree_attention_combine_kernel[(triton.cdiv(total_rows, block_r),)](
            part_acc, part_m, part_l, out, *out.stride(),
            total_rows, hq, n, d, num_splits, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
        )
    return out
