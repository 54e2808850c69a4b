"""Greedy replay of a chain drafter against known greedy answers, and the CPU cost model that prices it:
what ``python -m flashmm.train specdecpp --thresholds`` calibrates its stop threshold with
(flashmm.train.specdecpp_chain) and what eval/specdecpp_policy.py compares draft-length policies with.

Greedy replay: the target's greedy answer to each prompt is known, so a greedy speculative run is simulated
without the target: the real drafter proposes a chain after the committed text, the accepted tokens are the
chain's longest prefix agreeing with the answer, the target's own token follows, and the drafter observes
that outcome, exactly what the engine's greedy verification would do.
"""
from __future__ import annotations

import torch

from ..config import SamplingParams
from ..drafters.base import SequenceStart, StepResult
from ..tree.cost import VerifyCost

GREEDY = SamplingParams()


@torch.no_grad()
def greedy_replay(drafter, prompt: list[int], answer: list[int], max_tokens: int = 64) -> dict:
    """Replay greedy speculative decoding of ``answer`` (the target's greedy text after ``prompt``)
    with a chain drafter. Returns counts: tokens, steps, drafted, accepted, draft_forwards, nodes
    (list: nodes verified per step, root included)."""
    forwards = [0]
    handle = drafter.model.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    try:
        drafter.begin(SequenceStart(input_ids=torch.tensor([prompt])))
        committed = list(prompt) + answer[:1]  # the prefill emits the first token
        done = 1
        counts = {"tokens": len(answer), "steps": 0, "drafted": 0, "accepted": 0, "nodes": []}
        while done < len(answer):
            draft = drafter.propose(torch.tensor([committed]), max_tokens, GREEDY, None)
            if draft.tree.max_depth != draft.num_draft_tokens:
                raise ValueError("greedy_replay replays chains only (tree_width=1)")
            chain = draft.tokens[0, 1:].tolist()
            accepted = 0
            while accepted < len(chain) and done + accepted < len(answer) and chain[accepted] == answer[done + accepted]:
                accepted += 1
            emitted = answer[done : done + accepted + 1]
            done += len(emitted)
            committed += emitted
            counts["steps"] += 1
            counts["drafted"] += len(chain)
            counts["accepted"] += accepted
            counts["nodes"].append(len(chain) + 1)
            if done < len(answer):
                drafter.observe(StepResult(committed=torch.tensor([committed]), accepted_len=accepted,
                                           path=torch.arange(accepted + 1)[None]))
        counts["draft_forwards"] = forwards[0]
        return counts
    finally:
        handle.remove()


@torch.no_grad()
def cpu_seconds(model, nodes: int, prefix_len: int = 128, repeats: int = 5, linear: str = "torch") -> float:
    """Median thread CPU seconds of ``model``'s cached forward of ``nodes`` new tokens after a
    ``prefix_len``-token prefix, at 1 torch thread: CPU time, not wall time, so that other processes
    on a loaded machine do not inflate it (they still share caches and memory bandwidth). ``linear``:
    "onednn" multiplies through oneDNN, as flashmm runs the target and its draft LM on such a CPU."""
    import time  # noqa: PLC0415
    from contextlib import nullcontext  # noqa: PLC0415

    from ..targets import cache as kv  # noqa: PLC0415
    from ..targets.onednn import OneDNNLinears  # noqa: PLC0415

    cache = kv.new_cache(model)
    kv.next_logits(model, cache, torch.randint(3, 1000, (1, prefix_len)))
    feed = torch.randint(3, 1000, (1, nodes))
    times = []
    for attempt in range(repeats + 1):  # the first run warms up
        kv.crop(cache, prefix_len)
        start = time.thread_time()
        with OneDNNLinears(model) if linear == "onednn" else nullcontext():
            kv.next_logits(model, cache, feed)
        if attempt:
            times.append(time.thread_time() - start)
    return sorted(times)[len(times) // 2]


def cpu_cost_model(target, draft_lm, grid=(1, 2, 3, 4, 6, 9, 13, 17)) -> tuple[VerifyCost, float]:
    """(the target's verify cost over ``grid`` nodes, a draft forward in target one-token steps), from
    thread CPU time at 1 thread (see cpu_seconds), both multiplying as flashmm's ``linear="auto"`` has them."""
    from ..targets.onednn import resolve_linear_backend  # noqa: PLC0415

    torch.set_num_threads(1)
    linear = resolve_linear_backend("auto", target)
    cost = VerifyCost(tuple(grid), tuple(cpu_seconds(target, n, linear=linear) for n in grid))
    return cost, cpu_seconds(draft_lm, 1, linear=linear) / cost.seconds[0]


def summarize(counts: list[dict], verify_cost, draft_cost: float) -> dict:
    """τ, drafted / draft forwards per token, acceptance of drafted tokens, modeled speedup."""
    tokens = sum(c["tokens"] - 1 for c in counts)  # tokens emitted by verification steps
    steps = sum(c["steps"] for c in counts)
    drafted = sum(c["drafted"] for c in counts)
    forwards = sum(c["draft_forwards"] for c in counts)
    verify_units = sum(verify_cost.relative(n) for c in counts for n in c["nodes"])
    return {"tau": tokens / steps, "drafted_per_token": drafted / tokens, "draft_forwards_per_token": forwards / tokens,
            "accepted_per_drafted": sum(c["accepted"] for c in counts) / max(drafted, 1),
            "modeled_speedup": tokens / (verify_units + draft_cost * forwards), "steps": steps, "tokens": tokens}
