"""Public entry point: ``flashmm.wrap(model, drafter, **config).generate(...)``."""
from __future__ import annotations

import os
import warnings
from dataclasses import fields
from typing import Iterable, Iterator

import torch
from transformers import GenerationConfig

from ..config import SpecConfig
from ..drafters.base import Drafter
from ..drafters.files import refuse_renamed
from ..drafters.resolve import resolve_drafter
from ..targets import make_target
from ..targets.collate import collate
from ..targets.media_rows import holds_media_tensors, item_media
from ..targets.onednn import resolve_draft_precision
from ..targets.prune import check_prunable
from .generation import finish, prepare
from .loop import Admission, Decoding, GenerationStats, decode, decode_rows

_SPEC_FIELDS = {f.name for f in fields(SpecConfig)}


class SpeculativeModel:
    """A model plus a drafter; ``generate`` returns what the model's own ``generate`` returns.

    Greedy output is token-identical to ``model.generate`` (fp32); sampled output has the same
    distribution (every verifier but ``typical_lossy`` is lossless). ``drafter`` and
    ``allow_untrained`` as in ``wrap``.
    """

    def __init__(self, model: torch.nn.Module, drafter: Drafter | str | os.PathLike, processor=None,
                 attention: str = "auto", linear: str = "auto", cuda_graphs: bool = False,
                 allow_untrained: bool = False, draft_precision: str = "auto", **config):
        unknown = set(config) - _SPEC_FIELDS
        refuse_renamed(unknown, "flashmm.wrap")
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; SpecConfig fields are {sorted(_SPEC_FIELDS)}")
        if attention not in ("auto", "triton", "torch"):
            raise ValueError(f"attention must be 'auto', 'triton' or 'torch', got {attention!r}")
        if drafter is None:
            raise TypeError("drafter must be a flashmm Drafter, a registered name or a drafter folder, got None")
        # the one rule for randomly initialised drafters, shared with CaptionPipeline and the CLI
        drafter = resolve_drafter(drafter, device=getattr(model, "device", None), allow_untrained=allow_untrained)
        self.model = model
        self.processor = processor
        self.spec = SpecConfig(**config)
        self.target = make_target(model, processor=processor, attention=attention, linear=linear)
        self.target.draft_precision = resolve_draft_precision(draft_precision, getattr(self.target, "linear_backend",
                                                                                       "torch"))
        if cuda_graphs:
            self.target.use_cuda_graphs()
        self.drafter = drafter
        drafter.bind(self.target)
        if self.spec.prune != "none":
            check_prunable(self.target)  # ProPD splits the target's forward layer by layer
        self.last_stats: GenerationStats | None = None
        self.last_row_stats: list[GenerationStats] = []  # per output row of the last call (last_stats sums them)

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None,
                 logits_processor=None, stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None,
                 assistant_model=None, streamer=None, negative_prompt_ids=None, negative_prompt_attention_mask=None,
                 custom_generate=None, generator: torch.Generator | None = None, **kwargs):
        """``model.generate``'s signature and return value, decoded speculatively.

        Everything is prepared by transformers' own code (``flashmm.engine.generation``): the checkpoint's
        generation config with ``generation_config`` / keyword overrides, the logits processors
        (repetition penalty, min_p, bad words, ...: applied to every drafted position with that
        position's own prefix), stopping criteria (EOS, stop strings, max time, yours), streamers,
        ``return_dict_in_generate`` with ``scores`` / ``logits``, ``num_return_sequences``.
        ``generator`` (flashmm's own) seeds sampling. What flashmm cannot decode exactly (beam
        search, assisted generation, contrastive search, DoLa, guidance, attentions/hidden states)
        raises ValueError naming the argument; an argument nobody knows raises transformers' error.

        Returns LongTensor [B * num_return_sequences, T + new] (rows that stop early are right-padded
        with pad_token_id, like model.generate), or a GenerateDecoderOnlyOutput.
        A batch is verified together, one target forward per step for all running rows, media per
        row. With SpecConfig.batching="rows", a recurrent or hybrid model, a drafter that drafts on the
        target's own cache (layerskip, swift, kangaroo) or num_return_sequences > 1 with media, rows
        decode one after another, each alone with its own media (a warning says so where media are
        split); either way each row decodes exactly as the model decodes it.
        """
        unsupported = dict(synced_gpus=synced_gpus, assistant_model=assistant_model,
                           negative_prompt_ids=negative_prompt_ids,
                           negative_prompt_attention_mask=negative_prompt_attention_mask,
                           custom_generate=custom_generate)
        plan = prepare(self.model, inputs, generation_config, logits_processor, stopping_criteria,
                       prefix_allowed_tokens_fn, streamer, unsupported, kwargs)
        keep_scores = bool(plan.config.return_dict_in_generate and plan.config.output_scores)
        keep_logits = bool(plan.config.return_dict_in_generate and plan.config.output_logits)
        stats = GenerationStats()
        decodings = [Decoding(sampling=plan.sampling(b), max_new_tokens=plan.max_new_tokens, stop=plan.stop,
                              streamer=streamer, keep_scores=keep_scores, keep_logits=keep_logits)
                     for b in range(plan.batch_size)]
        together = self.batches(plan)
        row_inputs = None if together else self.row_inputs(plan)
        if together:
            rows = decode(self.target, self.drafter, plan.input_ids, decodings, self.spec, generator,
                          plan.model_inputs, attention_mask=plan.attention_mask)
        else:
            rows = [row for b in range(plan.batch_size)  # each row runs exactly as it would alone
                    for row in decode(self.target, self.drafter, plan.input_ids[b : b + 1, plan.padding(b):],
                                      [decodings[b]], self.spec, generator, row_inputs[b])]
        for row in rows:
            stats.merge(row.stats)
        width = max(len(r.new_tokens) for r in rows)
        for b, row in enumerate(rows):
            if not plan.has_eos_criteria and len(row.new_tokens) < width:
                # model.generate without an EOS criterion keeps decoding a row that another
                # criterion stopped until every row has stopped: decode it to the batch's width
                row_inputs = row_inputs or self.row_inputs(plan, warn=False)
                ids = plan.input_ids[b : b + 1, plan.padding(b):]
                decoding = Decoding(sampling=plan.sampling(b), max_new_tokens=width,
                                    keep_scores=keep_scores, keep_logits=keep_logits)
                (rows[b],) = decode(self.target, self.drafter, ids, [decoding], self.spec, generator, row_inputs[b])
                stats.merge(rows[b].stats)
        self.last_stats = stats
        self.last_row_stats = [row.stats for row in rows]
        return finish(plan, [r.new_tokens for r in rows], [r.scores for r in rows] if keep_scores else None,
                      [r.logits for r in rows] if keep_logits else None)

    def generate_many(self, items: Iterable[dict], batch_size: int = 8, generation_config: GenerationConfig | None = None,
                      generator: torch.Generator | None = None, **kwargs) -> Iterator[tuple[int, object]]:
        """Decode many prompts with continuous batching: up to ``batch_size`` run together, and a row
        that finishes hands its place to the next item (its own prefill, then it joins the running
        batch) instead of waiting for the slowest row of a group.

        items: each one prompt's model inputs (input_ids [1, T], attention_mask, pixel_values, ...: a
            processor's output for one item), read lazily, one as a place frees.
        generation_config, **kwargs: ``generate``'s, applied to every item (no streamer).
        Yields (the item's index, what ``generate(**item, **kwargs)`` returns for it) as each finishes,
        so not in order; ``last_stats`` then sums every item's GenerationStats. Each row is decoded
        exactly (greedy: identical to the model's own ``generate`` of the item, up to the floating-point
        differences of forwards computed together). A model, drafter or option that cannot verify rows
        together (``continuous_batching`` says which) decodes the items one at a time.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if kwargs.get("streamer") is not None:
            raise ValueError("generate_many streams whole items; a streamer cannot follow rows joining a batch")
        stats, self.last_row_stats = GenerationStats(), []
        why = self.continuous_batching()
        if why is not None or batch_size == 1:
            for index, item in enumerate(items):
                out = self.generate(**item, generation_config=generation_config, generator=generator, **kwargs)
                stats.merge(self.last_stats)
                self.last_stats = stats
                yield index, out
            return
        source, plans = enumerate(items), []  # plans[r]: (item index, GenerationPlan) of row r

        def admit(free: int) -> list[Admission]:
            joining = []
            for index, item in source:
                plan = prepare(self.model, None, generation_config, None, None, None, None, {}, {**item, **kwargs})
                if plan.batch_size != 1:
                    raise ValueError(f"generate_many: item {index} holds {plan.batch_size} rows; each item is one "
                                     "prompt (input_ids [1, T]) decoded once (num_return_sequences=1)")
                plans.append((index, plan))
                joining.append(self.admission(plan))
                if len(joining) == free:
                    break
            return joining

        first = admit(batch_size)  # the first places filled at once: one prefill (a shared prefix run once)
        if not first:
            return
        batch = collate([{"input_ids": new.input_ids, "attention_mask": torch.ones_like(new.input_ids),
                          **new.model_inputs} for new in first], pad_token_id=0)  # (padding is masked out)
        ids, mask = batch.pop("input_ids"), batch.pop("attention_mask")
        rows = decode_rows(self.target, self.drafter, ids, [new.decoding for new in first], self.spec, generator,
                           batch, attention_mask=None if len(first) == 1 else mask, admit=admit, capacity=batch_size)
        for r, out in rows:
            index, plan = plans[r]
            stats.merge(out.stats)
            self.last_stats = stats
            self.last_row_stats.append(out.stats)
            yield index, finish(plan, [out.new_tokens], [out.scores] if out.scores else None,
                                [out.logits] if out.logits else None)

    def admission(self, plan) -> Admission:
        """One prepared item (a plan of one row) as a row joining a running batch."""
        config = plan.config
        decoding = Decoding(sampling=plan.sampling(0), max_new_tokens=plan.max_new_tokens, stop=plan.stop,
                            keep_scores=bool(config.return_dict_in_generate and config.output_scores),
                            keep_logits=bool(config.return_dict_in_generate and config.output_logits))
        return Admission(input_ids=plan.input_ids[:, plan.padding(0):], decoding=decoding, model_inputs=plan.model_inputs)

    def rows_apart(self) -> str | None:
        """Why this model and drafter decode a batch's rows one after another (each alone, exactly as it
        would decode by itself), or None when they verify the rows together."""
        target = self.target
        if self.spec.batching != "auto":
            return "batching='rows' was asked for"
        if getattr(target, "recurrent", False):
            return f"{type(self.model).__name__} keeps recurrent states per sequence"
        if self.drafter.needs_target_cache:
            return f"{type(self.drafter).__name__} drafts on the target's own cache of one sequence"
        if self.spec.prune != "none":
            return f"prune={self.spec.prune!r} prunes one sequence's tree"
        if not getattr(target, "batchable", False):
            return f"{type(self.model).__name__} is not decoded in batches"
        return None

    def continuous_batching(self) -> str | None:
        """Why rows cannot join this model's running batches (generate_many), or None when they can."""
        if self.rows_apart() is None and getattr(self.target, "cuda_graphs", False):
            return "cuda_graphs verifies a batch on slots allocated for its first rows"
        return self.rows_apart()

    def batches(self, plan) -> bool:
        """Whether this call verifies its rows together (more than one row; causal LMs and the
        vision-language adapters, media per row). What ``rows_apart`` names, and num_return_sequences > 1
        with media, decode row by row (row_inputs gives each row its media)."""
        if plan.model_inputs and (plan.config.num_return_sequences or 1) > 1:
            return False  # media belong to the items, not to their expanded rows: one row after another
        if getattr(self.target, "derives_positions", False) and any(plan.padding(b) for b in range(plan.batch_size)):
            raise NotImplementedError(
                f"{type(self.model).__name__} numbers a left-padded row's tokens from the padding on (its positions "
                "ignore the attention mask), which flashmm does not reproduce: call generate once per row, or with "
                "rows of equal length")
        return plan.batch_size > 1 and self.rows_apart() is None

    def row_inputs(self, plan, warn: bool = True) -> list[dict]:
        """Each row's extra model inputs when rows decode one by one: the call's own for text or a single
        item, else each item's own media (flashmm.targets.media_rows; the items' expanded rows share them), with
        a warning saying why the batch is not verified together. Families whose media cannot be split
        per row raise NotImplementedError naming why."""
        expand = plan.config.num_return_sequences or 1
        if not plan.model_inputs or plan.batch_size == expand:
            return [plan.model_inputs] * plan.batch_size
        if warn and holds_media_tensors(plan.input_ids, plan.model_inputs):
            why = f"num_return_sequences={expand} with media" if expand > 1 else self.rows_apart()
            warnings.warn(f"flashmm decodes this batch with media row by row, each row with its own media, because "
                          f"{why}", stacklevel=3)
        items = item_media(self.target, plan.input_ids[::expand], plan.attention_mask[::expand], plan.model_inputs)
        return [items[b // expand] for b in range(plan.batch_size)]


def wrap(model: torch.nn.Module, drafter: Drafter | str | os.PathLike, processor=None, attention: str = "auto",
         linear: str = "auto", cuda_graphs: bool = False, allow_untrained: bool = False,
         draft_precision: str = "auto", **config) -> SpeculativeModel:
    """Wrap ``model`` for speculative decoding with ``drafter``: an instance, a registered name, or the
    folder of a trained drafter (``flashmm.drafters.load``) or of a saved FLASH drafter.

    A randomly initialised drafter raises ``flashmm.drafters.resolve.UntrainedDrafterError`` unless
    ``allow_untrained=True`` (as ``CaptionPipeline`` and ``--allow-untrained`` on the command line):
    the name "flash" (it builds a fresh FLASH head), a FlashDrafter without a network, a FLASH folder
    that records no training. Training-free drafters (prompt_lookup, suffix, lookahead, layerskip, ...)
    and trained folders are never refused.

    config: SpecConfig fields (verifier, max_draft_tokens, ...). ``attention`` picks the tree
    attention path: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch". ``linear``
    picks how the tree forwards' linear layers multiply: "auto" (oneDNN for an fp32 model on
    an x86-64 CPU, see flashmm.targets.onednn; torch elsewhere), "onednn" or "torch" (the model's own layers).
    ``draft_precision``: what the drafter's own linear layers multiply in beside a target on oneDNN: "auto"
    (bfloat16 where oneDNN has bf16 kernels: drafts only propose tokens, so the output is the same, at half the
    bytes a drafting pass reads) or "fp32" (as the target: draft logits equal a float64 forward's to fp32
    rounding). The greedy verification's LM head is screened in bfloat16 either way where only its argmax is
    read (flashmm.targets.head_screen: the same argmax, exactly).
    ``cuda_graphs=True`` verifies on a preallocated KV cache, every step shape captured once as a CUDA
    graph and replayed (flashmm.targets.graphs: what a small model on a GPU needs, where eager forwards are
    bound by kernel launches; the caches and their graphs are kept between calls), single sequences
    and padded batches alike.
    """
    return SpeculativeModel(model, drafter, processor=processor, attention=attention, linear=linear,
                            draft_precision=draft_precision,
                            cuda_graphs=cuda_graphs, allow_untrained=allow_untrained, **config)
