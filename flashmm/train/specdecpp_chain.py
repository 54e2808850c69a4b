"""SpecDec++ on a FastDraft draft (``python -m flashmm.train specdecpp --draft FASTDRAFT_DIR``): which
corpus records train the acceptance head and which are held out, and the stop threshold calibrated
by greedy replay of held-out answers (flashmm.train.specdecpp_replay).

Records: with ``heldout_first`` K, records [K, K + heldout_sequences) are held out (head metrics,
calibration) and the head trains on records before K, all of them or a seeded sample of
``train_sequences`` (kept in corpus order); without it the head trains on every record (or that
sample) and nothing is held out.

Calibration: each candidate threshold's drafter replays the greedy answers of the first
``calibrate_sequences`` held-out records exactly (the target's answers are known, so no target
forward); a modeled speedup prices each verification step at the target's verify cost for its
nodes and each draft forward at its share of a target step, both measured in thread CPU time on
this machine (specdecpp_replay.cpu_cost_model). The counts are deterministic; the costs are
measured, so candidates whose speedups are within timing noise may rank differently on another
machine or load.
"""
from __future__ import annotations

import random


def split_records(records: list, seed: int, train_sequences: int | None, heldout_first: int | None,
                  heldout_sequences: int) -> tuple[list, list]:
    """(training records, held-out records) as the module docstring says; errors name the option."""
    pool, heldout = records, []
    if heldout_first is not None:
        if not 1 <= heldout_first < len(records):
            raise ValueError(f"--heldout-first {heldout_first}: must be in 1..{len(records) - 1} "
                             f"(the corpus has {len(records)} records)")
        if heldout_sequences < 1:
            raise ValueError(f"--heldout-sequences must be >= 1, got {heldout_sequences}")
        pool, heldout = records[:heldout_first], records[heldout_first:heldout_first + heldout_sequences]
    if train_sequences is None:
        return list(pool), heldout
    if not 1 <= train_sequences <= len(pool):
        raise ValueError(f"--train-sequences {train_sequences}: must be in 1..{len(pool)} (the records before "
                         "--heldout-first, or the corpus)")
    chosen = sorted(random.Random(seed).sample(range(len(pool)), train_sequences))
    return [pool[i] for i in chosen], heldout


def calibrate(target, draft_lm, head, records: list, thresholds: list[float], max_draft_tokens: int,
              log=print) -> tuple[float, dict, dict]:
    """(best threshold, replay summary per threshold (keys: str(threshold)), cost model record):
    greedy replay of ``records``' answers with SpecDecPP(draft_lm, head, threshold) per candidate,
    the best modeled speedup kept (the first of equals)."""
    import json  # noqa: PLC0415

    from ..drafters.specdecpp import SpecDecPP  # noqa: PLC0415
    from .specdecpp_replay import cpu_cost_model, greedy_replay, summarize  # noqa: PLC0415

    verify_cost, draft_cost = cpu_cost_model(target, draft_lm)
    replay = {}
    for h in thresholds:
        drafter = SpecDecPP(draft_lm, head, threshold=h, max_draft_tokens=max_draft_tokens)
        counts = [greedy_replay(drafter, r.prompt_ids, r.greedy.ids) for r in records]
        replay[h] = summarize(counts, verify_cost, draft_cost)
        log(f"specdecpp threshold {h}: {json.dumps(replay[h])}")
    best = max(replay, key=lambda h: replay[h]["modeled_speedup"])
    cost = {"draft_forward_in_target_steps": draft_cost,
            "verify_relative": {n: verify_cost.relative(n) for n in (2, 4, 9)}}
    return best, {str(h): r for h, r in replay.items()}, cost
