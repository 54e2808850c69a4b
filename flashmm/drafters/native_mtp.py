"""Native MTP: draft with the multi-token-prediction modules a model keeps in its own checkpoint.

DeepSeek-V3 / V3.2, GLM-4.5 and Qwen3-Next ship, next to the decoder, a module trained with the model that
predicts one token further (DeepSeek-V3, arXiv 2412.19437, section 2.2). transformers drops those weights
at load; inference engines serve them as drafters. This drafter reads them from the checkpoint folder the
model was loaded from and drafts a chain with them, exact by verification like every drafter here.

One module at position i reads the target's final (normed) hidden state h_i and the embedding of the next
token x_{i+1}, and predicts x_{i+2}::

    u = proj([norm_e(E(x_{i+1})) ; norm_h(h_i)])      (embedding first, as the serving engines concatenate)
    g = norm_o(Block(u))                              (Block: one decoder layer of the model's own class,
                                                       causal over the module's own positions)
    x_{i+2} ~ Head(g)                                 (its own head where the checkpoint has one, else the target's)

Its KV cache holds the positions whose inputs are committed (0 .. R-1 for a root at R), computed from the
target's hidden states. A chain of depth D runs the module at R-1 (h_{R-1}, x_R → d_1), then at R, R+1, ...
on its own output g and the token it just drafted (g_{R-1}, d_1 → d_2), as vLLM and SGLang chain one
module; those positions are dropped from its cache after the step. A checkpoint with several modules
drafts with the first (vLLM's first pass does the same).

Key layouts (read from vLLM 0.32's deepseek_mtp.py, glm4_moe_mtp.py and qwen3_next_mtp.py; the weights'
names are the checkpoints' own):

- DeepSeek-V3 / GLM-4.5: ``model.layers.{L}.`` (L = num_hidden_layers) holding ``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.norm``, ``shared_head.head`` and the decoder layer's own keys;
- Qwen3-Next: ``mtp.`` holding ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``, ``norm`` and
  ``layers.0.`` (a full-attention decoder layer); the head is the target's.
"""
from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import SamplingParams
from ..targets import cache as kv
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .base import Drafter, SequenceStart, StepResult, register, root_only
from .files import DrafterFileError, read_json
from .options import DrafterOptions, check_at_least


@dataclass(frozen=True)
class Layout:
    """Where one family keeps its MTP module: key prefix (``{L}`` = num_hidden_layers), the names of its
    parts under it, the config field that counts modules, how its decoder layer is built, and the prefix of
    the decoder layer's own keys under the module's ("": beside the parts)."""

    prefix: str
    embed_norm: str
    hidden_norm: str
    projection: str
    final_norm: str
    head: str | None
    count_field: str
    attention_layer_type: str | None = None  # hybrid models: the layer type the MTP block has
    block: str = ""


_DEEPSEEK = Layout("model.layers.{L}.", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head",
                   "num_nextn_predict_layers")
LAYOUTS = {
    "DeepseekV3ForCausalLM": _DEEPSEEK,
    "DeepseekV32ForCausalLM": _DEEPSEEK,
    "Glm4MoeForCausalLM": _DEEPSEEK,
    "Qwen3NextForCausalLM": Layout("mtp.", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm", None,
                                   "num_nextn_predict_layers", attention_layer_type="full_attention",
                                   block="layers.0."),
}


def checkpoint_tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint in ``folder`` whose name starts with ``prefix``, the prefix
    taken off (only the shards that hold them are opened)."""
    from safetensors import safe_open  # noqa: PLC0415

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        shards = sorted({shard for name, shard in weight_map.items() if name.startswith(prefix)})
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise DrafterFileError(folder, "has no model.safetensors or model.safetensors.index.json: native MTP reads "
                                       "the model's own safetensors checkpoint")
    found = {}
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as handle:
            for name in handle.keys():
                if name.startswith(prefix):
                    found[name[len(prefix):]] = handle.get_tensor(name)
    return found


class MTPModule(nn.Module):
    """One MTP module: the norms of the embedding and of the hidden state, their projection, the decoder layer
    ``block`` (its cache is the module's own: layer index 0), the final norm (``norm_class``, as the block's
    norms) and, where ``layout`` has one, its own head of ``vocab_size`` rows; weights from ``tensors`` (the
    module's keys, ``layout.prefix`` taken off; DrafterFileError naming ``source`` unless they match)."""

    def __init__(self, block: nn.Module, norm_class: type[nn.Module], size: int, eps: float, vocab_size: int,
                 layout: Layout, tensors: dict[str, torch.Tensor], source: Path):
        super().__init__()
        self.embed_norm, self.hidden_norm, self.final_norm = (norm_class(size, eps=eps) for _ in range(3))
        self.projection = nn.Linear(2 * size, size, bias=False)
        self.block = block
        for module in self.block.modules():  # its cache is this module's own, one layer
            if hasattr(module, "layer_idx"):
                module.layer_idx = 0
        self.head = nn.Linear(size, vocab_size, bias=False) if layout.head else None
        parts = {layout.embed_norm: "embed_norm", layout.hidden_norm: "hidden_norm",
                 layout.projection: "projection", layout.final_norm: "final_norm"}
        if layout.head:
            parts[layout.head] = "head"
        state = {}
        for name, tensor in tensors.items():
            part = next((p for p in parts if name.startswith(p + ".")), None)
            if part is not None:
                state[parts[part] + name[len(part):]] = tensor
            elif name.startswith(layout.block) and not name.startswith("embed_tokens."):  # the target's embedding
                state["block." + name[len(layout.block):]] = tensor
        expected = set(self.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise DrafterFileError(source, f"its MTP module (keys {layout.prefix!r}) does not match "
                                           f"{type(self.block).__name__}: missing {missing[:6]}, "
                                           f"unexpected {unexpected[:6]}")
        self.load_state_dict(state)
        parameters = inspect.signature(self.block.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"

    @classmethod
    def of_model(cls, model: nn.Module, layout: Layout, tensors: dict[str, torch.Tensor], source: Path) -> "MTPModule":
        """The MTP module of ``model``'s checkpoint: its decoder layer class (at index num_hidden_layers, or a
        one-layer hybrid config of ``layout.attention_layer_type``) and RMSNorm, in the model's dtype."""
        config, decoder = model.config, model.model
        layer_config, index = config, config.num_hidden_layers
        if layout.attention_layer_type is not None:  # hybrid stacks: the block is one layer of the given type
            layer_config, index = copy.copy(config), 0
            layer_config.layer_types = [layout.attention_layer_type]
        block = type(decoder.layers[0])(layer_config, index)
        module = cls(block, type(decoder.norm), config.hidden_size, config.rms_norm_eps, config.vocab_size, layout,
                     tensors, source)
        return module.to(dtype=model.get_output_embeddings().weight.dtype)

    def forward(self, embeds, hidden, position_embeddings, mask, cache) -> torch.Tensor:
        """embeds / hidden [1, n, d] at n positions after the cache's → the normed output g [1, n, d]."""
        u = self.projection(torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1))
        out = self.block(u, attention_mask=mask, position_embeddings=position_embeddings, use_cache=True,
                         **{self._cache_argument: cache})
        return self.final_norm(out[0] if isinstance(out, tuple) else out)


def causal_bias(past: int, n: int, dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, n, past + n]: n new positions after ``past`` cached ones, each seeing the cache and
    the new positions up to itself."""
    allowed = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


@dataclass(frozen=True)
class NativeMTPOptions(DrafterOptions):
    """NativeMTP's options (see the class)."""

    max_draft_tokens: int = 3

    def __post_init__(self):
        check_at_least(self, 1, "max_draft_tokens")


@register
class NativeMTP(Drafter):
    """The MTP module of the model's own checkpoint as a drafter: ``flashmm.wrap(model, "native_mtp")``.

    checkpoint: the folder holding the model's safetensors (default: the folder the model was loaded from,
    ``model.name_or_path``; a place, not an option); max_draft_tokens: the chain's depth, each token one run
    of the module.

    Options: NativeMTPOptions, as keywords or ``options=``."""

    name = "native_mtp"
    needs_hidden_states = True  # the final-normed hidden states (output_hidden_states' last entry)
    #: the model classes whose checkpoints it reads (any other target is refused at bind)
    families = tuple(sorted(LAYOUTS))

    def __init__(self, checkpoint: str | os.PathLike | None = None, options: NativeMTPOptions | None = None,
                 **given):
        self._options = NativeMTPOptions.build(type(self).__name__, given, options)
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.max_draft_tokens = self.options.max_draft_tokens
        self.module: MTPModule | None = None

    def bind(self, target) -> None:
        model = target.model
        family = type(model).__name__
        layout = LAYOUTS.get(family)
        if layout is None:
            raise ValueError(f"native_mtp: {family} keeps no MTP module flashmm can read; it reads "
                             f"{', '.join(sorted(LAYOUTS))}")
        if self.checkpoint is not None and not self.checkpoint.is_dir():
            raise ValueError(f"native_mtp: checkpoint={str(self.checkpoint)!r} is not a folder")
        loaded_from = str(getattr(model, "name_or_path", "") or "")
        folder = self.checkpoint or (Path(loaded_from) if loaded_from else None)
        if folder is None or not folder.is_dir():
            raise ValueError(f"native_mtp reads the MTP weights from the model's checkpoint folder; the model's "
                             f"name_or_path {loaded_from!r} is not a folder: pass checkpoint=DIR")
        count = getattr(model.config, layout.count_field, None)
        if count is not None and count < 1:
            raise ValueError(f"native_mtp: {folder}'s config sets {layout.count_field}={count}: no MTP module")
        prefix = layout.prefix.format(L=model.config.num_hidden_layers)
        tensors = checkpoint_tensors(folder, prefix)
        if not tensors:
            raise DrafterFileError(folder, f"holds no tensors named {prefix}*: this checkpoint has no MTP module "
                                           "(a model saved again by transformers loses it; use the published one)")
        self.module = MTPModule.of_model(model, layout, tensors, folder).to(model.get_output_embeddings().weight.device)
        self.module.requires_grad_(False)
        self._embed = target.input_embeddings()
        self._head = self.module.head if self.module.head is not None else target.output_embeddings()
        self._rotary = model.model.rotary_emb

    def begin(self, start: SequenceStart) -> None:
        if start.hidden_states is None:
            raise ValueError("native_mtp needs the target's hidden states at the prompt")
        self._hidden = start.hidden_states[0]             # h_0 .. h_{T-1} [T, d]
        self._cache = None
        self._fed = 0                                     # positions in the module's cache

    def observe(self, step: StepResult) -> None:
        self._hidden = torch.cat([self._hidden, step.hidden_states[0].to(self._hidden.dtype)])

    def _run(self, embeds: torch.Tensor, hidden: torch.Tensor, first: int) -> torch.Tensor:
        """The module at positions first .. first + n - 1 (embeds / hidden [n, d]) → g [n, d]."""
        from transformers import DynamicCache  # noqa: PLC0415

        if self._cache is None:
            self._cache = DynamicCache()
        n = embeds.shape[0]
        positions = torch.arange(first, first + n, device=embeds.device)[None]
        if first == 0:  # the engines zero the embedding at position 0 (vLLM deepseek_mtp)
            embeds = torch.cat([torch.zeros_like(embeds[:1]), embeds[1:]])
        cos_sin = self._rotary(embeds[None], positions)
        mask = causal_bias(first, n, embeds.dtype, embeds.device)
        return self.module(embeds[None], hidden[None], cos_sin, mask, self._cache)[0]

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("native_mtp drafts one sequence at a time (batches fork it per row)")
        root = committed.shape[1] - 1
        depth = min(self.max_draft_tokens, max_tokens)
        if depth < 1 or root < 1:
            return root_only(committed)
        if self._cache is not None:
            kv.crop(self._cache, self._fed)           # drop the last chain's positions
        ids = committed[0]
        start = self._fed                                 # positions start .. R-1: h_i with x_{i+1}
        g = self._run(self._embed(ids[start + 1: root + 1]), self._hidden[start:root], start)[-1:]
        self._fed = root
        drafted = []
        for j in range(depth):
            token = self._head(g).argmax(-1)              # [1]
            drafted.append(token)
            if j + 1 < depth:                             # position R + j: its own output and the token it drafted
                g = self._run(self._embed(token), g, root + j)
        tokens = torch.cat([ids[root:], *drafted])[None]
        return Draft(tokens=tokens, tree=TokenTree.chain(depth), q_probs=None)
