"""A Scylla-style scaling study (arXiv 2505.07858) of SmolLM2-135M-Instruct's FastDraft draft LMs.

Scylla reports that a draft model's acceptance rate grows log-linearly in its pretraining tokens
and its size: alpha = a + b*ln(N_params) + c*ln(D_tokens). This script checks that on our scale
and uses the fit to ask whether the FastDraft from noise (assets/text_drafters/smollm2/fastdraft_scratch: a
2-layer, 384-wide Llama over an 8192-token reduced vocabulary) has the right size.

  1. Hold out a fixed, seeded 5% of the corpus records (assets/corpus/smollm2); never trained on.
  2. Train draft LMs of several shapes on nested, seeded subsets of the other records' tokens:
     one epoch of next-token CE on every token (FastDraft's pretraining objective,
     flashmm.train.draft_lm.train_draft), the same lr schedule and batch size for every run,
     all over one shared reduced vocabulary (the FastDraft build's, /tmp/draft_work/vocab.pt).
  3. Acceptance alpha of each: top-1 agreement of the draft's argmax with the next token of the
     held-out greedy answers. Those answers are the target's own greedy tokens, so this is exactly
     the per-position acceptance of a greedy chain draft given a correct prefix.
  4. Step cost of each shape: one-token forward with a KV cache, 1 thread, median CPU time, as a
     fraction c of the target's step.
  5. Least-squares fit of alpha against ln N and ln D; the speedup model of chain drafting with
     iid acceptance, E[tokens/step] = (1 - alpha^(k+1)) / (1 - alpha), speedup = that / (1 + k*c),
     best k per shape, at the corpus we have and at larger ones.

    python -m eval.scylla_scaling --work /tmp/scylla_work --out eval/results/scylla_scaling \\
        [--grid "h128_l1,h256_l2,h384_l2:1/12,1/6,1/3;h512_l3:1/6"]

Resumable: every run trains under --work/runs/<name>/train (checkpointed, train_draft) and writes
--work/runs/<name>/result.json when evaluated; a re-run only trains what is missing, then fits and
plots. Never reads the Spec-Bench questions.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from eval.scylla_fit import SHIPPED, fit_loglinear

SIZES = {"h128_l1": (128, 1), "h256_l2": (256, 2), "h384_l2": (384, 2), "h512_l3": (512, 3)}
# (shape, fraction of the training split's tokens; nested subsets): 3 shapes x 3 corpus sizes, ~30 minutes
# on one loaded thread. The committed results add "h512_l3:1/6" (~11 more minutes) for a 4th size.
GRID = "h128_l1,h256_l2,h384_l2:1/12,1/6,1/3"
COST_ONLY = {"h768_l4": (768, 4)}  # timed (random weights) but not trained: what a larger draft would cost


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# ---------------------------------------------------------------- data

def split_records(records: list, held_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out) records: a fixed seeded sample of ``held_fraction`` is held out."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    held = set(order[:max(1, round(held_fraction * len(records)))])
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]


def trained_positions(sequences: list[tuple[list[int], int]]) -> int:
    """Next-token positions CE trains on in ``sequences`` (every token but each sequence's first)."""
    return sum(len(ids) - 1 for ids, _ in sequences)


def nested_subset(sequences: list, fraction: float, seed: int) -> list:
    """The shortest prefix of a seeded shuffle holding >= ``fraction`` of the positions (smaller
    fractions are prefixes of larger ones, so corpus sizes differ only by the added data)."""
    order = list(sequences)
    random.Random(seed).shuffle(order)
    goal, total, out = fraction * trained_positions(sequences), 0, []
    for ids, prompt_len in order:
        if total >= goal:
            break
        out.append((ids, prompt_len))
        total += len(ids) - 1
    return out


# ---------------------------------------------------------------- the study

def parse_grid(text: str) -> list[tuple[str, float]]:
    """"shapes:fractions;shapes:fractions" -> [(shape, fraction)], e.g. "h128_l1,h256_l2:1/12,1/6"."""
    out = []
    for block in filter(None, text.split(";")):
        shapes, fractions = block.split(":")
        for shape in shapes.split(","):
            if shape not in SIZES:
                raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SIZES)}")
            for f in fractions.split(","):
                num, _, den = f.partition("/")
                out.append((shape, float(num) / float(den or 1)))
    return out


def draft_shape(hidden: int, layers: int) -> dict:
    """Heads of 64 dims and a SwiGLU width of ~8/3 hidden (the shipped 384 -> 1024)."""
    return dict(hidden=hidden, layers=layers, heads=hidden // 64, intermediate=64 * round(8 * hidden / 3 / 64))


class Study:
    def __init__(self, args):
        from flashmm.train.corpus import read_corpus  # noqa: PLC0415

        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.start = time.time()
        self.records = read_corpus(args.corpus)
        self.train_records, self.held_records = split_records(self.records, args.held_out, args.seed)
        self.grid = parse_grid(args.grid)
        self._target = None

    @property
    def target(self):
        if self._target is None:
            from tools.corpus.build import load_target  # noqa: PLC0415

            log("loading the target (SmolLM2-135M-Instruct, fp32)")
            self._target = load_target("smollm2")
        return self._target

    def end_id(self) -> int:
        """The end-of-turn id appended to finished answers, as flashmm.train.draft_lm_stages does."""
        path = self.work / "end_ids.json"
        if not path.exists():
            from tools.corpus.build import stop_ids  # noqa: PLC0415

            path.write_text(json.dumps(sorted(stop_ids(*self.target))))
        return json.loads(path.read_text())[0]

    def sequences(self, records: list, which: str) -> list[tuple[list[int], int]]:
        from flashmm.train.corpus import corpus_sequences  # noqa: PLC0415

        return corpus_sequences(records, which, end_id=self.end_id())

    def vocab(self) -> torch.Tensor:
        """The shared reduced vocabulary: the FastDraft build's if present, else built the same way."""
        path = self.work / "vocab.pt"
        if not path.exists():
            source = Path(self.args.vocab_from)
            if source.exists():
                chosen = torch.load(source, weights_only=True)
                log(f"vocab: {len(chosen)} ids from {source}")
            else:
                from flashmm.train.draft_lm import choose_vocab  # noqa: PLC0415
                from tools.corpus.build import stop_ids  # noqa: PLC0415

                ends = tuple(sorted(stop_ids(*self.target)))
                chosen = choose_vocab(self.sequences(self.records, "all"), 8192, always=ends)
                log(f"vocab: built {len(chosen)} ids with choose_vocab (no {source})")
            torch.save(chosen, path)
        return torch.load(path, weights_only=True)

    def new_draft(self, hidden: int, layers: int):
        from flashmm.drafters.nets.reduced_vocab import ReducedVocabLM, build_lm  # noqa: PLC0415
        from flashmm.train.draft_lm import draft_lm_config  # noqa: PLC0415

        model = self.target[0]
        s = draft_shape(hidden, layers)
        vocab = self.vocab()
        config = draft_lm_config(model.config, len(vocab), s["hidden"], s["layers"], s["heads"], s["intermediate"])
        torch.manual_seed(self.args.seed)
        return ReducedVocabLM(build_lm(config), vocab, model.config.vocab_size)

    def seconds_left(self) -> float:
        return self.args.max_minutes * 60 - (time.time() - self.start)

    # ------------------------------------------------------------ one run
    def run(self, size: str, fraction: float) -> dict:
        from flashmm.drafters.nets import distill  # noqa: PLC0415
        from flashmm.train import draft_lm as T  # noqa: PLC0415

        name = f"{size}_f{fraction:.4f}"
        folder = self.work / "runs" / name
        result_path = folder / "result.json"
        if result_path.exists():
            return json.loads(result_path.read_text())
        hidden, layers = SIZES[size]
        subset = nested_subset(self.sequences(self.train_records, "all"), fraction, self.args.seed)
        draft = self.new_draft(hidden, layers)
        rows = distill.target_rows(self.vocab(), draft.target_vocab)
        examples = T.examples_from_sequences(subset, rows, answers_only=False)
        log(f"{name}: {len(subset)} sequences, {trained_positions(subset)} tokens, "
            f"{sum(p.numel() for p in draft.lm.parameters())} params")
        t0 = time.time()
        summary = T.train_draft(draft.lm, examples, objective="ce", target_to_draft=rows, work_dir=folder / "train",
                                epochs=1.0, lr=self.args.lr, tokens_per_batch=self.args.tokens_per_batch,
                                seed=self.args.seed, checkpoint_every=25, max_seconds=self.seconds_left(),
                                log=lambda m: log(f"{name}: {m}"))
        if not summary["finished"]:
            raise SystemExit(f"{name} stopped at step {summary['step']}/{summary['total']} (--max-minutes "
                             f"{self.args.max_minutes}): run the same command again to resume")
        train_seconds = time.time() - t0
        agree = agreements(draft, self.sequences(self.held_records, "greedy"))
        result = dict(name=name, size=size, **draft_shape(hidden, layers),
                      params=sum(p.numel() for p in draft.lm.parameters()), fraction=fraction,
                      sequences=len(subset), tokens=trained_positions(subset), steps=summary["steps"],
                      final_loss=summary["final_loss"], train_seconds=train_seconds, **acceptance(agree))
        result_path.write_text(json.dumps(result, indent=1) + "\n")
        log(f"{name}: alpha {result['alpha']:.4f} on {result['positions']} held-out positions "
            f"(trained {train_seconds:.0f} s)")
        return result

    # ------------------------------------------------------------ step costs
    def costs(self) -> dict:
        path = self.work / "costs.json"
        if path.exists():
            return json.loads(path.read_text())
        model, _ = self.target
        shapes = {**{s: SIZES[s] for s in dict.fromkeys([SHIPPED] + [s for s, _ in self.grid])}, **COST_ONLY}
        drafts = {s: self.new_draft(h, l) for s, (h, l) in shapes.items()}
        context = self.sequences(self.held_records, "greedy")[0][0][:self.args.cost_context]
        log(f"timing one-token steps at a {len(context)}-token context, {self.args.cost_repeats} rounds")
        seconds = step_seconds({"target": model, **drafts}, context, self.args.cost_repeats)
        out = {"context": len(context), "repeats": self.args.cost_repeats, "target_seconds": seconds["target"],
               "shapes": {s: dict(hidden=h, layers=l, params=sum(p.numel() for p in drafts[s].lm.parameters()),
                                  seconds=seconds[s], cost=seconds[s] / seconds["target"])
                          for s, (h, l) in shapes.items()}}
        path.write_text(json.dumps(out, indent=1) + "\n")
        return out

    def wall_minutes(self) -> float:
        """Minutes from the study's first cached file to its last (across resumed invocations)."""
        first = [self.work / "end_ids.json", self.work / "vocab.pt"]
        last = [*self.work.glob("runs/*/result.json"), self.work / "costs.json", self.work / "shipped.json"]
        stamps = lambda paths: [p.stat().st_mtime for p in paths if p.exists()]  # noqa: E731
        return (max(stamps(last)) - min(stamps(first))) / 60

    def shipped(self) -> dict:
        """The shipped FastDraft on the same held-out answers (it trained on them: a reference only)."""
        path = self.work / "shipped.json"
        if not path.exists():
            from flashmm.drafters import load  # noqa: PLC0415

            drafter = load(self.args.shipped)
            agree = agreements(drafter.model, self.sequences(self.held_records, "greedy"))
            info = drafter.info["training"]
            tokens = trained_positions(self.sequences(self.records, "all"))
            path.write_text(json.dumps(dict(tokens=tokens, params=sum(p.numel() for p in drafter.model.lm.parameters()),
                                            training=info, **acceptance(agree)), indent=1) + "\n")
        return json.loads(path.read_text())


@torch.no_grad()
def agreements(draft, sequences: list[tuple[list[int], int]]) -> list[list[bool]]:
    """Per sequence, whether the draft's argmax equals the next token at every answer position
    (teacher-forced on the target's greedy answer; the first answer token included)."""
    draft.eval()
    out = []
    for ids, prompt_len in sequences:
        ids_t = torch.as_tensor(ids)
        rows = draft.target_to_draft[ids_t][None]  # [1, L] draft rows (unknown ids read as row 0)
        logits = draft.lm(input_ids=rows).logits[0, prompt_len - 1:-1]  # [A, Vd]
        out.append((draft.draft_to_target[logits.argmax(-1)] == ids_t[prompt_len:]).tolist())
    return out


def acceptance(agree: list[list[bool]]) -> dict:
    """alpha (pooled over positions) and the exact greedy tau of k-token chains (eval.draft_acceptance's
    walk per answer, averaged with answer-length weights)."""
    from eval.draft_acceptance import greedy_tau  # noqa: PLC0415

    flat = [a for seq in agree for a in seq]
    taus = {k: sum(greedy_tau(seq, k) * len(seq) for seq in agree) / len(flat) for k in (1, 2, 4)}
    return dict(alpha=sum(flat) / len(flat), positions=len(flat), **{f"tau_k{k}": t for k, t in taus.items()})


@torch.no_grad()
def step_seconds(models: dict, context: list[int], repeats: int) -> dict:
    """Median CPU seconds of one cached one-token forward per model, rounds interleaved across models
    so load from other processes falls on all of them alike."""
    from transformers import DynamicCache  # noqa: PLC0415

    from eval.common import median, timed_with_cpu  # noqa: PLC0415
    from flashmm.targets.cache import cache_argument  # noqa: PLC0415

    ids = torch.tensor([context])
    caches = {}
    for name, model in models.items():
        model.eval()
        caches[name] = DynamicCache()
        model(input_ids=ids[:, :-1], **{cache_argument(model): caches[name]}, use_cache=True, logits_to_keep=1)
    last = ids[:, -1:]
    times = {name: [] for name in models}
    for round_ in range(repeats + 3):
        for name, model in models.items():
            argument = {cache_argument(model): caches[name]}
            _, _, cpu = timed_with_cpu(lambda: model(input_ids=last, use_cache=True, logits_to_keep=1, **argument))
            caches[name].crop(-1)  # drop the timed token again
            if round_ >= 3:  # warm-up rounds
                times[name].append(cpu)
    return {name: median(t) for name, t in times.items()}


def main(argv=None) -> None:
    from flashmm.paths import work_dir  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="assets/corpus/smollm2")
    ap.add_argument("--work", default=str(work_dir("scylla_work")))
    ap.add_argument("--out", default="eval/results/scylla_scaling")
    ap.add_argument("--vocab-from", default=str(work_dir("draft_work", "vocab.pt")),
                    help="the FastDraft build's reduced vocabulary (built with choose_vocab when missing)")
    ap.add_argument("--shipped", default="assets/text_drafters/smollm2/fastdraft_scratch")
    ap.add_argument("--grid", default=GRID, help='runs as "shapes:fractions;..." (default: %(default)s)')
    ap.add_argument("--held-out", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--tokens-per-batch", type=int, default=2048)
    ap.add_argument("--cost-context", type=int, default=256)
    ap.add_argument("--cost-repeats", type=int, default=40)
    ap.add_argument("--max-minutes", type=float, default=35.0, help="stop (checkpointed) after this long")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    study = Study(args)
    log(f"{len(study.train_records)} training records, {len(study.held_records)} held out (seed {args.seed})")
    runs = []
    for size, fraction in study.grid:
        runs.append(study.run(size, fraction))
    costs = study.costs()
    shipped = study.shipped()
    fit = fit_loglinear([r["params"] for r in runs], [r["tokens"] for r in runs], [r["alpha"] for r in runs])
    log(f"fit: alpha = {fit['a']:.4f} + {fit['b']:.5f} ln N + {fit['c']:.5f} ln D, R^2 {fit['r2']:.4f}")
    from eval.common import machine, write_results  # noqa: PLC0415
    from eval.scylla_report import conclusion, holdout_check, markdown, per_size_slopes, plot, predictions  # noqa: PLC0415

    payload = dict(
        machine=machine(), grid=args.grid, runs=runs, costs=costs, shipped=shipped, fit=fit,
        slopes=per_size_slopes(runs), holdout_check=holdout_check(runs), tokens_now=shipped["tokens"],
        train_tokens_available=trained_positions(study.sequences(study.train_records, "all")),
        wall_minutes=(time.time() - study.start) / 60, study_wall_minutes=study.wall_minutes(),
        setup=(f"Setup: {len(study.held_records)} of {len(study.records)} corpus records held out (seed {args.seed}); "
               f"runs train one epoch of next-token CE on every token (prompts and greedy + sampled answers) of a "
               f"nested seeded subset of the other records, lr {args.lr} cosine, {args.tokens_per_batch} tokens per "
               f"batch, one shared 8192-id reduced vocabulary; alpha is measured on the held-out greedy answers "
               f"(the target's own tokens, end-of-turn included)."),
    )
    payload["predictions"] = predictions(fit, costs, payload["tokens_now"])
    payload["conclusion"] = conclusion(payload)
    command = "python -m eval.scylla_scaling " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    write_results(args.out, payload, markdown(payload, command.strip()))
    plot(runs, fit, payload["tokens_now"], shipped, Path(args.out).with_suffix(".png"))
    log(f"done in {payload['wall_minutes']:.1f} min")


if __name__ == "__main__":
    main()
