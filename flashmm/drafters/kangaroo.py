"""Kangaroo (Liu et al., 2024): the target's first l layers + a small trained adapter + its LM head.

The adapter is Kangaroo's: one attention layer between two norms, built from the target's own
classes (its attention and RMSNorm, so RoPE, GQA and biases are the target's) and trained on the
target's features (flashmm.train.kangaroo). A draft step runs the token through layers [0, l) on the
target's own cache (flashmm.drafters.self_spec: the committed rows are reused, the chain's are
cropped), then ``post_norm(h + attn(input_norm(h)))`` on the adapter's own KV cache, then the
target's LM head. Double early exit: the shallow sub-network exits at layer l, and drafting stops
before the first token whose draft confidence (top-1 probability) is below ``confidence``.

The adapter's cache holds one row per committed token (the root excluded, like the target's).
Rows of tokens it has not seen (the prompt, a last drafted token it never fed) are caught up at
the next propose: their layer-l states come from running them through layers [0, l) appended to
the target's cache with a mask that shows each only the rows before its position (the very
computation teacher forcing does), then cropped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DynamicCache

from ..targets.layers import crop_layers, layer_len
from .base import SequenceStart, StepResult, register
from .files import blamed_on, check_section, parameters_of, read_safetensors
from .nets.kangaroo_net import KangarooAdapter
from .saved import CONFIG_FILE, read_info
from .self_spec import SelfDraftOptions, SelfDrafter


@dataclass(frozen=True)
class KangarooOptions(SelfDraftOptions):
    """Kangaroo's options: exit_layer (the adapter's; its range is checked at bind, against the target) and
    SelfDraftOptions' (max_draft_tokens 6, confidence 0.6 here)."""

    max_draft_tokens: int = 6
    confidence: float = 0.6
    exit_layer: int = 2


@register
class Kangaroo(SelfDrafter):
    """Layers [0, exit_layer) + a trained KangarooAdapter + the target's LM head (see module docstring).

    Options: KangarooOptions, as keywords or ``options=``; ``adapter_state``: the adapter's weights."""

    name = "kangaroo"

    def __init__(self, adapter_state: dict, options: KangarooOptions | None = None, **given):
        super().__init__(KangarooOptions.build(type(self).__name__, given, options))
        self.adapter_state = adapter_state
        self.exit_layer = self.options.exit_layer
        self.adapter: KangarooAdapter | None = None
        self.adapter_cache = DynamicCache()
        self._fed = 0  # chain tokens fed through the adapter during the last propose
        self._chain_start = 0  # committed rows (root excluded) when that chain started
        self._committed = None

    @classmethod
    def from_dir(cls, path, **options) -> "Kangaroo":
        """The adapter saved in folder ``path`` (``save``); DrafterFileError naming the file when
        drafter.json or model.safetensors is malformed."""
        config = Path(path) / CONFIG_FILE
        info = check_section(config, "drafter.json (a Kangaroo folder)", read_info(path),
                             {"exit_layer": int, "options": dict}, required=("exit_layer",), unknown_ok=True)
        saved = check_section(config, "'options'", info.get("options", {}),
                              *parameters_of(KangarooOptions, skip=("exit_layer",)))
        state = read_safetensors(Path(path) / "model.safetensors")
        with blamed_on(config, "'options'", options):
            return cls(state, exit_layer=info["exit_layer"], **{**saved, **options})

    def save(self, path, info: dict) -> None:
        """Write drafter.json (info + exit_layer) and the adapter's weights in fp16."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(torch.float16).contiguous() for k, v in self.adapter_state.items()},
                  str(path / "model.safetensors"))
        (path / CONFIG_FILE).write_text(json.dumps({**info, "exit_layer": self.exit_layer}, indent=1))

    def bind(self, target) -> None:
        super().bind(target)
        if not 1 <= self.exit_layer < self.runner.num_layers:
            raise ValueError(f"exit_layer must be in [1, {self.runner.num_layers - 1}], got {self.exit_layer}")
        adapter = KangarooAdapter(target.model)
        try:
            adapter.load_state_dict(self.adapter_state)
        except RuntimeError as error:
            raise ValueError(f"this Kangaroo adapter was trained for another target: {error}") from None
        self.adapter = adapter.to(device=self.runner.device, dtype=self.runner.dtype).eval()

    def begin(self, start: SequenceStart) -> None:
        super().begin(start)
        self.adapter_cache = DynamicCache()
        self._fed = 0

    def drafting_layers(self) -> range:
        return range(self.exit_layer)

    def draft_parameters(self) -> int:
        return super().draft_parameters() + self.numel(self.adapter)

    # ------------------------------------------------------------------ drafting
    def draft_logits(self, token: torch.Tensor, position: int, cache) -> torch.Tensor:
        runner = self.runner
        if self._fed == 0:  # the chain's first step: the adapter's cache must hold every committed row
            self._catch_up(cache, position)
        positions = token.new_tensor([[position]])
        hidden = runner.run(runner.embed(token), 0, self.exit_layer, cache, None, positions)
        hidden = self.adapter(hidden, runner.rotary(hidden, positions), None, self.adapter_cache)
        self._fed += 1
        return runner.lm_head(hidden)[:, -1]

    def observe(self, step: StepResult) -> None:
        super().observe(step)
        # rows of the root and the accepted tokens the chain fed are exact: keep them, drop the rest
        keep = min(step.accepted_len + 1, self._fed)
        crop_layers(self.adapter_cache, [0], self._chain_start + keep)

    def propose(self, committed, max_tokens, sampling, generator):
        self._committed, self._chain_start, self._fed = committed, committed.shape[1] - 1, 0
        return super().propose(committed, max_tokens, sampling, generator)

    def _catch_up(self, cache, prefix: int) -> None:
        """Give the adapter cache rows for committed positions [held, prefix): their layer-l states are
        recomputed by appending them to the target's cache behind a mask showing each only the rows
        before its own position (and itself), then cropped away."""
        held = layer_len(self.adapter_cache, 0)
        if held >= prefix:
            return
        runner, count = self.runner, prefix - held
        # the missing tokens' input ids are not in the cache: the engine's committed text is
        tokens = self._committed[:, held:prefix]  # [1, count]
        positions = torch.arange(held, prefix, device=runner.device)[None]
        # query i (position held + i) sees the target's rows [0, held + i]: its own row included, the
        # same token at the same position; the appended copies are only computed, then cropped
        visible = torch.zeros(count, prefix + count, dtype=torch.bool, device=runner.device)
        visible[:, :held] = True
        visible[:, held:prefix] = torch.ones(count, count, dtype=torch.bool, device=runner.device).tril()
        mask = torch.zeros(1, 1, count, prefix + count, dtype=runner.dtype, device=runner.device)
        mask.masked_fill_(~visible[None, None], torch.finfo(runner.dtype).min)
        try:
            hidden = runner.run(runner.embed(tokens), 0, self.exit_layer, cache, mask, positions)
        finally:
            crop_layers(cache, range(self.exit_layer), prefix)
        causal = runner.causal_mask(count, held)
        self.adapter(hidden, runner.rotary(hidden, positions), causal, self.adapter_cache)
