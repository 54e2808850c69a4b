"""DSpark's block drafter (arXiv 2607.05147) as torch modules, in the layout of vLLM's speculators format.

DSpark is DFlash's block drafter (flashmm.drafters.nets.dflash_net.DFlashNet, held here as ``backbone``) with two
small heads on the block's final normed states h_k [d]:

- a Markov head: a low-rank logit bias B = W2 W1 on the draft vocabulary from the token before the one slot k
  predicts (W1: an embedding over the target's vocabulary [V, r]; W2: [r -> Vd]), so the slots of one block
  condition on each other's drafted tokens, where the backbone drafts them all at once:
      vanilla: bias_k = W2 e_k                                 (e_k = W1[previous token of slot k])
      gated:   bias_k = W2 (sigmoid(G [h_k ; e_k] + g) * e_k)
      rnn:     s_k = z_k * s_{k-1} + (1 - z_k) * tanh(c_k),  bias_k = W2 tanh(o_k),
               [z_k (sigmoid) ; c_k ; o_k] = J [s_{k-1} ; e_k ; h_k] + j,  s_{-1} = 0
  logits_k = lm_head(h_k) + bias_k;
- a confidence head: a scalar logit per slot, P(slot k's token is accepted) = sigmoid(w . [h_k ; e_k] + b)
  ([h_k] alone without ``confidence_with_markov``), trained on the slot's analytical acceptance rate; its
  running product over a block's slots is the probability the whole prefix is accepted.

Alignment (``sample_from_anchor``): True (DSpark's default) — slot k of a block anchored at position p (the
anchor token there, masks after it) predicts the token at p + k + 1, and its previous token is the one at
p + k; False (DFlash's) — slot k predicts p + k (slot 0 predicts nothing) and its previous token is the one at
p + k - 1 (slot 0's: the anchor). Teacher-forced in training (the true tokens); in drafting, the tokens drafted
for the slots before.

Read from speculators 0.9.0 (models/dspark/config.py, core.py, model_definitions.py): not copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .dflash_net import DFlashNet

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DSparkConfig:
    vocab_size: int                      # the target's vocabulary V (the Markov head's W1 rows)
    markov_rank: int                     # r; 0: no Markov head (the backbone's logits as they are)
    markov_head_type: str                # one of MARKOV_HEAD_TYPES
    confidence: bool                     # a confidence head
    confidence_with_markov: bool         # the confidence head reads [h_k ; e_k] (else h_k alone)
    sample_from_anchor: bool             # slot 0 (the anchor) drafts the next token (see the module docstring)

    def __post_init__(self):
        if self.markov_rank < 0 or self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_rank must be >= 0 and markov_head_type one of {MARKOV_HEAD_TYPES}, got "
                             f"{self.markov_rank}, {self.markov_head_type!r}")
        if self.confidence and self.confidence_with_markov and self.markov_rank == 0:
            raise ValueError("a confidence head that reads the Markov embedding needs a Markov head (markov_rank > 0)")


class MarkovHead(nn.Module):
    """The low-rank bias from the previous token (names as speculators' ``markov_head.*``)."""

    def __init__(self, c: DSparkConfig, hidden_size: int, draft_vocab_size: int):
        super().__init__()
        r, self.kind, self.rank = c.markov_rank, c.markov_head_type, c.markov_rank
        self.markov_w1 = nn.Embedding(c.vocab_size, r)
        self.markov_w2 = nn.Linear(r, draft_vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + hidden_size, 3 * r)

    def step(self, previous: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """One slot of N blocks: previous tokens (target ids) [N], the slot's states h_k [N, d], the rnn state
        [N, r] of the slot before (None: the first slot) → (bias [N, Vd], e_k [N, r], the state after [N, r])."""
        embedded = self.markov_w1(previous.long()).to(self.markov_w2.weight.dtype)
        if self.kind == "vanilla":
            return self.markov_w2(embedded), embedded, state
        hidden = hidden.to(embedded.dtype)
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded], dim=-1)))
            return self.markov_w2(gate * embedded), embedded, state
        if state is None:
            state = embedded.new_zeros(embedded.shape[0], self.rank)
        gate, candidate, out = self.joint_proj(torch.cat([state, embedded, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(out)), embedded, state


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [.., width] → confidence logits [..]."""
        return self.proj(features).squeeze(-1)


class DSparkNet(nn.Module):
    """backbone (a DFlashNet) + markov_head (None when markov_rank is 0) + confidence_head (or None)."""

    def __init__(self, backbone: DFlashNet, c: DSparkConfig):
        super().__init__()
        self.backbone, self.config = backbone, c
        d, vd = backbone.config.hidden_size, backbone.config.draft_vocab_size
        self.markov_head = MarkovHead(c, d, vd) if c.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(d + (c.markov_rank if c.confidence_with_markov else 0)) \
            if c.confidence else None

    @property
    def first_slot(self) -> int:
        """The first slot that drafts a token: 0 with sample_from_anchor, else 1."""
        return 0 if self.config.sample_from_anchor else 1

    def slot(self, k: int, hidden: torch.Tensor, base: torch.Tensor, previous: torch.Tensor, state):
        """Slot k of N blocks: its states h_k [N, d], backbone logits [N, Vd], previous tokens [N], the Markov
        state of slot k - 1 → (corrected logits [N, Vd], confidence logits [N] or None, the Markov state)."""
        embedded = None
        if self.markov_head is not None:
            bias, embedded, state = self.markov_head.step(previous, hidden, state)
            base = base + bias
        confidence = None
        if self.confidence_head is not None:
            features = torch.cat([hidden, embedded.to(hidden.dtype)], -1) if self.config.confidence_with_markov \
                else hidden
            confidence = self.confidence_head(features)
        return base, confidence, state

    def previous_tokens(self, block_tokens: torch.Tensor) -> torch.Tensor:
        """The tokens at a block's positions p, p + 1, .. [N, size] (the anchor first) → each slot's previous
        token [N, size] (see the module docstring)."""
        if self.config.sample_from_anchor:
            return block_tokens
        return torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1)

    def teacher_forced(self, hidden: torch.Tensor, block_tokens: torch.Tensor):
        """Training's view of N blocks: final normed states [N, size, d] and the true tokens at the blocks'
        positions [N, size] → (corrected logits [N, size, Vd], confidence logits [N, size] or None)."""
        base = self.backbone.lm_head(hidden)
        previous, state, logits, confidence = self.previous_tokens(block_tokens), None, [], []
        for k in range(hidden.shape[1]):
            out, conf, state = self.slot(k, hidden[:, k], base[:, k], previous[:, k], state)
            logits.append(out)
            confidence.append(conf)
        return torch.stack(logits, 1), None if self.confidence_head is None else torch.stack(confidence, 1)

    def draft_chain(self, hidden: torch.Tensor, anchor: int, count: int):
        """Drafting one block: final normed states [size, d] of the block anchored at token ``anchor`` (a target
        id) → the draft rows (draft-vocabulary ids) [count] and their confidence logits [count] (None without
        a confidence head): slot k's row is the argmax of its corrected logits given the tokens drafted for the
        slots before it (their target ids through the backbone's draft_to_target)."""
        base = self.backbone.lm_head(hidden)
        to_target = self.backbone.draft_to_target.to(hidden.device)
        # the tokens at p, p + 1, ..: the last one is always the previous token of the slot at hand (both
        # alignments: the slot that predicts position p + j comes right after the one that predicts p + j - 1)
        tokens = torch.tensor([anchor], device=hidden.device)
        state, rows, confidence = None, [], []
        for k in range(self.first_slot + count):
            logits, conf, state = self.slot(k, hidden[k: k + 1], base[k: k + 1], tokens[-1:], state)
            if k >= self.first_slot:
                row = logits[0].argmax()
                rows.append(row)
                confidence.append(None if conf is None else conf[0])
                tokens = torch.cat([tokens, to_target[row].view(1)])
        rows = torch.stack(rows) if rows else torch.zeros(0, dtype=torch.long, device=hidden.device)
        return rows, None if self.confidence_head is None or not confidence else torch.stack(confidence)

    #: speculators' names of the heads' tensors (the rest are the backbone's, DFlashNet.state_from_speculators)
    HEADS = ("markov_head.", "confidence_head.")

    @classmethod
    def state_from_speculators(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """speculators' dspark state → this module's (the backbone's under ``backbone.``)."""
        heads = {k: v for k, v in state.items() if k.startswith(cls.HEADS)}
        backbone = DFlashNet.state_from_speculators({k: v for k, v in state.items() if k not in heads})
        return {**{f"backbone.{k}": v for k, v in backbone.items()}, **heads}
