"""The speculative loop: draft → verify → accept → commit. Knows no model or method names."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from .config import SamplingParams, SpecConfig
from .drafters.base import Drafter, SequenceStart, StepResult
from .sampling import probs_from_logits, sample
from .targets.base import Target
from .verify import select_verifier


@dataclass
class GenerationStats:
    """Counters of one ``generate`` call (summed over rows when B > 1).

    tau: mean tokens emitted per verification forward (accepted drafted tokens + the bonus or
      recovered token); a plain decoder has tau == 1. The prefill forward, which emits the first
      token, is counted in ``target_forwards`` but not in ``tau``.
    accepted_hist: Counter {accepted drafted tokens per step: number of steps}.
    position_acceptance: list; entry k-1 = P(k-th drafted position accepted | it was drafted).
    """

    new_tokens: int = 0
    target_forwards: int = 0
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_hist: Counter = field(default_factory=Counter)
    drafted_at_depth: Counter = field(default_factory=Counter)
    accepted_at_depth: Counter = field(default_factory=Counter)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def tau(self) -> float:
        emitted = self.accepted_tokens + self.verify_steps
        return emitted / self.verify_steps if self.verify_steps else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        depth = max(self.drafted_at_depth, default=0)
        return [self.accepted_at_depth[k] / self.drafted_at_depth[k] if self.drafted_at_depth[k] else 0.0
                for k in range(1, depth + 1)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0

    def merge(self, other: "GenerationStats") -> None:
        for name in ("new_tokens", "target_forwards", "verify_steps", "drafted_tokens",
                     "accepted_tokens", "draft_seconds", "verify_seconds", "total_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_hist.update(other.accepted_hist)
        self.drafted_at_depth.update(other.drafted_at_depth)
        self.accepted_at_depth.update(other.accepted_at_depth)

    def as_dict(self) -> dict:
        return dict(new_tokens=self.new_tokens, target_forwards=self.target_forwards,
                    verify_steps=self.verify_steps, tau=self.tau, drafted_tokens=self.drafted_tokens,
                    accepted_tokens=self.accepted_tokens, accepted_hist=dict(sorted(self.accepted_hist.items())),
                    position_acceptance=self.position_acceptance, draft_seconds=self.draft_seconds,
                    verify_seconds=self.verify_seconds, total_seconds=self.total_seconds,
                    tokens_per_second=self.tokens_per_second)


def _pick(logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
    """logits [B, V] → LongTensor [B] (argmax, or a sample from the warped distribution)."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, sampling), generator)


@torch.no_grad()
def generate_one(target: Target, drafter: Drafter, input_ids: torch.Tensor, *, max_new_tokens: int,
                 sampling: SamplingParams, spec: SpecConfig, eos_token_ids: set[int],
                 generator: torch.Generator | None, model_inputs: dict,
                 attention_mask: torch.Tensor | None = None) -> tuple[list[int], GenerationStats]:
    """Generate for one sequence input_ids [1, T]; returns (new token ids, stats)."""
    stats = GenerationStats()
    start = time.perf_counter()
    verifier = select_verifier(spec.verifier, sampling.do_sample, backend=getattr(target, "backend", "torch"))
    want_hidden = drafter.needs_hidden_states
    new: list[int] = []
    if max_new_tokens == 0:
        return new, stats

    out = target.prefill(input_ids, attention_mask, want_hidden, **model_inputs)
    stats.target_forwards += 1
    first = int(_pick(out.logits[:, -1], sampling, generator)[0])
    new.append(first)
    committed = torch.cat([input_ids, input_ids.new_tensor([[first]])], dim=1)
    finished = first in eos_token_ids or len(new) >= max_new_tokens
    if not finished:
        embeds, spans = (None, [])
        if want_hidden:
            embeds, spans = target.prompt_features(input_ids, **model_inputs)
        drafter.begin(SequenceStart(input_ids=input_ids, hidden_states=out.hidden_states,
                                    input_embeds=embeds, visual_spans=spans, model_inputs=model_inputs))

    while not finished:
        t0 = time.perf_counter()
        # The budget is not cut near max_new_tokens: emission is truncated below instead, so
        # tree-shaped drafts keep their width on the last step.
        draft = drafter.propose(committed, spec.max_draft_tokens, sampling, generator)
        t1 = time.perf_counter()
        tree = draft.tree
        scored = target.forward_tree(draft.tokens, tree, want_hidden)
        result = verifier(draft.tokens, tree, scored.logits, draft.q_probs, sampling, generator, spec)
        accepted = int(result.accepted_len[0])
        path = result.path[:, : accepted + 1]
        target.commit(path)
        stats.verify_seconds += time.perf_counter() - t1
        stats.draft_seconds += t1 - t0

        emitted = result.emitted(draft.tokens, 0)
        stats.target_forwards += 1
        stats.verify_steps += 1
        stats.drafted_tokens += tree.num_nodes - 1
        stats.accepted_tokens += accepted
        stats.accepted_hist[accepted] += 1
        for d in range(1, tree.max_depth + 1):
            stats.drafted_at_depth[d] += 1
            stats.accepted_at_depth[d] += int(accepted >= d)

        for token in emitted:  # stop exactly where plain decoding would
            new.append(token)
            if token in eos_token_ids or len(new) >= max_new_tokens:
                finished = True
                break
        if finished:
            break
        committed = torch.cat([committed, committed.new_tensor([emitted])], dim=1)
        hidden = None
        if want_hidden:
            index = path.to(scored.hidden_states.device)[..., None]
            hidden = scored.hidden_states.gather(1, index.expand(-1, -1, scored.hidden_states.shape[-1]))
        drafter.observe(StepResult(committed=committed, accepted_len=accepted, path=path, hidden_states=hidden))

    stats.new_tokens = len(new)
    stats.total_seconds = time.perf_counter() - start
    return new, stats
