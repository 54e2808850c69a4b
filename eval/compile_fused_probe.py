"""Would compiling the fused step pay on this CPU? The fused step (flashmm.targets.fused) keeps oneDNN's
packed matmuls and runs everything between them as eager torch ops. This probe compiles exactly that
in-between work with torch.compile (inductor, ``dynamic=False``, ``fullgraph=True``): each layer's
RMSNorm, rotary embedding, residual adds and SiLU gate fuse into generated C++ around the same packed
matmuls, which inductor sees as one opaque custom op (so it cannot swap them for its own GEMMs).
Attention and the cache writes stay as in the fused step. SmolLM2-135M fp32, one row, W tokens after a
150-token prompt; the two forwards alternate step by step on their own caches, medians of milliseconds.

    python eval/compile_fused_probe.py --widths 1 4 8 --steps 60 --out eval/results/compile_fused_probe
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, markdown_table, median, write_results  # noqa: E402
from flashmm.targets import cache as kv  # noqa: E402
from flashmm.targets.fused import append, fused_step  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402

PREFIX = 150


@torch.library.custom_op("flashmm_probe::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@packed_linear.register_fake
def _(x, weight, out_features):
    return x.new_empty(x.shape[0], out_features)


class CompiledBody:
    """The fused step's layers with the work between matmuls compiled: one compiled function from a layer's
    attention output to the next layer's q / k / v."""

    def __init__(self, model):
        self.step = step = fused_step(model)
        config = model.config
        self.width, self.inner = config.hidden_size, config.intermediate_size
        self.heads, self.kv_heads, self.dim = step.heads, step.kv_heads, step.head_dim
        self.first = torch.compile(self._qkv, dynamic=False, fullgraph=True)
        self.middle = torch.compile(self._middle, dynamic=False, fullgraph=True)
        self.last = torch.compile(self._mlp, dynamic=False, fullgraph=True)

    def _qkv(self, x, norm, eps, weight, cos, sin, batch: int, n: int):
        heads, kv_heads, dim = self.heads, self.kv_heads, self.dim
        qkv = packed_linear(F.rms_norm(x, (self.width,), norm, eps), weight, (heads + 2 * kv_heads) * dim)
        qkv = qkv.view(batch, n, heads + 2 * kv_heads, dim)
        qk, v = qkv[:, :, : heads + kv_heads], qkv[:, :, heads + kv_heads:]
        qk = qk * cos + torch.cat([-qk[..., dim // 2:], qk[..., : dim // 2]], dim=-1) * sin
        return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v.transpose(1, 2)

    def _mlp(self, x, attended, o_w, norm, eps, gate_up, down):
        x = x + packed_linear(attended, o_w, self.width)
        gated = packed_linear(F.rms_norm(x, (self.width,), norm, eps), gate_up, 2 * self.inner)
        return x + packed_linear(F.silu(gated[:, : self.inner]) * gated[:, self.inner:], down, self.width)

    def _middle(self, x, attended, o_w, norm2, eps2, gate_up, down, norm1, eps1, qkv_w, cos, sin, batch: int, n: int):
        x = self._mlp(x, attended, o_w, norm2, eps2, gate_up, down)
        return (x, *self._qkv(x, norm1, eps1, qkv_w, cos, sin, batch, n))

    @torch.no_grad()
    def __call__(self, ids, positions, cache):
        step, (batch, n) = self.step, ids.shape
        x = step.embed(ids)
        cos, sin = step.rotary(x, positions)
        cos, sin = cos[:, :, None], sin[:, :, None]
        cached = cache.get_seq_length()
        mask = None
        if n > 1:
            allowed = torch.ones(n, cached + n, dtype=torch.bool).tril(cached)
            mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
        x = x.reshape(batch * n, self.width)
        layers = step.layers
        q, k, v = self.first(x, layers[0][0], layers[0][1], layers[0][2], cos, sin, batch, n)
        for index, layer in enumerate(layers):
            keys, values = append(cache, index, k, v)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=step.scaling,
                                                      enable_gqa=self.heads != self.kv_heads)
            attended = attended.transpose(1, 2).reshape(batch * n, self.heads * self.dim)
            mlp = (layer[5], layer[7], layer[8], layer[9], layer[10])
            if index + 1 < len(layers):
                after = layers[index + 1]
                x, q, k, v = self.middle(x, attended, *mlp, after[0], after[1], after[2], cos, sin, batch, n)
            else:
                x = self.last(x, attended, *mlp)
        x = F.rms_norm(x, (self.width,), *step.final_norm)
        return packed_linear(x, step.head, step.head_rows).view(batch, n, -1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="eval/results/compile_fused_probe")
    args = ap.parse_args(argv)
    command = "python eval/compile_fused_probe.py " + " ".join(sys.argv[1:] if argv is None else argv)
    model, _ = load_gguf_lm("smollm2")
    step, body = fused_step(model), CompiledBody(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, PREFIX), generator=torch.Generator().manual_seed(0))
    rows = []
    for width in args.widths:
        caches = {}
        with torch.no_grad():
            for name in ("fused", "compiled"):
                caches[name] = DynamicCache()
                step(prompt, torch.arange(PREFIX)[None], caches[name])
        tokens = torch.randint(0, model.config.vocab_size, (1, width), generator=torch.Generator().manual_seed(width))
        positions = torch.arange(PREFIX, PREFIX + width)[None]
        start = time.perf_counter()
        compiled_logits = body(tokens, positions, caches["compiled"])
        compile_seconds = time.perf_counter() - start
        with torch.no_grad():
            difference = (compiled_logits - step(tokens, positions, caches["fused"])[0]).abs().max().item()
        times = {"fused": [], "compiled": []}
        for index in range(args.steps):
            for name in (("fused", "compiled") if index % 2 else ("compiled", "fused")):
                kv.crop(caches[name], PREFIX)
                begin = time.perf_counter()
                if name == "fused":
                    with torch.no_grad():
                        step(tokens, positions, caches[name])
                else:
                    body(tokens, positions, caches[name])
                times[name].append(time.perf_counter() - begin)
        fused_ms, compiled_ms = (1e3 * median(times[name]) for name in ("fused", "compiled"))
        rows.append([width, f"{fused_ms:.1f}", f"{compiled_ms:.1f}", f"{fused_ms / compiled_ms:.2f}",
                     f"{compile_seconds:.0f}", f"{difference:.1e}"])
        print(rows[-1], flush=True)
    markdown = (f"# The fused step with inductor around its packed matmuls\n\nCommand: `{command}`\n\n"
                f"Machine: {json.dumps(machine())}\n\n" + __doc__.split("\n\n")[0].replace("\n", " ") + "\n\n"
                + markdown_table(["W", "fused step ms (flashmm today)", "compiled between matmuls ms",
                                  "speed-up", "compile s", "max |Δ logit|"], rows) + "\n")
    print(markdown)
    write_results(args.out, {"command": command, "machine": machine(), "rows": rows}, markdown)


if __name__ == "__main__":
    main()
