"""Public entry point: ``flashmm.wrap(model, drafter, **config).generate(...)``."""
from __future__ import annotations

from dataclasses import fields

import torch

from .config import SamplingParams, SpecConfig
from .drafters.base import Drafter, make_drafter
from .engine import GenerationStats, generate_one
from .targets import make_target

_SPEC_FIELDS = {f.name for f in fields(SpecConfig)}


class SpeculativeModel:
    """A model plus a drafter; ``generate`` returns what the model's own ``generate`` returns.

    Greedy output is token-identical to ``model.generate`` (fp32); sampled output has the same
    distribution (every verifier but ``typical_lossy`` is lossless).
    """

    def __init__(self, model: torch.nn.Module, drafter: Drafter, processor=None, attention: str = "auto",
                 linear: str = "auto", **config):
        unknown = set(config) - _SPEC_FIELDS
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; SpecConfig fields are {sorted(_SPEC_FIELDS)}")
        if attention not in ("auto", "triton", "torch"):
            raise ValueError(f"attention must be 'auto', 'triton' or 'torch', got {attention!r}")
        self.model = model
        self.processor = processor
        self.spec = SpecConfig(**config)
        self.target = make_target(model, processor=processor, attention=attention, linear=linear)
        self.drafter = drafter
        drafter.bind(self.target)
        self.last_stats: GenerationStats | None = None

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int | None = None, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id=None,
                 generator: torch.Generator | None = None, pad_token_id: int | None = None,
                 **model_inputs) -> torch.Tensor:
        """input_ids [B, T] (left padding allowed with attention_mask) → LongTensor [B, T + new].

        Rows are decoded one after another (each exactly as the model would decode that row
        alone); rows that stop early are right-padded with ``pad_token_id`` like HF.
        """
        if input_ids is None or input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError("input_ids must be a non-empty LongTensor [batch, seq_len]; got "
                             f"{None if input_ids is None else tuple(input_ids.shape)}")
        gen_config = self.model.generation_config
        if max_new_tokens is None:
            max_new_tokens = gen_config.max_new_tokens or max(gen_config.max_length - input_ids.shape[1], 0)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        sampling = SamplingParams(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        eos = eos_token_id if eos_token_id is not None else gen_config.eos_token_id
        eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        if pad_token_id is None:
            pad_token_id = gen_config.pad_token_id if gen_config.pad_token_id is not None else min(eos_ids, default=0)
        if input_ids.shape[0] > 1 and model_inputs:
            raise NotImplementedError(
                "batched multimodal generation is not supported yet: call generate once per item "
                "(flashmm.CaptionPipeline does this for you)")

        rows, stats = [], GenerationStats()
        try:
            for b in range(input_ids.shape[0]):
                ids = input_ids[b : b + 1]
                if attention_mask is not None:
                    keep = attention_mask[b].bool()
                    if not bool(keep.any()):
                        raise ValueError(f"row {b} of attention_mask is all zeros (empty prompt)")
                    ids = ids[:, keep]  # drop padding: each row runs exactly as if alone
                new, row_stats = generate_one(self.target, self.drafter, ids, max_new_tokens=max_new_tokens,
                                              sampling=sampling, spec=self.spec, eos_token_ids=eos_ids,
                                              generator=generator, model_inputs=model_inputs)
                rows.append(new)
                stats.merge(row_stats)
        finally:
            self.target.release()  # frees the cache; restores the model's attention implementation
        self.last_stats = stats
        width = max(len(r) for r in rows)
        out = input_ids.new_full((input_ids.shape[0], input_ids.shape[1] + width), pad_token_id)
        out[:, : input_ids.shape[1]] = input_ids
        for b, r in enumerate(rows):
            out[b, input_ids.shape[1] : input_ids.shape[1] + len(r)] = torch.tensor(r, dtype=out.dtype)
        return out


def wrap(model: torch.nn.Module, drafter: Drafter | str, processor=None, attention: str = "auto",
         linear: str = "auto", **config) -> SpeculativeModel:
    """Wrap ``model`` for speculative decoding with ``drafter`` (an instance or a registered name).

    config: SpecConfig fields (verifier, max_draft_tokens, ...). ``attention`` picks the tree
    attention path: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch". ``linear``
    picks how the tree forwards' linear layers multiply: "auto" (oneDNN for an fp32 model on
    an x86-64 CPU, see flashmm.onednn; torch elsewhere), "onednn" or "torch" (the model's own layers).
    """
    if isinstance(drafter, str):
        drafter = make_drafter(drafter)
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a flashmm Drafter or a registered name, got {type(drafter).__name__}")
    return SpeculativeModel(model, drafter, processor=processor, attention=attention, linear=linear, **config)
