"""LayerSkip-style early exit (Elhoushi et al., 2024): the target's first E layers draft.

A draft step runs the token through layers [0, E), then the target's own final norm and LM head.
The committed tokens' KV for those layers is the target's own cache (see flashmm.drafters.self_spec):
nothing is recomputed, the draft only appends its chain's rows and crops them. The full model
verifies. No training; E is an option, chosen for a model by ``choose_exit_layer`` (exact offline
greedy acceptance of every E over teacher-forced text, against a cost model of the draft).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..targets.layers import LayerRunner
from .base import register
from .self_spec import SelfDraftOptions, SelfDrafter


@dataclass(frozen=True)
class LayerSkipOptions(SelfDraftOptions):
    """LayerSkip's options: exit_layer (None: half the target's layers; its range is checked at bind,
    against the target) and SelfDraftOptions'."""

    exit_layer: int | None = None


@register
class LayerSkip(SelfDrafter):
    """Draft with the first ``exit_layer`` layers + final norm + LM head (None: half the layers).

    Options: LayerSkipOptions, as keywords or ``options=``."""

    name = "layerskip"

    def __init__(self, options: LayerSkipOptions | None = None, **given):
        super().__init__(LayerSkipOptions.build(type(self).__name__, given, options))
        self.exit_layer = self.options.exit_layer

    def bind(self, target) -> None:
        super().bind(target)
        total = self.runner.num_layers
        if self.exit_layer is None:
            self.exit_layer = max(1, total // 2)
        if not 1 <= self.exit_layer < total:
            raise ValueError(f"exit_layer must be in [1, {total - 1}] for this {total}-layer model, got {self.exit_layer}")

    def drafting_layers(self) -> range:
        return range(self.exit_layer)

    def draft_logits(self, token: torch.Tensor, position: int, cache) -> torch.Tensor:
        runner = self.runner
        positions = token.new_tensor([[position]])
        hidden = runner.run(runner.embed(token), 0, self.exit_layer, cache, None, positions)
        return runner.logits(hidden)[:, -1]


# ---------------------------------------------------------------------------- choosing E
@dataclass
class ExitChoice:
    """One exit layer's offline measurement.

    exit_layer: E; agreement: fraction of positions where the E-layer argmax equals the model's;
    tau: expected tokens per verification of a greedy chain of ``draft_tokens`` (bonus included);
    draft_cost: cost of one draft step in target steps (E / L of the layers + the LM head share);
    speedup: tau / (1 + draft_tokens * draft_cost + verify_extra), the cost model's estimate.
    """

    exit_layer: int
    draft_tokens: int
    agreement: float
    tau: float
    draft_cost: float
    speedup: float


def chain_tau(agree: list[torch.Tensor], draft_tokens: int) -> float:
    """Exact greedy tau of chains of ``draft_tokens`` from per-position agreement (one bool [T] per
    sequence): a chain drafted after position t accepts the run of agreements starting at t, capped."""
    accepted = []
    for flags in agree:
        runs = torch.zeros(flags.numel() + 1, dtype=torch.long)
        for t in range(flags.numel() - 1, -1, -1):  # run of agreements starting at t
            runs[t] = runs[t + 1] + 1 if flags[t] else 0
        accepted.append(runs[:-1].clamp(max=draft_tokens))
    return float(torch.cat(accepted).float().mean()) + 1.0


@torch.no_grad()
def choose_exit_layer(model: torch.nn.Module, sequences: list[torch.Tensor], exits: list[int] | None = None,
                      draft_tokens: tuple[int, ...] = (1, 2, 3, 4, 6), head_cost: float = 0.2,
                      verify_extra: float = 0.05, starts: list[int] | None = None) -> list[ExitChoice]:
    """Measure every exit layer on ``sequences`` (LongTensor [T] each; the model's own greedy text is
    the faithful choice): the E-layer argmax (final norm + LM head on output_hidden_states[E]) against
    the model's argmax at every position, teacher-forced, so its chain acceptance is exact for greedy
    decoding of that text. Cost model, in target steps: a draft step costs E/L · (1 − head_cost) +
    head_cost (head_cost: the LM head's share of a step; SmolLM2: ~0.2), verifying k more tokens
    costs verify_extra · k. Returns ExitChoices sorted by estimated speedup, best first."""
    runner = LayerRunner(model)
    total = runner.num_layers
    exits = exits or list(range(1, total))
    agree = {e: [] for e in exits}
    for n, ids in enumerate(sequences):
        out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        first = starts[n] if starts is not None else 0
        final = out.logits[0, first:].argmax(-1)  # [T - first]
        for e in exits:
            agree[e].append(runner.logits(out.hidden_states[e][:, first:])[0].argmax(-1) == final)
    choices = []
    for e in exits:
        flags = torch.cat(agree[e])
        cost = e / total * (1 - head_cost) + head_cost
        for k in draft_tokens:
            tau = chain_tau(agree[e], k)
            choices.append(ExitChoice(e, k, float(flags.float().mean()), tau, cost,
                                      tau / (1 + k * cost + k * verify_extra)))
    return sorted(choices, key=lambda c: -c.speedup)
