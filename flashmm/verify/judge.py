"""Judge decoding (Bachmann et al., ICLR 2025, arXiv 2501.19309). LOSSY: the output is not the target's.

A small linear judge reads the target's own last-layer state at every drafted token (the state the
verification forward computes anyway, after the target has read that token in its context) and
says whether the token is acceptable although it is not the target's choice. A drafted child is
taken when it is the target's choice (greedy: its argmax; sampling: a draw from p at the parent),
or, when no sibling is, when the judge accepts it; the first node where neither holds ends the step
with the target's own choice. With a judge that never accepts this is exact verification (greedy,
or deterministic drafts when sampling); every token the judge lets through makes the output differ
from the target's. What "acceptable" means is what the judge was trained on
(flashmm.train.judge, ``python -m flashmm.train judge``: the target's own greedy continuation
after the token rejoins its original answer).

On disk (``load_judge(dir)``): ``judge.json`` (method "judge", target, threshold, training record
and the rebuild command) and ``judge.safetensors`` (weight [d], bias [], feature mean / scale [d]).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..tree.token_tree import TokenTree
from .base import VerifyResult
from .greedy import check_inputs, walk, walk_tables
from .rejection import draw_uniforms, sample_inverse_cdf

CONFIG_FILE, WEIGHTS_FILE = "judge.json", "judge.safetensors"


class JudgeHead(nn.Module):
    """A logistic judge over standardised target states: P(acceptable) = σ(w · (h − mean) / scale + b).
    ``threshold``: accept when that probability is at least this."""

    def __init__(self, hidden_size: int, threshold: float = 0.5, info: dict | None = None):
        super().__init__()
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.bias = nn.Parameter(torch.zeros(()))
        self.register_buffer("mean", torch.zeros(hidden_size))
        self.register_buffer("scale", torch.ones(hidden_size))
        self.threshold = threshold
        self.info = info or {}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> P(acceptable) [...] (float32)."""
        x = (hidden.float() - self.mean.to(hidden.device)) / self.scale.to(hidden.device)
        return torch.sigmoid(x @ self.weight.to(hidden.device) + self.bias.to(hidden.device))

    def accepts(self, hidden: torch.Tensor) -> torch.Tensor:
        return self(hidden) >= self.threshold

    def save(self, directory: str | Path, info: dict) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(directory / WEIGHTS_FILE))
        record = {"method": "judge", "hidden_size": self.weight.numel(), "threshold": self.threshold, **info}
        (directory / CONFIG_FILE).write_text(json.dumps(record, indent=1) + "\n")


@lru_cache(maxsize=4)
def load_judge(directory: str) -> JudgeHead:
    """The judge saved in ``directory`` (JudgeHead.save)."""
    path = Path(directory)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{directory} has no {CONFIG_FILE}: not a judge directory "
                                "(build one with python -m flashmm.train judge)")
    info = json.loads((path / CONFIG_FILE).read_text())
    judge = JudgeHead(int(info["hidden_size"]), float(info["threshold"]), info)
    judge.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
    return judge.eval()


def resolve_judge(judge) -> JudgeHead:
    """SpecConfig.judge (a JudgeHead or a judge directory) as a JudgeHead."""
    if isinstance(judge, JudgeHead):
        return judge
    if judge is None:
        raise ValueError("verifier='judge_lossy' needs a judge: SpecConfig(judge=JudgeHead or a judge directory)")
    return load_judge(str(Path(judge).resolve()))


@torch.no_grad()
def verify_judge_lossy(tokens: torch.Tensor, tree: TokenTree, p: torch.Tensor, hidden: torch.Tensor,
                       judge: JudgeHead, do_sample: bool, generator: torch.Generator | None = None, *,
                       uniforms: torch.Tensor | None = None) -> VerifyResult:
    """Judge verification. NOT LOSSLESS (module docstring).

    tokens: LongTensor [B, N]; tokens[:, 0] the root.  tree: TokenTree with N nodes.
    p:      [B, N, V] processed target probabilities (row i: the distribution of i's children).
    hidden: [B, N, d] the target's last-layer state at every node.
    do_sample: the target's choice at node i is argmax p_i (False) or a draw from p_i with
            uniforms[:, i] (inverse CDF; the same [B, N] draw as the lossless verifiers).
    """
    check_inputs(tokens, tree, p, "p")
    tokens = tokens.to(p.device)
    batch, n = tokens.shape
    if hidden.shape[:2] != (batch, n):
        raise ValueError(f"hidden must be [B, N, d] = [{batch}, {n}, d], got {tuple(hidden.shape)}")
    if do_sample:
        if uniforms is None:
            uniforms = draw_uniforms(batch, n, generator, p.device)
        u = uniforms.to(p.device, torch.float64)
        choice = torch.stack([sample_inverse_cdf(p[:, i].float(), u[:, i]) for i in range(n)], dim=1)  # [B, N]
    else:
        choice = p.argmax(-1)
    parents = walk_tables(tree, p.device)[0]
    match = tokens == choice[:, parents]                         # [B, N]: the target's own choice
    match[:, 0] = False
    matched_child = torch.zeros(batch, n, dtype=torch.long, device=p.device).scatter_add_(
        1, parents[1:].expand(batch, -1), match[:, 1:].long()) > 0   # [B, N]: some child of i matched
    accept = match | (judge.accepts(hidden.to(p.device)) & ~matched_child[:, parents])
    path, accepted_len, last = walk(tree, accept)
    next_token = choice.gather(1, last[:, None]).squeeze(1)
    return VerifyResult(path=path, accepted_len=accepted_len, next_token=next_token)
