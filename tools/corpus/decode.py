"""Batched decoding for corpus building: left-padded prompts, one KV cache, finished rows dropped.

``model.generate`` keeps every row of a batch until the longest one ends, so a batch whose
answers range from 20 to 256 tokens pays 256 steps for every row. Here a row leaves the batch
(and its KV cache rows are dropped) the step it emits a stop token, so each step only computes
rows still writing. Positions follow the attention mask, as ``generate`` computes them for
left padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from flashmm.targets.cache import cache_argument


@dataclass
class Sampler:
    """How the next token is picked: greedy (temperature 0) or sampled.

    Sampling draws from softmax(logits / temperature), restricted first to the ``top_k`` most
    likely tokens (0: all) and then to the smallest set whose mass reaches ``top_p``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """logits [B, V] float → next token ids [B] long."""
        if self.temperature == 0.0:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if self.top_k:
            values, ids = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)  # [B, k], sorted descending
        else:
            values, ids = logits.sort(dim=-1, descending=True)
        probs = values.softmax(-1)
        if self.top_p < 1.0:
            before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
            probs = probs.masked_fill(before >= self.top_p, 0.0)  # the top token always stays
        choice = torch.multinomial(probs, 1, generator=generator)  # [B, 1] (multinomial renormalises)
        return ids.gather(-1, choice).squeeze(-1)


def decode_batch(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int], pad_id: int,
                 sampler: Sampler, generator: torch.Generator | None = None) -> list[tuple[list[int], bool]]:
    """Continue every prompt (token ids) until a stop token or ``max_new_tokens``.

    Returns, per prompt in order, (new token ids without the stop token, finished) where
    finished is True when a stop token ended the row.
    """
    if not prompts:
        return []
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        mask[row, width - len(ids):] = 1
    device = next(model.parameters()).device  # the model's (a GPU build passes a CUDA generator too)
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, W]
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    results: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    alive = torch.arange(len(prompts))  # original row of each batch row
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **{cache_argument(model): cache},
                       use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
        next_pos = positions[:, -1] + 1  # [B]
        for step in range(max_new_tokens):
            token = sampler.pick(logits, generator)  # [B]
            done = torch.isin(token, stops)
            for row, tok, end in zip(alive.tolist(), token.tolist(), done.tolist()):
                if end:
                    finished[row] = True
                else:
                    results[row].append(tok)
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                mask, token, next_pos, alive = mask[keep], token[keep], next_pos[keep], alive[keep.cpu()]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                           **{cache_argument(model): cache}, use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
    return list(zip(results, finished))
