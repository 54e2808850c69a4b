"""Build SmolLM2's S2D drafter: the shipped FastDraft grown to a nested draft, sorted-trained, thresholds chosen.

    python -m tools.drafters.build_s2d --corpus assets/corpus/smollm2 --work /tmp/s2d_work \\
        --out assets/text_drafters/smollm2/s2d [--layers 4 --exits 1,2,4] [--max-minutes 25]

Steps (checkpointed under --work; a killed or time-limited run resumes where it stopped):
  1. start from --init (the shipped FastDraft, 2 layers), grown to --layers with identity layers
     (flashmm.train.sorted.deepen), so the start computes exactly FastDraft at every exit >= 2;
  2. sorted training (S2D's SoFT): the sum over --exits of the next-token CE on the target's greedy
     answers of the corpus records not held out (draft_lm.train_draft with a SortedLoss);
  3. per exit but the deepest, the lowest confidence threshold whose early answers agree with the
     target's tokens at most --tolerance less often than the deepest exit's, on --heldout corpus
     records that were never trained on (never the Spec-Bench questions);
  4. export (fp16) to --out.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from flashmm.drafters.fastdraft import load_reduced_lm
from flashmm.drafters.nets.reduced_vocab import ReducedVocabLM
from flashmm.drafters.s2d import save_s2d
from flashmm.paths import work_dir
from flashmm.train import draft_lm as T
from flashmm.train.corpus import corpus_sequences, read_corpus, read_info
from flashmm.train.sorted import deepen, train_nested


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="assets/corpus/smollm2")
    ap.add_argument("--init", default="assets/text_drafters/smollm2/fastdraft_scratch")
    ap.add_argument("--work", default=str(work_dir("s2d_work")))
    ap.add_argument("--out", default="assets/text_drafters/smollm2/s2d")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--exits", default="1,2,4")
    ap.add_argument("--epochs", type=float, default=0.5, help="passes over the training answers")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tokens-per-batch", type=int, default=8192)
    ap.add_argument("--heldout", type=int, default=160, help="corpus records kept out of training for thresholds")
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (checkpointed) after this long")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    start = time.time()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    exits = tuple(int(e) for e in a.exits.split(","))
    fastdraft, init_info, _ = load_reduced_lm(a.init)
    draft = ReducedVocabLM(deepen(fastdraft.lm, a.layers), fastdraft.draft_to_target, fastdraft.target_vocab)
    rows = T.target_rows(draft.draft_to_target, draft.target_vocab)
    end_id = draft.lm.config.eos_token_id  # the corpus answers' end-of-turn id (FastDraft's vocabulary keeps it)

    records = read_corpus(a.corpus)
    order = list(range(len(records)))
    random.Random(a.seed).shuffle(order)
    heldout = [records[i] for i in order[:a.heldout]]
    train = [records[i] for i in order[a.heldout:]]
    examples = T.examples_from_sequences(corpus_sequences(train, "greedy", end_id), rows, answers_only=True)
    log(f"{len(train)} training records ({sum(len(e['input_ids']) for e in examples)} tokens), "
        f"{len(heldout)} held out; exits {exits} of {a.layers} layers")

    held = T.examples_from_sequences(corpus_sequences(heldout, "greedy", end_id), rows, answers_only=True)
    left = None if a.max_minutes is None else a.max_minutes * 60 - (time.time() - start)
    summary, chosen = train_nested(draft.lm, examples, held, exits, work, target_to_draft=rows, epochs=a.epochs, lr=a.lr,
                                   tokens_per_batch=a.tokens_per_batch, seed=a.seed, tolerance=a.tolerance,
                                   max_seconds=left, log=log)
    if not summary["finished"]:
        raise SystemExit(f"sorted training stopped at step {summary['step']}/{summary['total']}: run again to resume")
    log(f"thresholds {chosen['thresholds']}: exits answer {[round(x, 3) for x in chosen['answered']]} of held-out "
        f"positions; agreement per exit {[round(x, 3) for x in chosen['agreement_per_exit']]}, "
        f"rule {chosen['agreement_rule']:.3f} vs deepest {chosen['agreement_deepest']:.3f}")

    info = {"method": "s2d", "target": init_info["target"],
            "training": {**summary, "loss": f"sum over exits {list(exits)} of next-token CE on greedy answers",
                         "init": f"{a.init} ({fastdraft.lm.config.num_hidden_layers} layers) grown to {a.layers} "
                                 "with identity layers", "corpus": a.corpus,
                         "corpus_seed": read_info(a.corpus).get("seed"), "heldout_records": a.heldout},
            "thresholds_heldout": chosen,
            "notes": "S2D: nested draft, every exit (first e layers + final norm + head) drafts; per drafted token "
                     "the first exit whose top-1 probability reaches its threshold answers (deepest always)",
            "command": f"python -m tools.drafters.build_s2d --corpus {a.corpus} --init {a.init} --work {a.work} "
                       f"--out {a.out} --layers {a.layers} --exits {a.exits} --epochs {a.epochs} --seed {a.seed}"}
    path = save_s2d(a.out, draft, info, exits, tuple(chosen["thresholds"]))
    log(f"exported → {path} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
