"""What keeping a hybrid model's recurrent states exact costs per verification step (flashmm.targets.recurrent).

On tiny random hybrids (eval/arch_support.py's construction; fp32, CPU, 1 thread), drafter = the
target itself, chains of 4 drafted tokens, greedy:

  all accepted   DraftModel: every draft accepted whole, so the states after the forward are already
                 right: the only extra work is the snapshot taken before each verification forward.
  2 of 4         the same drafter with its third token replaced: every step restores the snapshot and
                 replays 3 accepted tokens (root + 2) in front of the next draft (5 + 3 = 8 tokens).

Reported: snapshot and restore time per call, the target's verification time per step (its forward
and commit: snapshot, restore and replay included), and the forward time of 8 tokens against 5 at
the same cache length (what 3 replayed tokens add to a forward); all in CPU ms of this process
(1 thread: not inflated by other processes on a shared machine). Medians of ``--repeats`` runs.

    OMP_NUM_THREADS=1 python eval/hybrid_cost.py [--models qwen3_5_text,bamba] [--repeats 3]

writes eval/results/hybrid_cost.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flashmm  # noqa: E402
from arch_support import architectures, tiny_model  # noqa: E402
from flashmm.drafters import DraftModel  # noqa: E402
from flashmm.targets import CausalLMTarget, recurrent  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class WrongThirdToken(DraftModel):
    """drafter = target with the third drafted token replaced: greedy accepts exactly two per step."""

    def propose(self, committed, max_tokens, sampling, generator):
        draft = super().propose(committed, max_tokens, sampling, generator)
        if draft.tokens.shape[1] > 3:
            draft.tokens[0, 3] = (draft.tokens[0, 3] + 1) % self._target_vocab
        return draft


# (class, method) pairs timed while a run is active; CPU seconds of this process (1 thread), so
# other processes on a shared machine do not inflate them as they would wall-clock times
TIMED = [(recurrent.RecurrentCache, "snapshot"), (recurrent.RecurrentCache, "restore"),
         (CausalLMTarget, "forward_tree"), (CausalLMTarget, "commit")]


class Timed:
    """Adds up the CPU seconds spent in each TIMED method while active."""

    def __init__(self):
        self.seconds = {name: 0.0 for _, name in TIMED}
        self.calls = {name: 0 for _, name in TIMED}

    def __enter__(self):
        self._saved = [(cls, name, getattr(cls, name)) for cls, name in TIMED]
        for cls, name, method in self._saved:
            setattr(cls, name, self._timed(name, method))
        return self

    def _timed(self, name, method):
        def run(obj, *args):
            t0 = time.process_time()
            out = method(obj, *args)
            self.seconds[name] += time.process_time() - t0
            self.calls[name] += 1
            return out
        return run

    def __exit__(self, *exc):
        for cls, name, method in self._saved:
            setattr(cls, name, method)


def one_run(model, ids, drafter, max_new: int) -> dict:
    sm = flashmm.wrap(model, drafter)
    with Timed() as timed:
        sm.generate(ids, max_new_tokens=max_new, do_sample=False)
    stats = sm.last_stats
    steps = stats.verify_steps
    # per call: the drafter's recurrent cache snapshots and restores too (same state size as the target's);
    # verify_ms: the target's verification forward and commit per step (snapshot, restore, replay included)
    verify = timed.seconds["forward_tree"] + timed.seconds["commit"]
    return dict(steps=steps, tau=stats.tau, verify_ms=1e3 * verify / steps,
                snapshot_ms=1e3 * timed.seconds["snapshot"] / max(timed.calls["snapshot"], 1),
                restore_ms=1e3 * timed.seconds["restore"] / max(timed.calls["restore"], 1))


def forward_ms(model, ids, extra: int, repeats: int = 20) -> float:
    """Median ms of a forward of `extra` tokens after a cache of ids."""
    cache_arg = recurrent.cache_argument(model)
    times = []
    for _ in range(repeats):
        cache = recurrent.RecurrentCache(model.config.get_text_config(decoder=True))
        model(input_ids=ids, use_cache=True, **{cache_arg: cache})
        t0 = time.process_time()
        model(input_ids=ids[:, :extra], use_cache=True, **{cache_arg: cache})
        times.append(time.process_time() - t0)
    return 1e3 * statistics.median(times)


def measure(model_type: str, repeats: int, max_new: int) -> dict:
    cls = dict((m, c) for m, c, _ in architectures())[model_type]
    model = tiny_model(model_type, cls)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (1, 12), generator=g)
    ids = torch.cat([ids, ids], 1)
    runs = {"all accepted": [], "2 of 4": []}
    with torch.no_grad():
        for _ in range(repeats):
            runs["all accepted"].append(one_run(model, ids, DraftModel(model, max_draft_tokens=4, adaptive=False),
                                                max_new))
            runs["2 of 4"].append(one_run(model, ids, WrongThirdToken(model, max_draft_tokens=4, adaptive=False),
                                          max_new))
        fwd5, fwd8 = forward_ms(model, ids, 5), forward_ms(model, ids, 8)
    row = dict(model_type=model_type, cls=cls, params=sum(p.numel() for p in model.parameters()),
               state_mb=sum(t.numel() * t.element_size() for _, conv, rec, _ in _states(model, ids)
                            for t in [*conv.values(), *rec.values()] if t is not None) / 2**20,
               forward_5_ms=fwd5, forward_8_ms=fwd8)
    for name, rs in runs.items():
        row[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    return row


def _states(model, ids):
    cache = recurrent.RecurrentCache(model.config.get_text_config(decoder=True))
    model(input_ids=ids, use_cache=True, **{recurrent.cache_argument(model): cache})
    return cache.snapshot().states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3_5_text,bamba")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    rows = [measure(m, args.repeats, args.max_new) for m in args.models.split(",")]
    for r in rows:
        a, p = r["all accepted"], r["2 of 4"]
        print(f"{r['model_type']:14s} state {r['state_mb']:.3f} MiB | snapshot {a['snapshot_ms']:.3f} ms, restore "
              f"{p['restore_ms']:.3f} ms | verify step: all accepted {a['verify_ms']:.2f} ms (tau {a['tau']:.2f}), "
              f"2 of 4 {p['verify_ms']:.2f} ms (tau {p['tau']:.2f}) | "
              f"forward 5 tokens {r['forward_5_ms']:.2f} ms, 8 tokens {r['forward_8_ms']:.2f} ms")
    meta = dict(command="OMP_NUM_THREADS=1 python eval/hybrid_cost.py " + " ".join(sys.argv[1:]),
                torch=torch.__version__, transformers=transformers.__version__, cpus=os.cpu_count(), threads=1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hybrid_cost.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
