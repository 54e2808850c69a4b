"""Build SpecDec++ for SmolLM2's FastDraft: an acceptance head on the draft, and its stop threshold.

    python -m tools.drafters.build_specdecpp --corpus assets/corpus/smollm2 \\
        --draft assets/text_drafters/smollm2/fastdraft --work /tmp/specdecpp_work \\
        --out assets/text_drafters/smollm2/specdecpp

Stages (each cached under --work, so a killed run resumes):
  examples   teacher-forced draft forwards over the greedy answers of --train-sequences corpus
             records (seeded subset of records [0, --heldout-first)) and of --heldout-sequences
             records from --heldout-first on: head inputs and greedy-acceptance labels
             (flashmm.train.acceptance)
  train      the head: AdamW on binary cross-entropy, one checkpoint per epoch
  threshold  exact greedy replay (eval/specdecpp_policy.py) of --calibrate-sequences held-out
             answers for each candidate threshold; the one with the best modeled speedup is kept
The folder references the draft by a relative path (the draft's weights are not copied).
One thread throughout (torch.set_num_threads(1)).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from tools.drafters.specdecpp_replay import cpu_cost_model, greedy_replay, summarize
from flashmm.drafters import load
from flashmm.drafters.nets.specdecpp_net import AcceptanceHead
from flashmm.drafters.specdecpp import SpecDecPP, save_specdecpp
from flashmm.paths import work_dir
from flashmm.train.acceptance import acceptance_examples, head_metrics, train_head
from flashmm.train.corpus import corpus_sequences, read_corpus


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="assets/corpus/smollm2")
    ap.add_argument("--draft", default="assets/text_drafters/smollm2/fastdraft")
    ap.add_argument("--work", default=str(work_dir("specdecpp_work")))
    ap.add_argument("--out", default="assets/text_drafters/smollm2/specdecpp")
    ap.add_argument("--train-sequences", type=int, default=2000)
    ap.add_argument("--heldout-first", type=int, default=3000)
    ap.add_argument("--heldout-sequences", type=int, default=100)
    ap.add_argument("--calibrate-sequences", type=int, default=20)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.7, 0.8, 0.9, 0.95])
    ap.add_argument("--max-draft-tokens", type=int, default=8)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def cached_examples(path: Path, draft_lm, sequences) -> dict:
    if path.exists():
        return torch.load(path, weights_only=True)
    examples = acceptance_examples(draft_lm, sequences, log=log)
    tmp = path.with_suffix(".tmp")
    torch.save(examples, tmp)
    tmp.replace(path)
    return examples


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    records = read_corpus(args.corpus)
    train_ids = sorted(random.Random(args.seed).sample(range(args.heldout_first), args.train_sequences))
    heldout = records[args.heldout_first : args.heldout_first + args.heldout_sequences]
    draft = load(args.draft)
    draft_info = json.loads((Path(args.draft) / "drafter.json").read_text())

    log("stage examples")
    train = cached_examples(work / "examples_train.pt", draft.model, corpus_sequences([records[i] for i in train_ids]))
    test = cached_examples(work / "examples_heldout.pt", draft.model, corpus_sequences(heldout))
    log(f"examples: {len(train['label'])} train, {len(test['label'])} held out; accept rate "
        f"{float(train['label'].float().mean()):.3f}")

    log("stage train")
    head = AcceptanceHead(train["hidden"].shape[1], args.width)
    summary = train_head(head, train, work_dir=work, epochs=args.epochs, lr=args.lr, seed=args.seed, log=log)
    metrics = head_metrics(head, test)
    log(f"held-out head metrics: {json.dumps(metrics)}")

    log("stage threshold")
    from flashmm.weights import load_gguf_lm  # noqa: PLC0415

    target, _ = load_gguf_lm("smollm2", dtype=torch.float32)
    verify_cost, draft_cost = cpu_cost_model(target, draft.model)
    calibrate = heldout[: args.calibrate_sequences]
    replay = {}
    for h in args.thresholds:
        drafter = SpecDecPP(draft.model, head, threshold=h, max_draft_tokens=args.max_draft_tokens)
        counts = [greedy_replay(drafter, r.prompt_ids, r.greedy.ids) for r in calibrate]
        replay[h] = summarize(counts, verify_cost, draft_cost)
        log(f"threshold {h}: {json.dumps(replay[h])}")
    best = max(replay, key=lambda h: replay[h]["modeled_speedup"])

    info = {"method": "specdecpp", "target": draft_info["target"], "threshold": best,
            "max_draft_tokens": args.max_draft_tokens,
            "training": {"draft": args.draft, "corpus": args.corpus, "train_records": len(train_ids),
                         "train_examples": summary["examples"], "epochs": summary["epochs"],
                         "losses": summary["losses"], "lr": args.lr, "seed": args.seed,
                         "labels": "draft argmax == the target's next greedy token (teacher-forced on the greedy "
                                   "corpus answers)",
                         "heldout_records": [args.heldout_first, args.heldout_first + len(heldout)],
                         "heldout_metrics": metrics,
                         "threshold_replay": {str(h): r for h, r in replay.items()},
                         "cost_model": {"draft_forward_in_target_steps": draft_cost,
                                        "verify_relative": {n: verify_cost.relative(n) for n in (2, 4, 9)}},
                         "seconds": time.time() - started},
            "notes": "SpecDec++: stop drafting before the token that makes P(at least one rejection) exceed threshold",
            "command": f"python -m tools.drafters.build_specdecpp --corpus {args.corpus} --draft {args.draft} "
                       f"--work /tmp/specdecpp_work --out {args.out} --train-sequences {args.train_sequences} "
                       f"--thresholds {' '.join(map(str, args.thresholds))} --epochs {args.epochs}"}
    save_specdecpp(args.out, head, args.draft, info)
    log(f"wrote {args.out} (threshold {best}); {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
