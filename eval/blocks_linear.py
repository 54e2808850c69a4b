"""SmolLM2's linear layers multiplied from their exact 4-bit / 8-bit block codes (flashmm.kernels.blocks) against
oneDNN's fp32 matmul on the packed weights (what the fused step multiplied with before), interleaved, by rows.

    python eval/blocks_linear.py --out eval/results/blocks_linear

Every layer weight of the Q4_1 GGUF (210 of them) and the Q8_0 LM head; each row count timed as the median of
``--repeats`` interleaved rounds. Also checks that every code rebuilds its fp32 weight bit for bit.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from flashmm.kernels import blocks
from flashmm.targets.onednn import packed_weight
from flashmm.weights import load_gguf_lm


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=lambda text: [int(v) for v in text.split(",")], default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.md and OUT.json")
    args = ap.parse_args()
    if blocks.unavailable():
        raise SystemExit(f"the block kernel cannot run here: {blocks.unavailable()}")
    model, _ = load_gguf_lm("smollm2")
    layers = [linear for layer in model.model.layers for linear in
              (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
               layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    groups = {"layers": layers, "LM head": [model.lm_head]}
    encoded = {}
    for name, linears in groups.items():
        encoded[name] = []
        for linear in linears:
            codes = blocks.encode(linear.weight)
            if codes is None or not torch.equal(blocks.reconstruct(codes), linear.weight.detach()):
                raise SystemExit(f"{name}: a weight is not exact blocks")
            encoded[name].append((packed_weight(linear), codes))
    rows_out = []
    with torch.no_grad():
        for name, pairs in encoded.items():
            for rows in args.rows:
                inputs = {k: torch.randn(rows, k) for k in {codes.shape[1] for _, codes in pairs}}
                times = {"blocks": [], "onednn": []}
                for round_ in range(args.repeats + 1):
                    for kind in ("blocks", "onednn"):
                        start = time.perf_counter()
                        for packed, codes in pairs:
                            x = inputs[codes.shape[1]]
                            blocks.linear(x, codes) if kind == "blocks" else _onednn(x, packed)
                        if round_:
                            times[kind].append(time.perf_counter() - start)
                medians = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
                rows_out.append({"weights": name, "rows": rows, "blocks_ms": medians["blocks"],
                                 "onednn_ms": medians["onednn"], "speedup": medians["onednn"] / medians["blocks"]})
                print(rows_out[-1], flush=True)
    machine = (f"{platform.processor() or platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), "
               f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows_out}, indent=1))
    lines = ["# SmolLM2's weights from their exact block codes against oneDNN's fp32 matmul", "",
             f"Machine: {machine}. Command: `python eval/blocks_linear.py --out {args.out}`. Medians of "
             f"{args.repeats} interleaved rounds; every code rebuilds its fp32 weight bit for bit.", "",
             "| weights | rows | blocks ms | oneDNN fp32 ms | oneDNN / blocks |", "|---|---|---|---|---|"]
    lines += [f"| {r['weights']} | {r['rows']} | {r['blocks_ms']:.2f} | {r['onednn_ms']:.2f} | {r['speedup']:.2f}x |"
              for r in rows_out]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
