"""SpecDec++ on an EAGLE-3 head (``python -m flashmm.train specdecpp --draft EAGLE3_DIR``): which corpus
sequences train the rank acceptance head and which are held out, and the stop threshold calibrated by
a replay of held-out answers with the drafter as deployed.

Sequences: with ``--draft-holdout-every N`` (``--draft-holdout-offset K``) the head reads only the
corpus sequences the EAGLE-3 draft held out of its own training, sequence i when i % N == K
(flashmm.train.cli_common.holdout_split's rule: give the draft command's --holdout-every /
--holdout-offset). On its own training text the draft is more often right than on new text, and a
predictor fitted there is overconfident. The first ``--heldout-sequences`` of them are held out of the
rank head's training (its held-out metrics; the first ``--calibrate-sequences`` of those calibrate
--thresholds); the head trains on the rest. Without --draft-holdout-every the head trains on every
sequence and nothing is held out (its metrics are then on its training answers).

Calibration: exact greedy replay (flashmm.train.eagle3.replay_examples) of the first
``--calibrate-tokens`` answer tokens of each calibration sequence, each step given a budget of
``--calibrate-budget`` nodes, with the drafter as deployed (EAGLE-2 tree, adaptive pricing against the
target's measured verify cost, flashmm.targets.verify_cost, linear="onednn"): no acceptance head
("heuristic"), then each --thresholds value. The drafter's own time per step is measured (wall
time), so each row gets a modeled speedup = tokens / (sum over steps of t(nodes) / t(1) + drafting
seconds / t(1)), and the best threshold is written. The verify cost is measured once per machine and
cached (a later run on the same machine reads it), and the tree sizes follow it; the drafting
seconds are measured on every run: candidates whose speedups are within timing noise may rank
differently on another machine or load.
"""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

TREE_OPTIONS = {"draft_holdout_every": None, "draft_holdout_offset": None, "calibrate_tokens": 128,
                "calibrate_budget": 60}  # EAGLE-3 only: their defaults
LABELS = ("rank of the target's greedy token among the EAGLE-3 head's choices, the head unrolled on its own "
          "outputs along greedy corpus answers")


def split_sequences(count: int, every: int | None, offset: int | None, heldout_sequences: int
                    ) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices) of ``count`` corpus sequences, as the module docstring says;
    errors name the option."""
    from .cli_common import holdout_split  # noqa: PLC0415

    if every is None:
        if offset is not None:
            raise SystemExit("--draft-holdout-offset needs --draft-holdout-every N > 0")
        return list(range(count)), []
    if every < 1:
        raise SystemExit(f"--draft-holdout-every must be >= 1, got {every}")
    _, pool = holdout_split(count, SimpleNamespace(draft_holdout_every=every, draft_holdout_offset=offset),
                            option="--draft-holdout")
    if not 1 <= heldout_sequences < len(pool):
        raise SystemExit(f"--heldout-sequences {heldout_sequences}: must be in 1..{len(pool) - 1} (the draft held "
                         f"out {len(pool)} of the {count} corpus sequences; the rank head trains on those after the "
                         "held-out ones)")
    return pool[heldout_sequences:], pool[:heldout_sequences]


def rank_head(args, s, draft_dir, log=print):
    """(head, summary, threshold, record): a RankAcceptanceHead on the EAGLE-3 head in ``draft_dir``: per
    tree depth, the rank of the target's token among the head's children (the head unrolled on its own
    outputs along the training sequences' answers), measured on the held-out ones and, with
    --thresholds, its threshold calibrated by replay."""
    import torch  # noqa: PLC0415

    from ..drafters import load  # noqa: PLC0415
    from ..drafters.specdecpp import RankAcceptanceHead  # noqa: PLC0415
    from . import eagle3 as E  # noqa: PLC0415
    from .acceptance import rank_examples, rank_loss, rank_metrics, train_head  # noqa: PLC0415

    if args.calibrate_sequences < 1:
        raise SystemExit(f"--calibrate-sequences must be >= 1, got {args.calibrate_sequences}")
    if args.thresholds and args.draft_holdout_every is None:
        raise SystemExit("--thresholds: calibration replays held-out answers: give --draft-holdout-every")
    # the head's initial weights (and its dropout) draw from torch's generator seeded with --seed before the
    # target loaded (text_setup), after the target and this draft are built: the order the shipped head drew in
    head_drafter = load(draft_dir, adaptive=False)
    if args.ranks < head_drafter.top_k:
        raise SystemExit(f"--ranks {args.ranks}: the EAGLE-3 head in {draft_dir} drafts top_k={head_drafter.top_k} "
                         "children per node, and the rank head must tell each apart: give --ranks >= that")
    net = head_drafter.net.float()
    layers = tuple(net.cfg.feature_layers)
    cached = s.features(layers=layers, top_k=args.top_k)
    train_ids, held_ids = split_sequences(len(cached), args.draft_holdout_every, args.draft_holdout_offset,
                                          args.heldout_sequences)
    if args.thresholds and args.calibrate_sequences > len(held_ids):
        raise SystemExit(f"--calibrate-sequences {args.calibrate_sequences}: more than the {len(held_ids)} held-out "
                         "sequences (--heldout-sequences)")
    columns = list(range(len(layers)))
    held = [E.example_from(cached[i], columns) for i in held_ids]
    examples = held + [E.example_from(cached[i], columns) for i in train_ids]  # "sequence" < len(held): held out
    embed = E.frozen_embedding(s.model)
    path = s.work / "rank_examples.pt"
    state = torch.get_rng_state()

    def compute():
        return rank_examples(net, embed, examples, args.depth, args.ranks, log=log)

    def read():
        if not path.exists():
            torch.save(compute(), path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
        return torch.load(path, weights_only=True)

    data = s.parallel.main_first(read)
    torch.set_rng_state(state)   # a cached read draws as computing did: rank_examples builds one summary module
    RankAcceptanceHead(net.cfg.hidden_size, args.ranks)
    heldout = data["sequence"] < len(held)
    sets = {name: {k: v[rows] for k, v in data.items()} for name, rows in (("train", ~heldout), ("heldout", heldout))}
    log(f"rank examples: {len(sets['train']['label'])} from {len(train_ids)} training sequences, "
        f"{len(sets['heldout']['label'])} from {len(held_ids)} held out")
    head = RankAcceptanceHead(net.cfg.hidden_size, args.ranks, max(args.depth, 8), args.width or 64)
    summary = train_head(head, sets["train"], work_dir=s.work, epochs=args.head_epochs, lr=args.head_lr,
                         seed=args.seed, loss=rank_loss, log=log, parallel=s.parallel)
    summary["train_sequences"] = len(train_ids)
    if not s.parallel.is_main:
        return head, summary, args.threshold, {}
    if not held:
        return head, summary, args.threshold, {"labels": LABELS, "metrics_on_training_answers":
                                                rank_metrics(head, sets["train"])}
    record = {"labels": f"{LABELS} it never trained on (its held-out split after the first {len(held)})",
              "heldout_sequences": len(held), "heldout_metrics": rank_metrics(head, sets["heldout"])}
    log(f"held-out metrics by depth: {json.dumps(record['heldout_metrics'])}")
    if not args.thresholds:
        return head, summary, args.threshold, record
    replay_set = held[:args.calibrate_sequences]
    best, rows = calibrate(s.model, draft_dir, head, embed, replay_set, args.thresholds, args.calibrate_budget,
                           args.calibrate_tokens, log=log)
    return head, summary, best, {**record, "threshold_replay": rows,
                                 "replay": f"{len(replay_set)} evaluation answers x {args.calibrate_tokens} tokens, "
                                           f"budget {args.calibrate_budget}, adaptive pricing on (measured verify "
                                           "cost)"}


class Timed:
    """A drafter wrapper for replay: records each step's drafted nodes and the seconds propose took."""

    def __init__(self, drafter):
        self.drafter, self.nodes, self.seconds = drafter, [], 0.0

    def begin(self, start):
        self.drafter.begin(start)

    def observe(self, step):
        self.drafter.observe(step)

    def propose(self, committed, max_tokens, sampling, generator):
        start = time.perf_counter()
        draft = self.drafter.propose(committed, max_tokens, sampling, generator)
        self.seconds += time.perf_counter() - start
        self.nodes.append(draft.tokens.shape[1])
        return draft


def replay(drafter, embed, examples, budget: int, tokens: int, verify_cost, target_weights: int) -> dict:
    """τ, nodes per step, drafting ms per step and the modeled speedup of ``drafter`` on ``examples``,
    priced as bind would price it (the target's verify cost and weight count) without a target."""
    from . import eagle3 as E  # noqa: PLC0415

    drafter._embed = embed
    drafter.length.verify_cost, drafter._target_weights = verify_cost, target_weights
    timed = Timed(drafter)
    emitted, steps = E.replay_examples(timed, examples, budget, tokens)
    t1 = verify_cost.seconds[0]
    verify = sum(verify_cost.relative(n) for n in timed.nodes)
    return {"tau": round(emitted / steps, 3), "steps": steps, "nodes_per_step": round(sum(timed.nodes) / steps, 2),
            "draft_ms_per_step": round(1e3 * timed.seconds / steps, 2),
            "modeled_speedup": round(emitted / (verify + timed.seconds / t1), 3)}


def calibrate(target, draft_dir, head, embed, examples, thresholds: list[float], budget: int, tokens: int,
              log=print) -> tuple[float, dict]:
    """(best threshold, replay row per candidate: "heuristic" (no acceptance head) and str(threshold)):
    replay() of ``examples`` with the EAGLE-3 folder's drafter as deployed, the best modeled speedup
    kept (the first of equals)."""
    from ..drafters import load  # noqa: PLC0415
    from ..targets.verify_cost import measure_verify_cost  # noqa: PLC0415

    verify_cost = measure_verify_cost(target, linear="onednn")
    weights = sum(p.numel() for p in target.parameters())
    rows = {}
    for h in [None] + list(thresholds):
        key = "heuristic" if h is None else str(h)
        drafter = load(draft_dir, **({} if h is None else {"acceptance": head, "threshold": h}))
        rows[key] = replay(drafter, embed, examples, budget, tokens, verify_cost, weights)
        log(f"specdecpp {key}: {json.dumps(rows[key])}")
    best = max(thresholds, key=lambda h: rows[str(h)]["modeled_speedup"])
    return best, rows
