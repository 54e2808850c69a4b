"""Turning logits into the distribution actually sampled from (shared by p and q)."""
from __future__ import annotations

import torch

from .config import SamplingParams


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p (HF's warper order) to logits [..., V].

    Returns float32 logits with removed entries set to -inf. Ties at the top-k / top-p
    boundary follow HF: top-k keeps every logit >= the k-th largest; top-p removes tokens whose
    cumulative probability (ascending sort) is <= 1 - top_p, always keeping the most likely one.
    """
    x = logits.float()
    if params.temperature != 1.0:
        x = x / params.temperature
    if params.top_k is not None and 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        remove_sorted = cum <= 1 - params.top_p
        remove_sorted[..., -1] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        x = x.masked_fill(remove, float("-inf"))
    return x


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 probabilities [..., V] of the sampling distribution (one-hot argmax when greedy)."""
    if not params.do_sample:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return warp_logits(logits, params).softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row from probs [..., V] → LongTensor [...] on probs' device.

    The generator may live on another device than probs (a CPU generator with a CUDA model):
    the draw then happens on the generator's device and the token comes back to probs' device.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    if generator is not None and generator.device != flat.device:
        flat = flat.to(generator.device)
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.to(probs.device).view(probs.shape[:-1])
