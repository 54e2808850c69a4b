"""What one verification step costs on a GPU, by tree size: eager, CUDA-graph replay, and the compiled
plain decode step beside them.

    python eval/gpu_step_cost.py --out eval/results/gpu_step_cost_h200

The model is SmolLM2-135M's architecture (LlamaForCausalLM: 30 layers, d = 576, 9/3 heads, V = 49152)
with random weights: a step's time does not depend on the weights' values, and the shape then needs
no weights on the machine. For each dtype and prefix length P, a P-token prompt is prefilled and a
chain of N nodes is verified repeatedly after it (the cache rolled back to P each time):

  eager     flashmm's ordinary tree forward (DynamicCache, 4D mask), host time per call, synchronised
  graphs    the same with cuda_graphs=True: the whole forward_tree call (mask, inputs, replay, copies out)
  replay    the captured graph's replay alone, device time (CUDA events)
  compiled  transformers' compiled StaticCache decode, ms per token (generate of 65 tokens minus 1 token,
            divided by 64): the plain baseline's step

Medians of --repeats calls after warm-up.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, markdown_table, timed, write_results  # noqa: E402

from flashmm.targets import make_target  # noqa: E402
from flashmm.targets.cache import cache_argument  # noqa: E402
from flashmm.tree.token_tree import TokenTree  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def step_ms(target, seq, prefix_len: int, n: int, repeats: int) -> float:
    """Median ms of forward_tree of an n-node chain after prefix_len tokens cached in ``seq`` (rolled back
    after each)."""
    tokens = torch.randint(3, 1000, (1, n), device=target.device)
    tree = TokenTree.chain(n - 1)
    root = torch.zeros(1, 1, dtype=torch.long)

    def one():
        prefix = seq.length
        target.forward_tree(seq, tokens, tree, False)
        target.commit(seq, root, prefix)  # keep the root: the cache is back at prefix_len + 1 ...

    times = []
    for i in range(repeats + 3):
        ms = timed(one)[1] * 1e3
        _roll_back(target, seq, prefix_len)
        if i >= 3:
            times.append(ms)
    return statistics.median(times)


def _roll_back(target, seq, prefix_len: int) -> None:
    from flashmm.targets import cache as kv  # noqa: PLC0415

    if target.cuda_graphs:
        seq.kv.length = prefix_len
    else:
        kv.crop(seq.kv, prefix_len)


def replay_ms(target, n: int, repeats: int) -> float | None:
    if not torch.cuda.is_available():
        return None
    graph = next((entry[0] for key, entry in target._graphs.graphs.items() if key[0][1] == n), None)
    if graph is None:
        return None
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compiled_ms_per_token(model, prefix_len: int) -> float | None:
    from transformers import StaticCache  # noqa: PLC0415

    cache = StaticCache(config=model.config, max_cache_len=prefix_len + 128)
    ids = torch.randint(3, 1000, (1, prefix_len), device=model.device)

    def run(n):
        cache.reset()
        model.generate(ids, **{cache_argument(model, "prepare_inputs_for_generation"): cache}, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    for _ in range(3):
        run(65)   # compile, capture
    one = statistics.median(timed(lambda: run(1))[1] * 1e3 for _ in range(3))
    many = statistics.median(timed(lambda: run(65))[1] * 1e3 for _ in range(3))
    return (many - one) / 64


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--prefix", nargs="+", type=int, default=[256, 1024])
    ap.add_argument("--nodes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled plain step (compiling takes minutes)")
    ap.add_argument("--tiny", action="store_true", help="2 layers, d = 64: a smoke test anywhere")
    ap.add_argument("--out", default="eval/results/gpu_step_cost")
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = dict(SMOLLM2, **(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2) if args.tiny else {}))
    rows = []
    for name in args.dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**config)).to(device=device, dtype=dtype).eval()
        for prefix_len in args.prefix:
            prompt = torch.randint(3, 1000, (1, prefix_len), device=device)
            compiled = compiled_ms_per_token(model, prefix_len) if device == "cuda" and not args.no_compiled else None
            targets = {}
            for graphs in (False, True):
                target = make_target(model)
                if graphs:
                    target.use_cuda_graphs()
                with torch.no_grad():
                    targets[graphs] = (target, target.prefill(prompt, None, False)[1])
            for n in args.nodes:
                with torch.no_grad():
                    eager = step_ms(*targets[False], prefix_len, n, args.repeats)
                    graphed = step_ms(*targets[True], prefix_len, n, args.repeats)
                rows.append(dict(dtype=name, prefix=prefix_len, nodes=n, eager_ms=eager, graphs_ms=graphed,
                                 replay_ms=replay_ms(targets[True][0], n, args.repeats), compiled_ms_per_token=compiled))
                print(rows[-1], flush=True)
    info = machine()
    table = markdown_table(["dtype", "P", "N", "eager ms", "graphs ms", "replay ms", "compiled plain ms/token"],
                           [[r["dtype"], r["prefix"], r["nodes"], r["eager_ms"], r["graphs_ms"],
                             "-" if r["replay_ms"] is None else r["replay_ms"],
                             "-" if r["compiled_ms_per_token"] is None else r["compiled_ms_per_token"]] for r in rows])
    text = (f"# Verification step cost by tree size ({info.get('gpu', 'cpu')}, SmolLM2-135M shape"
            f"{', tiny' if args.tiny else ''})\n\nMachine: {info}\n\nCommand: `python eval/gpu_step_cost.py "
            f"{' '.join(sys.argv[1:] if argv is None else argv)}`\n\n" + table + "\n")
    write_results(args.out, {"machine": info, "args": vars(args), "rows": rows}, text)
    print(text)


if __name__ == "__main__":
    main()
