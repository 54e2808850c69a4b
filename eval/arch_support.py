"""Support table: every causal-LM and image-text-to-text architecture transformers registers,
built tiny and random, decoded by ``model.generate`` and by flashmm.

For each (model_type, class) in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``: the config class's defaults are shrunk generically
(hidden sizes, layers, heads, experts; ``OVERRIDES`` by hand where that is not enough), the model
is built with random weights (fp32, CPU, output layer sharpened so greedy has no near-ties), and

  1. ``model.generate`` decodes 20 greedy tokens (if it cannot, the row says "transformers fails");
  2. flashmm decodes the same prompt with prompt lookup, with drafter = target (a chain, 4 tokens)
     and drafter = target as a width-2 tree: each token-identical to ``model.generate``, τ > 1 for
     drafter = target; or ``flashmm.wrap`` refuses (``UnsupportedModel``) with the reason.

Each architecture runs in a forked child (1 thread) with a time limit. Rows: exact, refused,
transformers fails, build fails (the tiny construction failed: a gap of this script), and the
outcomes that must not happen: wrong (different tokens), crash (an error inside flashmm), timeout.

    OMP_NUM_THREADS=1 python eval/arch_support.py [--only llama,qwen3_moe] [--timeout 120]
    OMP_NUM_THREADS=1 python eval/arch_support.py --only mamba,bamba --redo   # re-run these rows only

writes eval/results/arch_support.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,  # noqa: E402
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

import flashmm  # noqa: E402
from flashmm.drafters import DraftModel, PromptLookup  # noqa: E402
from flashmm.targets.support import UnsupportedModel  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MAX_NEW = 20
PROMPT_LEN = 12  # repeated once, so prompt lookup finds matches

# generic shrink: config key -> tiny value
SIZES = {
    **dict.fromkeys(["hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "model_dim", "dim",
                     "word_embed_proj_dim", "embedding_size", "projection_dim", "text_hidden_size",
                     "vision_hidden_size", "hidden_size_per_head_x_heads"], 64),
    **dict.fromkeys(["intermediate_size", "ffn_dim", "n_inner", "d_ff", "decoder_ffn_dim", "encoder_ffn_dim",
                     "ffn_hidden_size", "mlp_dim", "inner_hidden_size", "intermediate_dim"], 128),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                     "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "shared_intermediate_size",
                     "expert_hidden_size", "moe_hidden_size"], 32),
    **dict.fromkeys(["num_attention_heads", "n_head", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "n_heads", "attention_heads"], 4),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                     "num_query_groups"], 2),
    **dict.fromkeys(["head_dim", "attention_head_dim", "kv_channels", "d_head", "d_kv"], 16),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
                     "ffn_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "moe_k", "num_selected_experts", "top_k_experts",
                     "moe_top_k", "num_experts_per_token"], 2),
    **dict.fromkeys(["n_group", "topk_group", "n_shared_experts", "num_shared_experts", "moe_num_shared_experts",
                     "first_k_dense_replace", "decoder_sparse_step"], 1),
    # multi-head latent attention: rope dims equal head_dim, which MLA configs tie to the rotary part
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 32, "rotary_dim": 8, "rope_dim": 8,
}
# sizes some default configs leave None for the model to derive from full-size values
FILL_NONE = ("head_dim", "num_key_value_heads", "moe_intermediate_size", "intermediate_size")
LAYER_KEYS = ["num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
              "depth", "num_decoder_layers", "num_encoder_layers"]
MAX_LAYERS = 8  # a hybrid keeps the shortest prefix of layers that holds every layer type, up to this

# by-hand settings where the generic shrink is not enough: model_type -> config kwargs
OVERRIDES: dict[str, dict] = {
    "mamba2": dict(head_dim=32),  # num_heads * head_dim == expand * hidden_size
    "bamba": dict(mamba_n_heads=4, mamba_d_head=32),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=32),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    "gemma4_unified_assistant": dict(hidden_size_per_layer_input=0),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1),
    "dots3_note": dict(num_key_value_heads=4, head_dim=32),
    "dots3_note_text": dict(num_key_value_heads=4, head_dim=32),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # hybrid / recurrent: keep one recurrent and one attention layer, and recurrent sizes that fit hidden_size 64
    "mamba2": dict(head_dim=32, n_groups=1, state_size=16),
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, mamba_dt_rank=8, mamba_d_state=8, use_mamba_kernels=False),
    "bamba": dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, num_hidden_layers=2, attn_layer_indices=[1]),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, num_hidden_layers=2,
                             layer_types=["linear_attention", "full_attention"]),
    "zamba2": dict(num_hidden_layers=2, layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1],
                   mamba_headdim=16, n_mamba_heads=8, mamba_d_state=16, attention_head_dim=32,
                   attention_hidden_size=128,
                   use_mamba_kernels=False),
    "kimi_linear": dict(linear_num_heads=4, linear_head_dim=16, num_key_value_heads=4),
    "lfm2": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "lfm2_vl": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "recurrent_gemma": dict(num_hidden_layers=2, block_types=["recurrent", "attention"]),
    "bailing_hybrid": dict(num_expert_group=1, linear_num_heads=4, linear_head_dim=16, num_key_value_heads=4),
    "zamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, attention_hidden_size=128,
                  mamba_dt_rank=8, layers_block_type=["linear_attention", "hybrid"] * 2, use_mamba_kernels=False),
}


def architectures() -> list[tuple[str, str, str]]:
    """[(model_type, class name, mapping)] of both mappings, one row per (model_type, class)."""
    rows, seen = [], set()
    for mapping, names in (("causal-lm", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                           ("image-text-to-text", MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)):
        for model_type, cls_name in names.items():
            if (model_type, cls_name) not in seen:
                seen.add((model_type, cls_name))
                rows.append((model_type, cls_name, mapping))
    return rows


# ---------------------------------------------------------------------------- tiny configs
def _special_ids(d: dict) -> list[int]:
    out = []
    for key, value in d.items():
        if isinstance(value, dict):
            out += _special_ids(value)
        elif isinstance(key, str) and ("token_id" in key or "token_index" in key):
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    out.append(v)
    return out


def _layer_selection(d: dict, num_layers: int) -> list[int]:
    types = d.get("layer_types") or d.get("layers_block_type") or d.get("hybrid_override_pattern")
    if isinstance(types, str):
        types = list(types)
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        return list(range(min(2, num_layers)))
    wanted, sel = set(map(str, types)), []
    for i, t in enumerate(types):
        sel.append(i)
        if set(map(str, (types[j] for j in sel))) == wanted and len(sel) >= 2:
            break
    return sel[:MAX_LAYERS]


def shrink(d: dict) -> dict:
    """A config dict with every size made tiny; per-layer lists follow the kept layers."""
    d = dict(d)
    for key, value in list(d.items()):
        if isinstance(value, dict) and ("model_type" in value or key.endswith("config")):
            d[key] = shrink(value)
        elif key in FILL_NONE and value is None:
            d[key] = SIZES[key]
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            d[key] = min(value, SIZES[key]) if key in ("first_k_dense_replace", "decoder_sparse_step") \
                else SIZES[key]
    for key in LAYER_KEYS:
        layers = d.get(key)
        if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0:
            continue
        sel = _layer_selection(d, layers)
        d[key] = len(sel)
        for k, v in list(d.items()):
            if isinstance(v, (list, tuple)) and len(v) == layers and layers > 1:
                d[k] = [v[i] for i in sel]
            elif isinstance(v, str) and len(v) == layers and k.endswith("pattern"):
                d[k] = "".join(v[i] for i in sel)
        if isinstance(d.get("per_layer_config"), dict):  # {layer index: overrides} of the kept layers
            d["per_layer_config"] = {str(sel.index(int(i))): v for i, v in d["per_layer_config"].items()
                                     if int(i) in sel}
    if "vocab_size" in d and isinstance(d["vocab_size"], int):
        d["vocab_size"] = max([256] + [i + 1 for i in _special_ids(d) if i < 300_000])
    return d


def tiny_model(model_type: str, cls_name: str) -> torch.nn.Module:
    model_cls = getattr(transformers, cls_name)
    # a *ForCausalLM registered under a composite model_type (qwen3_5, llama4) takes the text config
    config_cls = getattr(model_cls, "config_class", None) or CONFIG_MAPPING[model_type]
    small = shrink(config_cls().to_dict())
    for part in [small] + [v for k, v in small.items() if k == "text_config" and isinstance(v, dict)]:
        part.update(OVERRIDES.get(model_type, {}))
    config = config_cls.from_dict(small)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # random logits are near-uniform: sharpen them so greedy has no near-ties
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None  # decode MAX_NEW tokens every time
    return model


# ---------------------------------------------------------------------------- one architecture
def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def check(model_type: str, cls_name: str) -> dict:
    """Build, decode with transformers, decode with flashmm; the row of the table."""
    row = dict(model_type=model_type, cls=cls_name)
    t0 = time.perf_counter()
    try:
        model = tiny_model(model_type, cls_name)
    except Exception as error:  # noqa: BLE001 (a row of the table, not a failure of the script)
        return dict(row, outcome="build fails", reason=_short(error))
    row["params"] = sum(p.numel() for p in model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    special = set(_special_ids(model.config.to_dict()))  # placeholders (image / video ids) are not text
    allowed = torch.tensor([i for i in range(3, min(vocab, 256)) if i not in special])
    ids = allowed[torch.randint(0, len(allowed), (1, PROMPT_LEN), generator=g)]
    ids = torch.cat([ids, ids], dim=1)
    try:
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
        if ref.shape[1] != ids.shape[1] + MAX_NEW:
            raise RuntimeError(f"generate returned {ref.shape[1] - ids.shape[1]} new tokens, not {MAX_NEW}")
    except Exception as error:  # noqa: BLE001
        return dict(row, outcome="transformers fails", reason=_short(error))
    runs = [("prompt lookup", lambda: PromptLookup()),
            ("drafter = target", lambda: DraftModel(model, max_draft_tokens=4, adaptive=False)),
            ("drafter = target, tree", lambda: DraftModel(model, max_draft_tokens=8, tree_width=2, adaptive=False))]
    taus = {}
    for name, make in runs:
        try:
            sm = flashmm.wrap(model, make())
        except UnsupportedModel as refusal:
            return dict(row, outcome="refused", reason=str(refusal), seconds=time.perf_counter() - t0)
        try:
            out = sm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
        except Exception as error:  # noqa: BLE001
            return dict(row, outcome="crash", reason=f"{name}: {_short(error)}",
                        trace=traceback.format_exc()[-3000:])
        taus[name] = sm.last_stats.tau
        if not torch.equal(out, ref):
            first = int((out[0, : ref.shape[1]] != ref[0, : out.shape[1]]).nonzero()[0, 0]) - ids.shape[1] \
                if out.shape == ref.shape else -1
            return dict(row, outcome="wrong", reason=f"{name}: tokens differ from model.generate "
                        f"(first at new token {first})", taus=taus)
    row.update(taus=taus, seconds=time.perf_counter() - t0)
    if taus["drafter = target"] <= 1:
        return dict(row, outcome="wrong", reason=f"tau {taus['drafter = target']:.2f} <= 1 with drafter = target")
    note = ""
    if getattr(sm.target, "stepwise", False):
        note = ("recurrent (Mamba-1 mixer: a multi-token forward restarts its scan): states snapshot and "
                "restored, drafts verified one token per forward")
    elif getattr(sm.target, "recurrent", False):
        note = ("recurrent / hybrid: states snapshot before each verification, restored and the accepted tokens "
                "replayed on partial acceptance; chains in one forward, trees one branch per forward")
    return dict(row, outcome="exact", reason=note)


def _child(model_type: str, cls_name: str, conn) -> None:
    torch.set_num_threads(1)
    import warnings  # noqa: PLC0415

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    try:
        conn.send(check(model_type, cls_name))
    except BaseException as error:  # noqa: BLE001
        conn.send(dict(model_type=model_type, cls=cls_name, outcome="crash", reason=f"script: {_short(error)}"))


def run_one(model_type: str, cls_name: str, timeout: float) -> dict:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(model_type, cls_name, child))
    start = time.perf_counter()
    proc.start()
    child.close()
    row = None
    if parent.poll(timeout):
        try:
            row = parent.recv()
        except EOFError:
            row = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if row is None:
        why = f"no result in {timeout:.0f} s" if time.perf_counter() - start >= timeout \
            else f"the process died (exit {proc.exitcode})"
        row = dict(model_type=model_type, cls=cls_name, outcome="timeout" if "no result" in why else "crash",
                   reason=why)
    row["wall_s"] = round(time.perf_counter() - start, 1)
    return row


# ---------------------------------------------------------------------------- table
ORDER = ["exact", "refused", "transformers fails", "build fails", "wrong", "crash", "timeout"]


def write_table(rows: list[dict], command: str, seconds: float, path: Path, updates: list[str] = ()) -> None:
    machine = f"{platform.machine()} {platform.processor() or ''}".strip()
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ORDER}
    total = len(architectures())
    meta = dict(command=command, machine=machine, rows=len(rows), registered=total, cpus=os.cpu_count(), threads=1, torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(), seconds=round(seconds),
                counts=counts, updates=list(updates))
    path.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str) + "\n")
    lines = ["# flashmm architecture support", "",
             f"Every architecture in transformers {transformers.__version__}'s `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` "
             "and `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, built tiny and random (fp32, CPU), decoded greedily "
             f"for {MAX_NEW} tokens by `model.generate` and by flashmm with prompt lookup, drafter = target "
             "(chain of 4) and drafter = target (width-2 tree). **exact**: all three token-identical to "
             "`model.generate`, τ > 1 with drafter = target. **refused**: `flashmm.wrap` raises "
             "`UnsupportedModel` naming the reason. **transformers fails**: `model.generate` itself cannot decode "
             "the tiny model (some of these come from this script's shrinking, e.g. a rope section sized for the "
             "full head: read the reason). **build fails**: this script could not build the tiny config (no flashmm "
             "result; add an `OVERRIDES` entry). Vision-language models are decoded here as text (no image); their visual adapters "
             "are tested in tests/test_multimodal_targets.py. Hybrid and recurrent models (conv / SSM / "
             "linear-attention layers: Mamba, Mamba-2, Jamba, Bamba, Falcon-H1, Zamba2, Nemotron-H, Qwen3-Next, "
             "Qwen3.5, Kimi-Linear, LFM2, OLMo-hybrid, ...) verify chains in one forward and trees one root-to-leaf "
             "branch per forward (flashmm.targets.recurrent: exact, but draft chains for speed); Mamba-1 mixers "
             "(Mamba, Falcon-Mamba, Jamba), whose multi-token forward restarts the scan, verify one token per "
             "forward (exact, no speed-up).", "",
             f"Command: `{command}` — machine: {machine}, {os.cpu_count()} CPUs, 1 thread; torch {torch.__version__}, "
             f"python {platform.python_version()}; {seconds / 60:.1f} min (sum of the per-architecture wall times)."
             + "".join(f" Rows re-run since: `{u}`." for u in updates), "",
             f"Rows: {len(rows)} of the {total} registered (model_type, class) pairs"
             + ("." if len(rows) >= total else " (a partial run: `--resume` adds the rest)."), "",
             "| outcome | count |", "|---|---|"]
    lines += [f"| {o} | {n} |" for o, n in counts.items() if n]
    lines += ["", "| model_type | class | outcome | τ (drafter = target) | reason |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (ORDER.index(r["outcome"]), r["model_type"])):
        tau = r.get("taus", {}).get("drafter = target")
        reason = str(r.get("reason", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['model_type']} | {r['cls']} | {r['outcome']} | "
                     f"{'' if tau is None else f'{tau:.2f}'} | {reason} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model_types (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture")
    parser.add_argument("--out", default=str(RESULTS / "arch_support"), help="output path without suffix")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in --out's json")
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from --out's json, run nothing")
    parser.add_argument("--redo", action="store_true",
                        help="re-run the --only rows and keep every other row of --out's json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    only = set(filter(None, args.only.split(",")))
    archs = [a for a in architectures() if not only or a[0] in only]
    out = Path(args.out)
    rows, seconds, updates = [], 0.0, []
    if (args.resume or args.table_only or args.redo) and out.with_suffix(".json").exists():  # an earlier run
        saved = json.loads(out.with_suffix(".json").read_text())
        rows, seconds, updates = saved["rows"], saved["meta"]["seconds"], saved["meta"].get("updates", [])
    if args.table_only:
        write_table(rows, saved["meta"]["command"], seconds, out, updates)
        return
    command = "OMP_NUM_THREADS=1 python eval/arch_support.py" + "".join(
        f" {a}" for a in sys.argv[1:] if a != "--resume")
    if args.redo:  # the first run's command stays the table's; this one is listed as an update
        seconds -= sum(r.get("wall_s", 0) for r in rows if r["model_type"] in only)
        rows = [r for r in rows if r["model_type"] not in only]
        command, updates = saved["meta"]["command"], updates + [command]
    done = {(r["model_type"], r["cls"]) for r in rows}
    for model_type, cls_name, mapping in archs:
        if (model_type, cls_name) in done:
            continue
        row = run_one(model_type, cls_name, args.timeout)
        row["mapping"] = mapping
        rows.append(row)
        seconds += row["wall_s"]
        print(f"{model_type:28s} {cls_name:44s} {row['outcome']:18s} {row.get('wall_s', 0):6.1f}s "
              f"{str(row.get('reason', ''))[:150]}", flush=True)
        write_table(rows, command, seconds, out, updates)  # after every row: a stopped run resumes (--resume)


if __name__ == "__main__":
    main()
