"""Does a compiled verification forward pay on this CPU? SmolLM2-135M (fp32) scoring W tree tokens
after a 150-token prefix on a preallocated slot cache (flashmm.targets.graphs.SlotCache, the static cache
a compiled or graph-replayed step needs), timed eagerly through torch's linears, eagerly through
flashmm's packed oneDNN linears (flashmm before its fused step), flashmm's fused step
(flashmm.targets.fused, on its own DynamicCache with the same prefix: what flashmm runs today), and
compiled by torch.compile (inductor,
``dynamic=False``; ``--freezing`` sets inductor's freezing, which packs the weights for oneDNN).
Reports each forward's median milliseconds, the compile seconds per bucket, and the largest logit
difference to the eager forward.

    python eval/compile_probe.py --widths 1 8 [--freezing] --out eval/results/compile_probe
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, markdown_table, median, write_results  # noqa: E402
from flashmm.targets import cache as kv  # noqa: E402
from flashmm.targets.fused import fused_step  # noqa: E402
from flashmm.targets.graphs import SlotCache, prefix_mask  # noqa: E402
from flashmm.targets.onednn import OneDNNLinears  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402

PREFIX = 150


def prefilled(model) -> SlotCache:
    """A SlotCache of 1024 slots holding a random 150-token prefix."""
    config = model.config
    cache = SlotCache(config.num_hidden_layers, 1024)
    cache.write_at = torch.arange(PREFIX)
    mask = prefix_mask(cache, PREFIX, 1, torch.float32, "cpu")
    causal = torch.ones(PREFIX, PREFIX, dtype=torch.bool).tril()
    mask[0, 0, :, :PREFIX] = torch.zeros(PREFIX, PREFIX).masked_fill(~causal, torch.finfo(torch.float32).min)
    ids = torch.randint(0, config.vocab_size, (1, PREFIX), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
              position_ids=torch.arange(PREFIX)[None])
    cache.length = PREFIX
    return cache


def step_inputs(model, cache: SlotCache, width: int):
    """(tokens [1, W], write_at [W], mask [1, 1, W, capacity], positions [1, W]) of a W-token chain."""
    tokens = torch.randint(0, model.config.vocab_size, (1, width), generator=torch.Generator().manual_seed(width))
    mask = prefix_mask(cache, width, 1, torch.float32, "cpu")
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask[0, 0, :, PREFIX : PREFIX + width] = torch.zeros(width, width).masked_fill(~causal,
                                                                                  torch.finfo(torch.float32).min)
    return tokens, torch.arange(PREFIX, PREFIX + width), mask, torch.arange(PREFIX, PREFIX + width)[None]


def forward(model, cache, tokens, write_at, mask, positions):
    cache.write_at = write_at
    return model(input_ids=tokens, attention_mask=mask, past_key_values=cache, use_cache=True,
                 position_ids=positions).logits


def fused_forward(model, cache, tokens, positions):
    """The fused step's W-token chain after the prefix (cropped back to it first)."""
    kv.crop(cache, PREFIX)
    return fused_step(model)(tokens, positions, cache)[0]


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() after two warm-up calls."""
    with torch.no_grad():
        fn(), fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return 1e3 * median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--freezing", action="store_true")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="eval/results/compile_probe")
    args = ap.parse_args(argv)
    command = "python eval/compile_probe.py " + " ".join(sys.argv[1:] if argv is None else argv)
    model, _ = load_gguf_lm("smollm2")
    cache = prefilled(model)
    fused_cache = DynamicCache()
    with torch.no_grad():
        fused_step(model)(torch.randint(0, model.config.vocab_size, (1, PREFIX), generator=torch.Generator().manual_seed(0)),
                          torch.arange(PREFIX)[None], fused_cache)
    if args.freezing:
        import torch._inductor.config as inductor  # noqa: PLC0415

        inductor.freezing = True
    compiled = torch.compile(model, dynamic=False)
    rows = []
    for width in args.widths:
        inputs = step_inputs(model, cache, width)
        eager = timed(lambda: forward(model, cache, *inputs), args.repeats)
        with OneDNNLinears(model):
            onednn = timed(lambda: forward(model, cache, *inputs), args.repeats)
        fused = timed(lambda: fused_forward(model, fused_cache, inputs[0], inputs[3]), args.repeats)
        start = time.perf_counter()
        with torch.no_grad():
            forward(compiled, cache, *inputs)
        compile_seconds = time.perf_counter() - start
        fast = timed(lambda: forward(compiled, cache, *inputs), args.repeats)
        with torch.no_grad():
            difference = (forward(compiled, cache, *inputs) - forward(model, cache, *inputs)).abs().max().item()
        rows.append([width, f"{eager:.1f}", f"{onednn:.1f}", f"{fused:.1f}", f"{fast:.1f}", f"{compile_seconds:.0f}",
                     f"{difference:.1e}"])
        print(rows[-1], flush=True)
    markdown = (f"# A compiled verification forward on this CPU\n\nCommand: `{command}`\n\n"
                f"Machine: {json.dumps(machine())}\n\nSmolLM2-135M fp32, W tokens after a {PREFIX}-token prefix on a "
                "1024-slot SlotCache; medians of milliseconds per forward.\n\n"
                + markdown_table(["W", "eager, torch linears", "eager, packed oneDNN (flashmm before)",
                                  "fused step (flashmm today)",
                                  "torch.compile" + (" (freezing)" if args.freezing else ""), "compile s",
                                  "max |Δ logit|"], rows) + "\n")
    print(markdown)
    write_results(args.out, {"command": command, "machine": machine(), "rows": rows}, markdown)


if __name__ == "__main__":
    main()
