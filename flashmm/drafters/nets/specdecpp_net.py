"""SpecDec++'s acceptance heads (Huang et al., arXiv 2405.19715) as torch modules: AcceptanceHead for a
draft LM's chains, RankAcceptanceHead for a tree drafter's nodes; flashmm.drafters.specdecpp stops
drafts with them, flashmm.train.acceptance trains them."""
from __future__ import annotations

import torch
from torch import nn


class AcceptanceHead(nn.Module):
    """MLP: (hidden [.., d], probs [.., V]) -> logit [..] of P(target accepts the draft's top-1 token).

    Inputs: the draft's final-normed hidden state (what its LM head reads) and 2 scalars of the draft
    distribution: top-1 probability and entropy in nats.
    """

    def __init__(self, hidden_size: int, width: int = 128):
        super().__init__()
        self.hidden_size, self.width = hidden_size, width
        self.net = nn.Sequential(nn.Linear(hidden_size + 2, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(),
                                 nn.Linear(width, 1))

    @staticmethod
    def scalars(probs: torch.Tensor) -> torch.Tensor:
        """probs [.., V] -> [.., 2]: top-1 probability, entropy (nats)."""
        top = probs.max(-1).values
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        return torch.stack([top, entropy], dim=-1)

    def forward(self, hidden: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        """hidden [.., d], scalars [.., 2] (``scalars(probs)``) -> logits [..]."""
        return self.net(torch.cat([hidden.float(), scalars.float()], dim=-1))[..., 0]


class RankAcceptanceHead(nn.Module):
    """MLP: (a node's head output state [.., d], the draft's log-probabilities there [.., V'], the
    node's depth [..] (0 = the root)) -> [.., ranks + 1] log P(the target's next token is the r-th most
    likely child), the last column "none of the top ``ranks``". Inputs: the top-``ranks``
    log-probabilities and the entropy (``summary``), the depth one-hot (depths past ``max_depth`` - 1
    share the last), and the state through a LayerNorm and a projection to ``state_width`` features
    (dropout while training): a few hundred answers are what is left after the head's own training
    text, and a full-width state lets a predictor memorise them (held-out log-loss 1.42 against 1.40
    for the draft's own probabilities; 1.36 through 8 features)."""

    def __init__(self, hidden_size: int, ranks: int = 8, max_depth: int = 8, width: int = 64, state_width: int = 8,
                 dropout: float = 0.3):
        super().__init__()
        self.hidden_size, self.ranks, self.max_depth = hidden_size, ranks, max_depth
        self.width, self.state_width, self.dropout = width, state_width, dropout
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False)
        self.state = nn.Linear(hidden_size, state_width)
        self.net = nn.Sequential(nn.Linear(state_width + ranks + 1 + max_depth, width), nn.SiLU(),
                                 nn.Linear(width, width), nn.SiLU(), nn.Linear(width, ranks + 1))

    def summary(self, logp: torch.Tensor) -> torch.Tensor:
        """logp [.., V'] -> [.., ranks + 1]: the top ``ranks`` log-probabilities, then the entropy (nats)."""
        logp = logp.float().log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1, keepdim=True)
        return torch.cat([logp.topk(self.ranks, dim=-1).values.clamp_min(-30.0), entropy], dim=-1)

    def forward(self, hidden: torch.Tensor, summary: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """hidden [.., d], summary [.., ranks + 1] (``summary(logp)``), depth [..] -> log-probs [.., ranks + 1]."""
        onehot = nn.functional.one_hot(depth.long().clamp(0, self.max_depth - 1), self.max_depth).float()
        state = nn.functional.dropout(self.state(self.norm(hidden.float())), self.dropout, self.training)
        return self.net(torch.cat([state, summary.float(), onehot], dim=-1)).log_softmax(-1)

    def sizes(self) -> dict:
        return {"kind": "ranks", "hidden_size": self.hidden_size, "ranks": self.ranks, "max_depth": self.max_depth,
                "width": self.width, "state_width": self.state_width, "dropout": self.dropout}


def output_layer(model: nn.Module) -> nn.Module:
    """The LM head of a draft LM (a ReducedVocabLM's inner LM, or any HF causal LM)."""
    inner = getattr(model, "lm", model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(model).__name__} exposes no output embeddings; SpecDec++ reads the hidden state "
                         "its LM head receives, so it needs a causal LM with get_output_embeddings()")
    return head
