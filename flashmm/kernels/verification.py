"""Tree verification kernels: greedy walk and multi-round speculative sampling.

One program per sequence walks the token tree from the root and returns what the PyTorch
verifiers in ``flashmm.verify`` return (``VerifyResult``: path [B, max_depth + 1] root-first
padded -1, accepted_len [B], next_token [B]):

* ``verify_tree_greedy`` = ``flashmm.verify.verify_greedy``: node c (child of v) is accepted
  iff tokens[c] == argmax target_logits[v] (first maximum) and v was accepted; the walk takes
  the first accepted child in node order; next_token = argmax at the last accepted node.
  Argmaxes are computed only at the nodes the walk visits.
* ``verify_tree_sampling`` = ``flashmm.verify.verify_tree`` (SpecInfer multi-round; EAGLE's
  form when q is None) under the same pre-drawn uniforms.

Random numbers (the contract of ``flashmm/verify/rejection.py``): ``uniforms`` float64
[B, N] in [0, 1), from ``draw_verify_randoms`` (= ``flashmm.verify.draw_uniforms``). Column
c >= 1 is the acceptance uniform of drafted node c (used only if the walk tests c); column 0
is the uniform of the final inverse-CDF draw. At node v, after j rejected children, the
residual R_j has mass Z_j; child c (token x) is accepted iff ``u[c] * q_v(x) * Z_j < R_j(x)``
in float64, factors skipped when j = 0 (and q_v(x) skipped when q is None):

  with q:  R_0 = p_v; R_1 = max(0, p_v - q_v); R_j = max(0, R_{j-1} / Z_{j-1} - q_v) (float32),
           Z_j = sum R_j; an all-zero residual falls back to (p_v, 1).
  q None:  R_j(x) = 0 if x repeats an earlier sibling's token, else p_v(x);
           Z_j = 1 - sum of p_v over the distinct earlier sibling tokens (<= 0 -> 1).

The final token is drawn from R_k at the last node (k = its number of children, all
rejected; R_0 = p_v is the bonus; q None: p_v with the children's tokens zeroed) as
``#{t : cumsum(R)[t] <= u[0] * sum(R)}`` in float64, clamped to the last t with R[t] > 0;
an all-zero R falls back to p_v.

File order: PyTorch reference -> Triton kernels -> launchers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashmm.verify.base import VerifyResult

from ._device import check_runnable

__all__ = ["verify_tree_greedy", "verify_tree_sampling", "verify_tree_greedy_ref",
           "verify_tree_sampling_ref", "draw_verify_randoms"]


def draw_verify_randoms(batch: int, num_nodes: int, generator: torch.Generator | None,
                        device: torch.device) -> torch.Tensor:
    """float64 [B, N] uniforms in [0, 1): the same single draw as flashmm.verify.draw_uniforms."""
    gen_device = generator.device if generator is not None else device
    u = torch.rand(batch, num_nodes, dtype=torch.float64, generator=generator, device=gen_device)
    return u.to(device)


# ---------------------------------------------------------------------------- reference
def _children(parents: list[int]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            out[p].append(i)
    return out


def _as_result(paths: list[list[int]], path_len: int, device) -> VerifyResult:
    path = torch.full((len(paths), path_len), -1, dtype=torch.long)
    for b, nodes in enumerate(paths):
        path[b, : len(nodes)] = torch.tensor(nodes)
    accepted_len = torch.tensor([len(nodes) - 1 for nodes in paths], dtype=torch.long)
    return path.to(device), accepted_len.to(device)


def _parents_rows(parents: torch.Tensor, batch: int) -> list[list[int]]:
    rows = parents.expand(batch, -1) if parents.ndim == 2 else parents[None].expand(batch, -1)
    return rows.tolist()


def verify_tree_greedy_ref(tokens: torch.Tensor, parents: torch.Tensor,
                           target_logits: torch.Tensor) -> VerifyResult:
    """Sequential reference of verify_tree_greedy. tokens [B, N], parents [N] or [B, N],
    target_logits [B, N, V]."""
    best = target_logits.float().argmax(-1).cpu()                   # [B, N]
    toks = tokens.cpu()
    paths, next_tokens, max_depth = [], [], 0
    for b, par in enumerate(_parents_rows(parents.cpu(), tokens.shape[0])):
        kids = _children(par)
        nodes = [0]
        while True:
            hit = [c for c in kids[nodes[-1]] if int(toks[b, c]) == int(best[b, nodes[-1]])]
            if not hit:
                break
            nodes.append(hit[0])
        paths.append(nodes)
        next_tokens.append(int(best[b, nodes[-1]]))
        max_depth = max(max_depth, _max_depth(par))
    path, accepted_len = _as_result(paths, max_depth + 1, tokens.device)
    return VerifyResult(path, accepted_len, torch.tensor(next_tokens, device=tokens.device))


def _max_depth(par: list[int]) -> int:
    depth = [0] * len(par)
    for i in range(1, len(par)):
        depth[i] = depth[par[i]] + 1
    return max(depth)


def _inverse_cdf_ref(weights: torch.Tensor, u: float) -> int:
    cdf = weights.double().cumsum(0)
    count = int((cdf <= u * cdf[-1]).sum())
    return min(count, int(torch.nonzero(weights > 0).max()))


def verify_tree_sampling_ref(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor,
                             q: torch.Tensor | None, uniforms: torch.Tensor) -> VerifyResult:
    """Sequential reference of verify_tree_sampling (rule in the module docstring).

    tokens [B, N]; parents [N] or [B, N]; p, q float [B, N, V] (q may be None);
    uniforms float64 [B, N].
    """
    p = p.float().cpu()
    q = None if q is None else q.float().cpu()
    u = uniforms.double().cpu()
    toks = tokens.cpu()
    paths, next_tokens, max_depth = [], [], 0
    for b, par in enumerate(_parents_rows(parents.cpu(), tokens.shape[0])):
        kids = _children(par)
        nodes = [0]
        while True:
            v = nodes[-1]
            residual, mass, removed, seen, moved = p[b, v], None, 0.0, set(), False
            for rank, c in enumerate(kids[v]):
                x = int(toks[b, c])
                if q is not None:
                    lhs = float(u[b, c]) * float(q[b, v, x])
                    if rank > 0:
                        lhs *= float(mass)
                    ok = lhs < float(residual[x])
                else:
                    z = 1.0 - removed
                    lhs = float(u[b, c]) * (z if z > 0 else 1.0) if rank > 0 else float(u[b, c])
                    ok = x not in seen and lhs < float(p[b, v, x])
                if ok:
                    nodes.append(c)
                    moved = True
                    break
                if q is not None:
                    base = residual if mass is None else residual / mass
                    residual = (base - q[b, v]).clamp_min(0)
                    mass = residual.sum()
                    if mass <= 0:
                        residual, mass = p[b, v], torch.tensor(1.0)
                else:
                    if x not in seen:
                        removed += float(p[b, v, x])
                    seen.add(x)
            if not moved:
                break
        v = nodes[-1]
        if q is None:
            weights = p[b, v].clone()
            for c in kids[v]:
                weights[int(toks[b, c])] = 0.0
        else:
            weights = residual
        if not bool((weights > 0).any()):
            weights = p[b, v]
        paths.append(nodes)
        next_tokens.append(_inverse_cdf_ref(weights, float(u[b, 0])))
        max_depth = max(max_depth, _max_depth(par))
    path, accepted_len = _as_result(paths, max_depth + 1, tokens.device)
    return VerifyResult(path, accepted_len, torch.tensor(next_tokens, device=tokens.device))


# ---------------------------------------------------------------------------- kernels
@triton.jit
def _argmax_row(row, stride_v, V, BLOCK_V: tl.constexpr):
    """Index of the first maximum of row[0:V] (torch.argmax's tie rule)."""
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row + offs * stride_v, mask=offs < V, other=float("-inf")).to(tl.float32)
        block_max, block_idx = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        better = block_max > best_val
        best_idx = tl.where(better, block_idx + start, best_idx)
        best_val = tl.where(better, block_max, best_val)
    return best_idx


@triton.jit
def _next_child(par, idx, cur, after, BLOCK_N: tl.constexpr):
    """Lowest node index > after whose parent is cur; BLOCK_N if none."""
    return tl.min(tl.where((par == cur) & (idx > after), idx, BLOCK_N), 0)


@triton.jit
def _verify_greedy_kernel(
    Tokens, Parents, Logits, Path, AcceptedLen, NextToken,
    stride_tb, stride_tn, stride_parb, stride_parn, stride_lb, stride_ln, stride_lv, stride_path,
    N, V, PATH_LEN,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)            # row offsets of [B, N, V] can pass 2^31
    idx = tl.arange(0, BLOCK_N)
    par = tl.load(Parents + b * stride_parb + idx * stride_parn, mask=idx < N, other=-2).to(tl.int32)
    tok = tl.load(Tokens + b * stride_tb + idx * stride_tn, mask=idx < N, other=-1)
    pidx = tl.arange(0, BLOCK_P)
    path = tl.where(pidx == 0, 0, -1).to(tl.int64)
    cur = tl.zeros([], tl.int32)
    depth = tl.zeros([], tl.int32)
    best = tl.zeros([], tl.int32)
    go = tl.full([], 1, tl.int32)
    while go != 0:
        best = _argmax_row(Logits + b * stride_lb + cur * stride_ln, stride_lv, V, BLOCK_V)
        hit = (par == cur) & (idx > 0) & (tok == best)
        nxt = tl.min(tl.where(hit, idx, BLOCK_N), 0)
        found = nxt < N
        depth = tl.where(found, depth + 1, depth)
        path = tl.where(found & (pidx == depth), nxt.to(tl.int64), path)
        cur = tl.where(found, nxt, cur)
        go = found.to(tl.int32)
    tl.store(Path + b * stride_path + pidx, path, mask=pidx < PATH_LEN)
    tl.store(AcceptedLen + b, depth.to(tl.int64))
    tl.store(NextToken + b, best.to(tl.int64))


@triton.jit
def _copy_row(dst, src, stride_v, V, BLOCK_V: tl.constexpr):
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(src + offs * stride_v, mask=offs < V, other=0.0).to(tl.float32)
        tl.store(dst + offs, x, mask=offs < V)


@triton.jit
def _residual_pass(work, p_row, stride_pv, q_row, stride_qv, mass, V,
                   FIRST: tl.constexpr, BLOCK_V: tl.constexpr):
    """work <- max(0, R / mass - q) (R = p_row, undivided, when FIRST); returns sum in float32."""
    total = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        ok = offs < V
        qv = tl.load(q_row + offs * stride_qv, mask=ok, other=0.0).to(tl.float32)
        if FIRST:
            r = tl.load(p_row + offs * stride_pv, mask=ok, other=0.0).to(tl.float32)
        else:
            r = tl.math.div_rn(tl.load(work + offs, mask=ok, other=0.0), mass)
        r = tl.maximum(r - qv, 0.0)
        tl.store(work + offs, r, mask=ok)
        total += tl.sum(r, 0)
    return total


@triton.jit
def _inverse_cdf(row, stride_v, V, u, BLOCK_V: tl.constexpr):
    """(#{t : cumsum(row)[t] <= u * sum(row)} clamped to the last positive t, sum) in float64."""
    total = tl.zeros([], tl.float64)
    last_pos = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        w = tl.load(row + offs * stride_v, mask=offs < V, other=0.0).to(tl.float64)
        total += tl.sum(w, 0)
        last_pos = tl.maximum(last_pos, tl.max(tl.where(w > 0, offs, 0), 0))
    threshold = u * total
    carry = tl.zeros([], tl.float64)
    count = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        ok = offs < V
        w = tl.load(row + offs * stride_v, mask=ok, other=0.0).to(tl.float64)
        cdf = tl.cumsum(w, 0) + carry
        count += tl.sum(((cdf <= threshold) & ok).to(tl.int32), 0)
        carry += tl.sum(w, 0)
    return tl.minimum(count, last_pos), total


@triton.jit
def _verify_sampling_kernel(
    Tokens, Parents, P, Q, U, Work, Path, AcceptedLen, NextToken,
    stride_tb, stride_tn, stride_parb, stride_parn, stride_pb, stride_pn, stride_pv,
    stride_qb, stride_qn, stride_qv, stride_ub, stride_un, stride_path,
    N, V, PATH_LEN,
    HAS_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)            # row offsets of [B, N, V] can pass 2^31
    idx = tl.arange(0, BLOCK_N)
    par = tl.load(Parents + b * stride_parb + idx * stride_parn, mask=idx < N, other=-2).to(tl.int32)
    tok = tl.load(Tokens + b * stride_tb + idx * stride_tn, mask=idx < N, other=-1)
    work = Work + b * V
    pidx = tl.arange(0, BLOCK_P)
    path = tl.where(pidx == 0, 0, -1).to(tl.int64)
    cur = tl.zeros([], tl.int32)
    depth = tl.zeros([], tl.int32)
    rank = tl.zeros([], tl.int32)
    mass = tl.full([], 1.0, tl.float32)          # Z_j of the residual in `work` (with q)
    go = tl.full([], 1, tl.int32)
    while go != 0:
        p_row = P + b * stride_pb + cur * stride_pn
        q_row = Q + b * stride_qb + cur * stride_qn
        rank = tl.zeros([], tl.int32)
        mass = tl.full([], 1.0, tl.float32)
        removed = tl.zeros([], tl.float64)       # q None: p_v mass of distinct rejected tokens
        child = _next_child(par, idx, cur, cur, BLOCK_N)
        accepted = tl.zeros([], tl.int32)
        while (child < N) & (accepted == 0):
            x = tl.sum(tl.where(idx == child, tok, 0), 0)
            u = tl.load(U + b * stride_ub + child * stride_un)
            px = tl.load(p_row + x * stride_pv).to(tl.float32).to(tl.float64)
            if HAS_Q:
                qx = tl.load(q_row + x * stride_qv).to(tl.float32).to(tl.float64)
                if rank == 0:
                    ok = u * qx < px
                else:
                    rx = tl.load(work + x).to(tl.float64)
                    ok = u * qx * mass.to(tl.float64) < rx
            else:
                earlier = (par == cur) & (idx < child) & (tok == x)
                repeat = tl.max(earlier.to(tl.int32), 0) > 0
                z = 1.0 - removed
                z = tl.where(z <= 0, 1.0, z)
                lhs = tl.where(rank == 0, u, u * z)
                ok = (lhs < px) & (repeat == 0)
            if ok:
                accepted = tl.full([], 1, tl.int32)
            else:
                if HAS_Q:
                    tl.debug_barrier()                  # scalar reads of work before overwriting it
                    if rank == 0:
                        total = _residual_pass(work, p_row, stride_pv, q_row, stride_qv, mass, V,
                                               True, BLOCK_V)
                    else:
                        total = _residual_pass(work, p_row, stride_pv, q_row, stride_qv, mass, V,
                                               False, BLOCK_V)
                    if total <= 0:                      # residual vanished: fall back to (p_v, 1)
                        _copy_row(work, p_row, stride_pv, V, BLOCK_V)
                        total = tl.full([], 1.0, tl.float32)
                    mass = total
                    tl.debug_barrier()
                else:
                    removed += tl.where(repeat, 0.0, px)
                rank += 1
                child = _next_child(par, idx, cur, child, BLOCK_N)
        if accepted != 0:
            depth += 1
            path = tl.where(pidx == depth, child.to(tl.int64), path)
            cur = child
        else:
            go = tl.zeros([], tl.int32)

    # Final draw at `cur`, whose `rank` children were all rejected (rank 0: the bonus from p).
    p_row = P + b * stride_pb + cur * stride_pn
    u0 = tl.load(U + b * stride_ub)
    if rank == 0:
        token, total = _inverse_cdf(p_row, stride_pv, V, u0, BLOCK_V)
    else:
        if not HAS_Q:                                   # weights = p_v without the children's tokens
            _copy_row(work, p_row, stride_pv, V, BLOCK_V)
            tl.debug_barrier()
            child = _next_child(par, idx, cur, cur, BLOCK_N)
            while child < N:
                tl.store(work + tl.sum(tl.where(idx == child, tok, 0), 0), 0.0)
                child = _next_child(par, idx, cur, child, BLOCK_N)
            tl.debug_barrier()
        token, total = _inverse_cdf(work, 1, V, u0, BLOCK_V)
    if total <= 0:
        token, total = _inverse_cdf(p_row, stride_pv, V, u0, BLOCK_V)
    tl.store(Path + b * stride_path + pidx, path, mask=pidx < PATH_LEN)
    tl.store(AcceptedLen + b, depth.to(tl.int64))
    tl.store(NextToken + b, token.to(tl.int64))


# ---------------------------------------------------------------------------- launchers
def _tree_inputs(tokens: torch.Tensor, parents, scores: torch.Tensor, name: str):
    """Validate; return (tokens, parents [N] | [B, N], parents' batch and node strides, path length),
    tensors on the scores' device."""
    if hasattr(parents, "parents") and hasattr(parents, "max_depth"):   # a TokenTree
        max_depth, parents = parents.max_depth, parents.parents
    else:
        parents = torch.as_tensor(parents)
        max_depth = max(_max_depth(row) for row in parents.reshape(-1, parents.shape[-1]).tolist())
    if tokens.ndim != 2 or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"tokens must be an integer tensor [B, N], got {tuple(tokens.shape)} {tokens.dtype}")
    bsz, n = tokens.shape
    if parents.shape[-1] != n or parents.ndim not in (1, 2) or (parents.ndim == 2 and parents.shape[0] != bsz):
        raise ValueError(f"parents must be [N] or [B, N] with N = {n}, got {tuple(parents.shape)}")
    if scores.ndim != 3 or tuple(scores.shape[:2]) != (bsz, n):
        raise ValueError(f"{name} must be [B, N, V] = [{bsz}, {n}, V], got {tuple(scores.shape)}")
    parents = parents.to(scores.device)
    return (tokens.to(scores.device), parents, 0 if parents.ndim == 1 else parents.stride(0),
            parents.stride(-1), max_depth + 1)


def _outputs(bsz: int, path_len: int, device, out):
    if out is None:
        return (torch.empty(bsz, path_len, dtype=torch.long, device=device),
                torch.empty(bsz, dtype=torch.long, device=device),
                torch.empty(bsz, dtype=torch.long, device=device))
    path, accepted_len, next_token = out
    if path.shape != (bsz, path_len) or accepted_len.shape != (bsz,) or next_token.shape != (bsz,):
        raise ValueError("out must be (path [B, max_depth + 1], accepted_len [B], next_token [B]) int64")
    return path, accepted_len, next_token


def verify_tree_greedy(tokens: torch.Tensor, parents, target_logits: torch.Tensor, *,
                       out: tuple | None = None, block_v: int = 1024) -> VerifyResult:
    """Greedy tree verification, one program per sequence; equals flashmm.verify.verify_greedy.

    tokens:        int64 [B, N]; tokens[:, 0] is the root.
    parents:       TokenTree, or int [N] / [B, N] parent indices (parents[0] = -1, parents[i] < i).
    target_logits: float [B, N, V] (any float dtype, any strides).
    out:           optional preallocated (path, accepted_len, next_token) to write into.
    """
    tokens, parents, spb, spn, path_len = _tree_inputs(tokens, parents, target_logits, "target_logits")
    bsz, n = tokens.shape
    check_runnable(_verify_greedy_kernel, tokens.device)
    path, accepted_len, next_token = _outputs(bsz, path_len, tokens.device, out)
    if bsz:
        _verify_greedy_kernel[(bsz,)](
            tokens, parents, target_logits, path, accepted_len, next_token,
            *tokens.stride(), spb, spn, *target_logits.stride(), path.stride(0),
            n, target_logits.shape[2], path_len,
            BLOCK_N=max(16, triton.next_power_of_2(n)), BLOCK_P=max(16, triton.next_power_of_2(path_len)),
            BLOCK_V=block_v, num_warps=4,
        )
    return VerifyResult(path=path, accepted_len=accepted_len, next_token=next_token)


def verify_tree_sampling(tokens: torch.Tensor, parents, p: torch.Tensor, q: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, *, uniforms: torch.Tensor | None = None,
                         out: tuple | None = None, block_v: int = 1024) -> VerifyResult:
    """Multi-round tree speculative sampling, one program per sequence. Lossless.

    Equals flashmm.verify.verify_tree(tokens, tree, p, q, generator) draw for draw (same
    uniforms; float rounding of sums aside). On a chain it is chain speculative sampling.

    tokens:    int64 [B, N]; tokens[:, 0] is the root.
    parents:   TokenTree, or int [N] / [B, N] parent indices.
    p:         float32/16 [B, N, V] warped target probabilities (row v: distribution of v's children).
    q:         same shape, the draft distribution v's children were drawn from i.i.d., or None
               (deterministic children).
    generator: used for the one draw ``draw_verify_randoms(B, N, generator, device)`` unless
    uniforms:  float64 [B, N] is given (layout in the module docstring).
    out:       optional preallocated (path, accepted_len, next_token).
    """
    tokens, parents, spb, spn, path_len = _tree_inputs(tokens, parents, p, "p")
    bsz, n = tokens.shape
    if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"p must be float32/float16/bfloat16 (computed in float32), got {p.dtype}")
    if q is not None and (q.shape != p.shape or q.dtype != p.dtype or q.device != p.device):
        raise ValueError(f"q must match p ({tuple(p.shape)} {p.dtype}), got {tuple(q.shape)} {q.dtype}")
    if uniforms is None:
        uniforms = draw_verify_randoms(bsz, n, generator, p.device)
    if tuple(uniforms.shape) != (bsz, n):
        raise ValueError(f"uniforms must be [B, N] = [{bsz}, {n}], got {tuple(uniforms.shape)}")
    uniforms = uniforms.to(device=p.device, dtype=torch.float64)
    check_runnable(_verify_sampling_kernel, p.device)
    path, accepted_len, next_token = _outputs(bsz, path_len, tokens.device, out)
    if bsz:
        vocab = p.shape[2]
        work = torch.empty(bsz, vocab, dtype=torch.float32, device=p.device)
        qq = q if q is not None else p
        _verify_sampling_kernel[(bsz,)](
            tokens, parents, p, qq, uniforms, work, path, accepted_len, next_token,
            *tokens.stride(), spb, spn, *p.stride(), *qq.stride(), *uniforms.stride(), path.stride(0),
            n, vocab, path_len,
            HAS_Q=q is not None, BLOCK_N=max(16, triton.next_power_of_2(n)),
            BLOCK_P=max(16, triton.next_power_of_2(path_len)), BLOCK_V=block_v, num_warps=4,
        )
    return VerifyResult(path=path, accepted_len=accepted_len, next_token=next_token)
