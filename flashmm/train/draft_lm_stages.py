"""The draft-LM recipes as resumable stages over a self-distillation corpus: FastDraft, DistillSpec,
AdaSPEC and PARD (flashmm.train.draft_lm, flashmm.train.pard).

  vocab        the reduced draft vocabulary (most frequent corpus tokens + the end-of-turn ids)
  pretrain     next-token CE on every corpus token (prompts and answers, greedy and sampled)
  align        CE on the target's greedy answers only                          → "fastdraft"
  features     the target's top-k next-token distributions over the greedy answers (cached)
  kd           forward-KL distillation on those distributions (AdaSPEC's reference draft)
  distillspec  on-policy continuations written by the aligned draft, scored by the target, mixed
               with the corpus answers; ``divergence``                         → "distillspec"
  adaspec      forward KL on the tokens whose loss gap to the kd reference is in the top
               ``select`` fraction                                              → "adaspec"
  pard         the aligned draft plus a mask token, trained to predict ``pard_depth`` tokens per
               forward on the greedy answers                                    → "pard"

Every stage checkpoints under ``work/<stage>`` and a finished one is read back, so a killed run
resumes. ``options`` is any object with the attributes ``python -m flashmm.train fastdraft``
(distillspec, adaspec, pard, s2d, specdecpp) parses (vocab, hidden, layers, heads, intermediate,
init_layers, *_epochs, lr, tokens_per_batch, top_k, distill_sequences, on_policy_*, divergence,
select, pard_depth, pard_keep, seed, max_minutes); ``export(method, draft, summary, notes,
drafter="fastdraft", extra=None, **more)`` writes a finished drafter.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Callable

import torch

from ..drafters.fastdraft import ReducedVocabLM, build_lm
from ..drafters.nets import distill
from ..drafters.pard import PardLM
from . import draft_lm as T
from . import pard as PARD
from .corpus import corpus_sequences, features
from .data_parallel import ONE_PROCESS, DataParallel
from .self_corpus import stop_ids


class DraftLMStages:
    def __init__(self, records, options, work, target: Callable, export: Callable, target_name: str | None = None,
                 log=print, parallel: DataParallel = ONE_PROCESS):
        """records: the corpus (read_corpus's CorpusRecords); target: returns (model, tokenizer), called
        once, when a stage first needs the target. parallel: the processes and accumulation the stages
        train with (flashmm.train.data_parallel); process 0 writes what the stages cache."""
        self.records, self.options, self.work, self.parallel = records, options, Path(work), parallel
        self.work.mkdir(parents=True, exist_ok=True)
        self.export, self.target_name, self.log = export, target_name, log
        self._load_target, self._target = target, None
        self.start = time.time()

    @property
    def target(self):
        if self._target is None:
            self._target = self._load_target()
        return self._target

    def seconds_left(self) -> float | None:
        if self.options.max_minutes is None:
            return None
        return self.options.max_minutes * 60 - (time.time() - self.start)

    def end_ids(self) -> list[int]:
        model, tokenizer = self.target
        return sorted(stop_ids(model, tokenizer))

    def end_id(self) -> int | None:
        ids = self.end_ids()
        return ids[0] if ids else None

    # ------------------------------------------------------------ pieces
    def vocab(self) -> torch.Tensor:
        return self.parallel.main_first(self._vocab)

    def _vocab(self) -> torch.Tensor:
        path = self.work / "vocab.pt"
        if not path.exists():
            sequences = corpus_sequences(self.records, "all", end_id=self.end_id())
            chosen = T.choose_vocab(sequences, self.options.vocab, always=tuple(self.end_ids()))
            torch.save(chosen, path)
            self.log(f"vocab: {len(chosen)} ids cover {T.vocab_coverage(sequences, chosen):.4f} of answer tokens")
        return torch.load(path, weights_only=True)

    def init_layers(self) -> list[int]:
        return [int(i) for i in self.options.init_layers.split(",") if i.strip()]

    def new_draft(self, initialise: bool = True) -> ReducedVocabLM:
        o = self.options
        model, _ = self.target
        vocab = self.vocab()  # fewer than --vocab ids when the corpus has fewer distinct tokens
        layers = self.init_layers()
        if layers:
            config = T.pruned_target_config(model.config, len(vocab), len(layers))
        else:
            config = T.draft_lm_config(model.config, len(vocab), o.hidden, o.layers, o.heads, o.intermediate)
        torch.manual_seed(o.seed)
        lm = build_lm(config)
        if layers and initialise:
            T.init_from_target(lm, model, vocab, layers)
        return ReducedVocabLM(lm, vocab, model.config.get_text_config().vocab_size)

    def draft_after(self, stage: str) -> ReducedVocabLM:
        draft = self.new_draft(initialise=False)
        draft.lm.load_state_dict(torch.load(self.work / stage / "final.pt", weights_only=True))
        return draft

    def rows(self) -> torch.Tensor:
        return distill.target_rows(self.vocab(), self.target[0].config.get_text_config().vocab_size)

    def train(self, stage: str, draft: ReducedVocabLM, examples, objective: str, epochs: float, **extra) -> dict:
        o = self.options
        summary = T.train_draft(draft.lm, examples, objective=objective, target_to_draft=self.rows(),
                                work_dir=self.work / stage, epochs=epochs, lr=o.lr, tokens_per_batch=o.tokens_per_batch,
                                seed=o.seed, max_seconds=self.seconds_left(), log=lambda m: self.log(f"{stage}: {m}"),
                                parallel=self.parallel, **extra)
        if not summary["finished"]:
            raise TimeoutError(f"{stage} stopped at step {summary['step']}/{summary['total']}: run again to resume")
        return summary

    def features(self, sequences):
        model, _ = self.target
        return features(model, sequences, layers=(), top_k=self.options.top_k, cache_dir=self.work / "features",
                        target_name=self.target_name, batch_size=8, log=self.log, parallel=self.parallel)

    def greedy_examples(self, answers_only: bool = True) -> list[dict]:
        return T.examples_from_sequences(corpus_sequences(self.records, "greedy", self.end_id()), self.rows(),
                                         answers_only=answers_only)

    # ------------------------------------------------------------ stages
    def stage_pretrain(self):
        examples = T.examples_from_sequences(corpus_sequences(self.records, "all", self.end_id()),
                                             self.rows(), answers_only=False)
        self.train("pretrain", self.new_draft(), examples, "ce", self.options.pretrain_epochs)

    def stage_align(self):
        draft = self.draft_after("pretrain")
        summary = self.train("align", draft, self.greedy_examples(), "ce", self.options.align_epochs)
        start = (f"the target's own embedding rows (the draft vocabulary, tied head), decoder layers "
                 f"{' and '.join(map(str, self.init_layers()))} and final norm, " if self.init_layers() else "")
        self.export("fastdraft", draft, summary, f"FastDraft: {start}pretrained on every corpus token, aligned on the "
                    "target's greedy answers (cross-entropy)")

    def greedy_features(self):
        sequences = corpus_sequences(self.records, "greedy", self.end_id())
        random.Random(self.options.seed).shuffle(sequences)
        return self.features(sequences[:self.options.distill_sequences])

    def stage_features(self):
        self.greedy_features()

    def stage_kd(self):
        examples = T.examples_from_features(self.greedy_features(), self.rows())
        self.train("kd", self.draft_after("align"), examples, "fkl", self.options.distill_epochs)

    def stage_distillspec(self):
        o = self.options
        draft = self.draft_after("align")
        prompts = [r.prompt_ids for r in self.records]
        random.Random(o.seed).shuffle(prompts)
        cached = self.work / "on_policy.json"

        def write_on_policy():
            if not cached.exists():
                self.log(f"distillspec: {o.on_policy_prompts} on-policy continuations from the aligned draft")
                data = T.on_policy_sequences(draft, prompts[:o.on_policy_prompts], o.on_policy_tokens, 1.0, o.seed,
                                             set(self.end_ids()))
                cached.write_text(json.dumps(data))
        self.parallel.main_first(write_on_policy)
        on_policy = [tuple(x) for x in json.loads(cached.read_text())]
        examples = T.examples_from_features(self.features(on_policy), self.rows())
        greedy = T.examples_from_features(self.greedy_features(), self.rows())
        mixed = examples + random.Random(o.seed + 1).sample(greedy, min(len(greedy), len(examples)))
        fixed_steps = len(T.batches(greedy, o.tokens_per_batch, random.Random(0)))
        mixed_steps = len(T.batches(mixed, o.tokens_per_batch, random.Random(0)))
        epochs = o.distill_epochs * fixed_steps / max(1, mixed_steps)  # the same step budget as kd / adaspec
        summary = self.train("distillspec", draft, mixed, o.divergence, epochs)
        self.export("distillspec", draft, summary, f"DistillSpec: {o.divergence.upper()} on the target's "
                    f"distributions over {len(examples)} on-policy draft continuations mixed 1:1 with corpus answers")

    def stage_adaspec(self):
        o = self.options
        examples = T.examples_from_features(self.greedy_features(), self.rows())
        reference = self.draft_after("kd").lm
        draft = self.draft_after("align")
        summary = self.train("adaspec", draft, examples, "fkl", o.distill_epochs, reference=reference,
                             select_fraction=o.select)
        self.export("adaspec", draft, summary, f"AdaSPEC: forward KL on the {o.select:.0%} of answer tokens with the "
                    "largest loss gap to the kd reference draft")

    def stage_pard(self, held_out_count: int = 64):
        o = self.options
        draft = self.draft_after("align")
        model = PardLM(draft.lm)
        examples = self.greedy_examples()
        held = min(held_out_count, len(examples) // 2)
        examples, held_out = examples[:len(examples) - held], examples[len(examples) - held:]
        # one stream of drops over the steps; with several units a step, the global stream each unit's seed restarts
        rng = random.Random(o.seed) if self.parallel.per_step == 1 else random
        summary = T.train_draft(model, examples, objective="pard", target_to_draft=self.rows(),
                                work_dir=self.work / "pard", epochs=o.pard_epochs, lr=o.lr,
                                tokens_per_batch=o.tokens_per_batch, seed=o.seed, max_seconds=self.seconds_left(),
                                log=lambda m: self.log(f"pard: {m}"), checkpoint_every=10,
                                group_loss=lambda m, g: PARD.group_loss(m, g, o.pard_depth, o.pard_keep, rng),
                                parallel=self.parallel)
        if not summary["finished"]:
            raise TimeoutError(f"pard stopped at step {summary['step']}/{summary['total']}: run again to resume")
        per_depth = PARD.depth_agreement(model, held_out, o.pard_depth) if held_out else []
        self.log(f"pard: top-1 agreement by depth on {len(held_out)} held-out answers: {per_depth}")
        self.export("pard", draft, {**summary, f"agreement_by_depth_held_out_{len(held_out)}": per_depth},
                    f"PARD: the aligned draft plus a mask token, {o.pard_depth} tokens per forward, conditional "
                    f"drop keep {o.pard_keep}, trained on the greedy answers", drafter="pard",
                    extra={"mask_embedding": model.mask_embedding}, pard={"depth": o.pard_depth, "keep": o.pard_keep})
