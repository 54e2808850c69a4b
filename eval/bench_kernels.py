"""Kernel benchmark: tree attention vs SDPA (dense 4D mask, plain causal), verification, KV keep.

GPU (defaults: Llama-3-8B attention shape, bf16, B = 1):

    python eval/bench_kernels.py --out eval/results/bench_kernels_h100

CPU smoke run (tiny shapes, TRITON_INTERPRET=1, checks every kernel against its reference):

    python eval/bench_kernels.py --smoke

Attention rows, per (prefix P, tree size N):
  tree     flashmm tree_attention (packed mask, GQA packed, prefix split on long prefixes)
  dense    transformers' sdpa_attention_forward with a dense [B, 1, N, P+N] boolean mask
           (what a 4D-mask tree forward runs today: repeat_kv + masked SDPA)
  causal   SDPA with a bottom-right causal mask over the same N queries and P+N keys (the
           chain case through the fastest kernel torch has; a lower bound for a tree)
Attention times are device times: medians of CUDA-graph replays, the L2 cache flushed before each
call (what a captured decoding step pays). Beside them, eager times (do_bench: one call from Python,
host launch cost included) and the host time per call issued back to back, which is what an
uncaptured model layer pays when the GPU outruns Python. floor: the minimum traffic (K, V, Q read
once, O written once) at the device's measured copy bandwidth. Goals at P >= 2k, on device
times: tree <= 1.2x causal, dense >= 1.5x tree. --sweep times tile sizes, warps, stages and splits
around the launcher's choice and records every timing.
Verification rows compare the one-program-per-sequence kernels with the vectorised PyTorch
verifiers in flashmm.verify; kv_keep rows compare one launch over all layers with per-layer
gather + assign.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU allowed (TRITON_INTERPRET=1)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prefix", default="512,2048,8192,32768", help="comma-separated prefix lengths")
    ap.add_argument("--tree", default="16,64,256", help="comma-separated tree sizes N")
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary for the verification kernels")
    ap.add_argument("--layers", type=int, default=32, help="layers for kv_keep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true",
                    help="also time tree_attention over tile sizes, warps, stages and prefix splits "
                         "at P >= 2k (device time, CUDA graphs); records the best per shape")
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    args = ap.parse_args(argv)
    if args.smoke:
        args.heads, args.kv_heads, args.head_dim, args.batch = 4, 2, 16, 2
        args.prefix, args.tree, args.vocab, args.layers = "0,40", "5,33", 50, 2
        args.dtype = "fp32" if not torch.cuda.is_available() else args.dtype
    return args


def random_tree(n: int, gen: torch.Generator):
    """A bushy random tree: node i's parent drawn from the last few nodes (depth ~ log-ish)."""
    from flashmm.tree.token_tree import TokenTree
    parents = [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=gen)) for i in range(1, n)]
    return TokenTree.from_parents(parents)


class Timer:
    """Median milliseconds of fn().

    ``timer(fn)``: eager calls, host launch cost included (do_bench on CUDA: events, L2 flushed).
    ``timer.graph(fn)``: device time alone: ``calls`` calls captured in one CUDA graph, each after
    an L2 flush, replayed; the flush's own graph time is subtracted. On CPU both are perf_counter.
    """

    def __init__(self, cuda: bool, smoke: bool, calls: int = 20, reps: int = 7):
        self.cuda, self.smoke, self.calls, self.reps = cuda, smoke, calls, reps
        self._flush_ms = None
        if cuda:
            self._l2 = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def __call__(self, fn) -> float:
        if self.cuda:
            import triton.testing
            return float(triton.testing.do_bench(fn, warmup=10 if self.smoke else 25,
                                                 rep=20 if self.smoke else 100, return_mode="median"))
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def _replay_ms(self, fn) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):            # warm up off the capture: compile, allocate
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.calls):
                self._l2.zero_()
                fn()
        graph.replay()
        times = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / self.calls)
        return statistics.median(times)

    def host_us(self, fn, calls: int = 200) -> float:
        """Microseconds of host time per call when calls are issued back to back (launch cost)."""
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls if self.cuda else 2):
            fn()
        host = (time.perf_counter() - t0) / (calls if self.cuda else 2) * 1e6
        if self.cuda:
            torch.cuda.synchronize()
        return host

    def graph(self, fn) -> float:
        if not self.cuda:
            return self(fn)
        if self._flush_ms is None:
            self._flush_ms = self._replay_ms(lambda: None)
        return max(self._replay_ms(fn) - self._flush_ms, 0.0)


def copy_bandwidth(device, timer: Timer) -> float:
    """GB/s of a device-to-device copy (bytes read + written)."""
    numel = (256 << 20) if device.type == "cuda" else (4 << 20)
    src = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def bench_attention(args, device, dtype, timer, bandwidth, gen):
    from torch.nn.attention.bias import causal_lower_right
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from flashmm.kernels.attention import dense_tree_mask, tree_attention, tree_attention_ref

    class Layer(torch.nn.Module):   # what transformers' sdpa function reads from the module
        num_key_value_groups = args.heads // args.kv_heads
        is_causal = True

    layer = Layer()
    rows = []
    for prefix in [int(x) for x in args.prefix.split(",")]:
        for n in [int(x) for x in args.tree.split(",")]:
            tree = random_tree(n, gen)
            b, hq, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
            q = torch.randn(b, hq, n, d, device=device, dtype=dtype)
            k = torch.randn(b, hkv, prefix + n, d, device=device, dtype=dtype)
            v = torch.randn(b, hkv, prefix + n, d, device=device, dtype=dtype)
            mask = tree.packed_mask.to(device)[None].expand(b, -1, -1)
            dense = dense_tree_mask(mask, prefix)[:, None]                      # [B, 1, N, P+N]
            causal = causal_lower_right(n, prefix + n)
            out = tree_attention(q, k, v, mask, prefix)
            err = (out.float() - tree_attention_ref(q, k, v, mask, prefix).float()).abs().max().item()
            dense_out = sdpa_attention_forward(layer, q, k, v, dense)[0].transpose(1, 2)
            err_dense = (out.float() - dense_out.float()).abs().max().item()
            tree_fn = lambda: tree_attention(q, k, v, mask, prefix)  # noqa: E731
            dense_fn = lambda: sdpa_attention_forward(layer, q, k, v, dense)  # noqa: E731
            # The faster of GQA-aware SDPA and SDPA on pre-expanded KV (expansion not timed):
            # whichever fused kernel torch picks for a bottom-right causal mask.
            k_rep, v_rep = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
            causal_fns = [lambda: torch.nn.functional.scaled_dot_product_attention(
                              q, k, v, attn_mask=causal, enable_gqa=hq != hkv),
                          lambda: torch.nn.functional.scaled_dot_product_attention(
                              q, k_rep, v_rep, attn_mask=causal)]
            t_tree, t_dense = timer.graph(tree_fn), timer.graph(dense_fn)
            t_causal = min(timer.graph(fn) for fn in causal_fns)
            e_tree, e_causal = timer(tree_fn), min(timer(fn) for fn in causal_fns)
            host_tree, host_causal = timer.host_us(tree_fn), timer.host_us(causal_fns[0])
            moved = (2 * k.numel() + 2 * q.numel()) * k.element_size()
            floor = moved / bandwidth / 1e6                        # ms at the measured copy bandwidth
            rows.append(dict(prefix=prefix, n=n, tree_ms=t_tree, dense_ms=t_dense, causal_ms=t_causal,
                             tree_over_causal=t_tree / t_causal, dense_over_tree=t_dense / t_tree,
                             tree_eager_ms=e_tree, causal_eager_ms=e_causal, floor_ms=floor,
                             tree_host_us=host_tree, causal_host_us=host_causal,
                             tree_gbps=moved / t_tree / 1e6, bandwidth_frac=floor / t_tree,
                             max_err_vs_ref=err, max_err_vs_dense=err_dense))
    return rows


def sweep_tree_attention(args, device, dtype, timer, gen):
    """Best (tile, warps, stages) with automatic splits, then the best split count for that tile."""
    import triton

    from flashmm.kernels.attention import tree_attention

    tiles = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
             for bm in (32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
    rows = []
    for prefix in [int(x) for x in args.prefix.split(",") if int(x) >= 2048]:
        for n in [int(x) for x in args.tree.split(",")]:
            b, hq, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
            q = torch.randn(b, hq, n, d, device=device, dtype=dtype)
            k = torch.randn(b, hkv, prefix + n, d, device=device, dtype=dtype)
            v = torch.randn(b, hkv, prefix + n, d, device=device, dtype=dtype)
            mask = random_tree(n, gen).packed_mask.to(device)[None].expand(b, -1, -1)

            def time_config(config):
                try:
                    return timer.graph(lambda: tree_attention(q, k, v, mask, prefix, **config))
                except (triton.runtime.errors.OutOfResources, RuntimeError):
                    return float("inf")

            default = time_config({})
            timed = [(time_config(c), c) for c in tiles]
            best_ms, best = min(timed, key=lambda x: x[0])
            for splits in (1, 2, 4, 8, 16, 32, 64):
                ms = time_config({**best, "num_splits": splits})
                if ms < best_ms:
                    best_ms, best = ms, {**best, "num_splits": splits}
            rows.append(dict(prefix=prefix, n=n, default_ms=default, best_ms=best_ms, best=best,
                             all=[dict(c, ms=ms) for ms, c in timed]))
            print(f"sweep P={prefix} N={n}: default {default:.4f} ms, best {best_ms:.4f} ms {best}", flush=True)
    return rows


def bench_verify(args, device, timer, gen):
    from flashmm.kernels.verification import verify_tree_greedy, verify_tree_sampling
    from flashmm.verify import draw_uniforms, verify_greedy, verify_tree

    rows = []
    n = 64 if not args.smoke else 17
    tree = random_tree(n, gen)
    for b in ([1, 8] if not args.smoke else [2]):
        logits = torch.randn(b, n, args.vocab, device=device, generator=None) * 4
        best = logits.argmax(-1)
        tokens = best[:, tree.parents.clamp(min=0).to(device)]                # everything matches
        p = logits.softmax(-1)
        q = (logits + torch.randn_like(logits)).softmax(-1)
        u = draw_uniforms(b, n, None, device)
        for name, kernel, torch_fn in [
            ("greedy", lambda: verify_tree_greedy(tokens, tree, logits),
             lambda: verify_greedy(tokens, tree, logits)),
            ("sampling", lambda: verify_tree_sampling(tokens, tree, p, q, uniforms=u),
             lambda: verify_tree(tokens, tree, p, q, uniforms=u)),
        ]:
            got, want = kernel(), torch_fn()
            same = all(torch.equal(getattr(got, f), getattr(want, f))
                       for f in ("path", "accepted_len", "next_token"))
            rows.append(dict(verifier=name, batch=b, n=n, vocab=args.vocab, kernel_ms=timer(kernel),
                             torch_ms=timer(torch_fn), identical=same,
                             accepted=float(got.accepted_len.float().mean())))
    return rows


def bench_kv_keep(args, device, dtype, timer, gen):
    from flashmm.kernels.compaction import kv_keep

    rows = []
    n = 64 if not args.smoke else 9
    for prefix in [int(x) for x in args.prefix.split(",")][-2:]:
        tensors = [torch.randn(args.batch, args.kv_heads, prefix + n, args.head_dim, device=device, dtype=dtype)
                   for _ in range(2 * args.layers)]
        path = torch.tensor([[0, 1, 3, 7, 12, 20][: min(6, n)]] * args.batch, device=device)
        path = path.clamp(max=n - 1).cummax(1).values
        expected = [t.clone() for t in tensors]
        idx = (prefix + path)[:, None, :, None]

        def torch_keep(ts=expected):
            for t in ts:
                rows_kept = t.gather(2, idx.expand(t.shape[0], t.shape[1], -1, t.shape[3]))
                t[:, :, prefix: prefix + path.shape[1]] = rows_kept

        torch_keep()
        kv_keep(tensors, prefix, path)
        same = all(torch.equal(a, e) for a, e in zip(tensors, expected))
        rows.append(dict(prefix=prefix, layers=args.layers, kept=path.shape[1],
                         kernel_ms=timer(lambda: kv_keep(tensors, prefix, path)),
                         torch_ms=timer(torch_keep), identical=same))
    return rows


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            raise SystemExit("no CUDA device: run with --smoke (CPU, TRITON_INTERPRET=1)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from common import machine, markdown_table, write_results   # eval/common.py

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    timer = Timer(cuda, args.smoke)
    bandwidth = copy_bandwidth(device, timer)
    print(f"device copy bandwidth: {bandwidth:.0f} GB/s")

    attention = bench_attention(args, device, dtype, timer, bandwidth, gen)
    verify = bench_verify(args, device, timer, gen)
    keep = bench_kv_keep(args, device, dtype, timer, gen)
    sweep = sweep_tree_attention(args, device, dtype, timer, gen) if args.sweep and cuda else []

    goals = [r for r in attention if r["prefix"] >= 2048]
    summary = dict(
        tree_le_1p2x_causal=all(r["tree_over_causal"] <= 1.2 for r in goals) if goals else None,
        dense_ge_1p5x_tree=all(r["dense_over_tree"] >= 1.5 for r in goals) if goals else None,
        all_identical=all(r["identical"] for r in verify + keep),
    )
    md = [f"# Kernel benchmark ({'smoke, ' if args.smoke else ''}{machine().get('gpu', 'cpu')}, {args.dtype}, "
          f"B={args.batch}, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim})",
          f"\ncopy bandwidth {bandwidth:.0f} GB/s; goals at P >= 2k: {summary}\n",
          "Device times (CUDA-graph replays, L2 flushed before each call). Eager columns: one call from",
          "Python as a model layer makes it (host launch cost included); host us: host time per call",
          "issued back to back. floor = the bytes read and written at the measured copy bandwidth.\n",
          markdown_table(["P", "N", "tree ms", "dense ms", "causal ms", "tree/causal", "dense/tree",
                          "floor ms", "floor/tree", "tree eager ms", "causal eager ms", "tree host us",
                          "causal host us", "err vs ref"],
                         [[r["prefix"], r["n"], r["tree_ms"], r["dense_ms"], r["causal_ms"],
                           r["tree_over_causal"], r["dense_over_tree"], r["floor_ms"], r["bandwidth_frac"],
                           r["tree_eager_ms"], r["causal_eager_ms"], r["tree_host_us"], r["causal_host_us"],
                           f"{r['max_err_vs_ref']:.1e}"]
                          for r in attention]),
          "",
          markdown_table(["verifier", "B", "N", "V", "kernel ms", "torch ms", "identical", "mean accepted"],
                         [[r["verifier"], r["batch"], r["n"], r["vocab"], r["kernel_ms"], r["torch_ms"],
                           r["identical"], r["accepted"]] for r in verify]),
          "",
          markdown_table(["P", "layers", "rows kept", "kv_keep ms", "gather+assign ms", "identical"],
                         [[r["prefix"], r["layers"], r["kept"], r["kernel_ms"], r["torch_ms"], r["identical"]]
                          for r in keep])]
    if sweep:
        md += ["", "tree_attention tuning sweep (device times):\n",
               markdown_table(["P", "N", "default ms", "best ms", "best config"],
                              [[r["prefix"], r["n"], r["default_ms"], r["best_ms"], str(r["best"])]
                               for r in sweep])]
    text = "\n".join(md)
    print(text)
    bad = [r for r in attention if r["max_err_vs_ref"] > (1e-4 if dtype == torch.float32 else 5e-2)]
    if bad or not summary["all_identical"]:
        raise SystemExit(f"kernel outputs differ from their references: {bad or 'verify/kv_keep'}")
    if args.out:
        write_results(args.out, dict(args=vars(args), machine=machine(), copy_gbps=bandwidth,
                                     attention=attention, verify=verify, kv_keep=keep, sweep=sweep,
                                     summary=summary), text)


if __name__ == "__main__":
    main()
