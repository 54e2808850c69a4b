"""EAGLE-1 / EAGLE-2 drafting (arXiv 2401.15077, 2406.16858) with heads in the EAGLE repository's layout.

    flashmm.wrap(model, "path/to/EAGLE-head")          # or flashmm.drafters.load("path/to/EAGLE-head")

The head (flashmm.drafters.nets.eagle_net) reads the target's last hidden state after its final norm
(HF's ``output_hidden_states[-1]``: ``needs_hidden_states`` with no ``feature_layers``) and the embedding of
the next token, and guesses the next hidden state; the target's own LM head scores it. The drafter keeps
the head's KV cache over committed units (unit t: embedding of x_{t+1}, the target's feature of x_t); a
step first adds the units the last verification made known (their features arrive through ``observe``),
the last one's output scoring the token after the root. Then:

- ``tree="dynamic"``: EAGLE-2's tree (flashmm.tree.dynamic.grow): ``top_k`` children per expanded node, the
  ``top_k`` nodes of largest cumulative log probability expanded per depth, the best ``max_draft_tokens``
  (the engine's cap, SpecConfig.max_draft_tokens) of all grown nodes kept; each expanded node run on its own path with tree attention
  over the committed cache and its ancestors' units. ``depth`` is the deepest drafted token (the EAGLE
  repository's ``depth`` + 1: its depth counts the head passes after the root's).
- ``tree="static"``: EAGLE-1's fixed tree, given as rank ``paths`` (as the EAGLE repository's choices.py
  lists them: (0, 1) is the second most likely child of the most likely first token), grown by
  flashmm.tree.dynamic.grow_static; the first ``max_draft_tokens`` paths by (length, ranks) are kept.
- ``tree="chain"``: the head's greedy chain of up to ``depth`` tokens.

``adaptive=True`` verifies only the best-paying prefix of the grown nodes ranked by calibrated probability
(each node's path probability times accepted / predicted so far), priced by the target's verify cost
measured at bind (tree.cost.AdaptiveDraftLength, tree.trie.best_paying_prefix), as EAGLE-3's drafter does;
unlike it, this drafter never pauses its own head passes. Its drafts carry ``values`` (those probabilities),
so batched decoding may cut them to the batch's width.

Sampling: every drafted token is a most likely token of the head's distribution softmax(lm_head(out)) at its
parent (one of the ``top_k``; static: the rank its path names; chain: the argmax), chosen deterministically, so
drafts carry
``q_probs = None`` and the engine's verifier keeps the target's distribution exactly, greedy or sampled
(deterministic-children rules, as for EAGLE-3).

The folder (SafeAILab/EAGLE cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b, read, not copied: eagle/model/cnets1.py
``Model`` and ``LlamaDecoderLayer``, eagle/model/ea_model.py ``EaModel``, eagle/model/modeling_llama_kv.py,
eagle/model/configs.py ``EConfig``, eagle/train/*_config.json): a Llama ``config.json`` with
``num_hidden_layers: 1`` and no ``draft_vocab_size`` (that is EAGLE-3's), and ``pytorch_model.bin`` (read
with ``torch.load(weights_only=True)``) or ``model.safetensors`` holding ``fc.weight`` [d, 2d] (``fc.bias``
unless the config says ``bias: false``), ``layers.0.self_attn.{q,k,v,o}_proj.weight`` (q/k/v biases with
``qkv_bias``), ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight`` and
optionally ``embed_tokens.weight`` [V, d]. What it reads from them, as ea_model / cnets1 do: the feature is
``outputs[0]`` of the base model (the final-normed state), ``fc(cat(embed, feature))``, layer 0 without an
input_layernorm, head_dim = hidden_size // heads, rope_theta when the config has one (else 10000),
rms_norm_eps (else 1e-6), logits = the target's ``lm_head`` on the head's output (no norm); embeddings: the
target's, overwritten by the checkpoint's ``embed_tokens`` when it has one (load_state_dict strict=False).
Refused by name: more than one layer, scaled RoPE, an activation other than silu, a vocabulary or width
other than the target's (at bind, naming both values).
"""
from __future__ import annotations

import math
import os
import pickle
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from ..config import SamplingParams
from ..targets.onednn import routed_like
from ..tree.cost import AdaptiveDraftLength, next_pause, price_with_target
from ..tree.draft import Draft
from ..tree.dynamic import GrownTree, TreeUnits, grow, grow_static
from ..tree.token_tree import TokenTree
from ..tree.trie import best_paying_prefix
from .base import Drafter, SequenceStart, StepResult, register, root_only
from .files import (DrafterFileError, blamed_on, check_section, load_weights, parameters_of, read_json,
                    read_safetensors)
from .head_base import feed_committed
from .nets.eagle_net import EagleConfig, EagleNet
from .options import DrafterOptions, check_at_least, check_choice
from .published import UnsupportedDrafterFormat, read_weights

EAGLE_COMMIT = "cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b"
LAYOUT = "EAGLE-1/2 (EAGLE repository)"
CONFIG_FILE = "config.json"
#: beside a head flashmm trained: the target ids it drafts from (``ids``, FR-Spec's frequency-ranked subset)
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")
_IGNORED = ("rotary_emb.inv_freq",)        # a buffer older Llama code saved; recomputed from rope_theta


@dataclass(frozen=True)
class EagleOptions(DrafterOptions):
    """EagleDrafter's options (see the class)."""

    tree: str = "dynamic"
    depth: int = 6
    top_k: int = 8
    max_draft_tokens: int | None = None
    paths: Sequence[Sequence[int]] | None = None
    adaptive: bool = False

    def __post_init__(self):
        check_choice(self, "tree", ("chain", "dynamic", "static"))
        check_at_least(self, 1, "depth", "top_k")
        check_at_least(self, 0, "max_draft_tokens", allow_none=True)
        if self.paths is not None:
            object.__setattr__(self, "paths", tuple(tuple(int(r) for r in path) for path in self.paths))
        paths = self.paths or ()
        known = set(paths)
        if self.tree == "static" and not (paths and all(p and min(p) >= 0 and (len(p) == 1 or p[:-1] in known)
                                                        for p in paths)):
            raise ValueError("tree='static' needs paths=[(0,), (1,), (0, 0), ...]: rank paths from the root, each "
                             f"path's prefix among them (EAGLE-1's tree choices), got {self.paths!r}")


@register
class EagleDrafter(Drafter):
    """net: an EagleNet. tree: "dynamic" (EAGLE-2), "static" (EAGLE-1's fixed tree of rank ``paths``) or
    "chain". depth: deepest drafted token ("dynamic", "chain"). top_k: children per expanded node and nodes
    expanded per depth ("dynamic"). max_draft_tokens: most drafted tokens per step (None: the engine's
    SpecConfig.max_draft_tokens). paths: "static"'s rank paths. adaptive: verify the best-paying prefix of
    the tree only (see the module docstring). embedding: the head's own ``embed_tokens``
    [V, d] (None: the target's input embeddings). folder / verifier: where it was read from and the target its
    config names, for messages and ``info``. Options: EagleOptions, as keywords or ``options=``; ``net``,
    ``embedding``, ``folder`` and ``verifier`` are arguments of their own."""

    name = "eagle"
    needs_hidden_states = True
    feature_layers = ()                     # the last output_hidden_states entry: after the final norm
    #: what a subclass running a head of another layout changes: its network class, options class and the
    #: layout's name in messages (flashmm.drafters.published_vispec)
    net_class = EagleNet
    options_class = EagleOptions
    layout = LAYOUT

    def __init__(self, net: EagleNet, *, embedding: torch.Tensor | None = None, folder: str | os.PathLike | None = None,
                 verifier: str | None = None, draft_vocab: torch.Tensor | None = None,
                 options: EagleOptions | None = None, **given):
        if not isinstance(net, self.net_class):
            raise TypeError(f"net must be a {self.net_class.__name__} (flashmm.drafters.load(dir) reads a "
                            f"{self.layout} head), got {type(net).__name__}")
        self._options = options = self.options_class.build(type(self).__name__, given, options)
        self.net = net.eval()
        self.tree, self.depth, self.top_k = options.tree, options.depth, options.top_k
        self.paths = sorted(options.paths or (), key=lambda path: (len(path), path))   # parents first
        self.max_draft_tokens = options.max_draft_tokens
        self.folder = None if folder is None else Path(folder)
        self.info = {"method": self.name, "target": verifier, "format": f"{LAYOUT} {EAGLE_COMMIT[:7]}",
                     **({} if folder is None else {"source": os.fspath(folder)})}
        self.embedding = None if embedding is None else nn.Embedding.from_pretrained(embedding.float(), freeze=True)
        self._embed = None                      # bind: the embedding table drafted tokens are read with
        self._lm_head = None                    # bind: the target's LM head module (its draft_vocab rows, if any)
        self._linears = nullcontext()           # bind: OneDNNLinears when the target multiplies through oneDNN
        if draft_vocab is not None and (draft_vocab.dim() != 1 or draft_vocab.is_floating_point()):
            raise ValueError(f"draft_vocab must be a 1-D tensor of token ids, got {tuple(draft_vocab.shape)} "
                             f"{draft_vocab.dtype}")
        self.draft_vocab = None if draft_vocab is None else draft_vocab.long()
        self._vocab = 0
        self.adaptive, self.length = options.adaptive, AdaptiveDraftLength()
        self.evidence = [0.0, 0.0]              # forgetting sums of accepted and predicted drafted tokens
        self._values: list[float] = []          # adaptive: calibrated probability of each proposed node
        self._calibration, self._predicted = 1.0, 0.0
        self._reset()

    @classmethod
    def from_dir(cls, path, **options) -> "EagleDrafter":
        """The head in the EAGLE repository's folder ``path`` (see the module docstring). A head flashmm trained
        (``python -m flashmm.train eagle``) also carries drafter.json: its "drafting" options come first,
        ``options`` override them."""
        info_path = Path(path) / "drafter.json"
        if info_path.is_file():
            drafting = check_section(info_path, "'drafting'", read_json(info_path).get("drafting", {}),
                                     *parameters_of(EagleOptions))
            options = {**drafting, **options}
        return load_eagle_checkpoint(path, **options)

    # ------------------------------------------------------------------ protocol
    def cost_models(self) -> list:
        return [self.length] if self.adaptive else []

    def bind(self, target) -> None:
        cfg = self.net.cfg
        wrong = [(what, ours, theirs) for what, ours, theirs in (
            ("hidden size", cfg.hidden_size, target.hidden_size),
            ("vocabulary", cfg.vocab_size, target.vocab_size)) if ours != theirs]
        if wrong:
            where = f"{self.folder}: this" if self.folder is not None else "This"
            raise ValueError(f"{where} {self.layout} head does not fit the target: " + "; ".join(
                f"{what}: drafter {ours}, target {theirs}" for what, ours, theirs in wrong)
                + "; use the head trained for this target")
        if self.adaptive and self.pricing == "measured":
            self.cost_source = price_with_target(target, self.cost_models())
        self._lm_head = target.output_embeddings()
        self._vocab = target.vocab_size
        if self.draft_vocab is not None:  # FR-Spec: score only the vocabulary's most frequent tokens
            if int(self.draft_vocab.max()) >= self._vocab or int(self.draft_vocab.min()) < 0:
                raise ValueError(f"{self.folder or 'this head'}: draft_vocab holds ids up to "
                                 f"{int(self.draft_vocab.max())}, outside the target's {self._vocab}-token vocabulary")
            rows = self._lm_head.weight.detach()[self.draft_vocab.to(self._lm_head.weight.device)]
            self._lm_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False).to(rows)
            self._lm_head.weight.data.copy_(rows)
        table = target.input_embeddings()
        device = table.weight.device
        self.net = self.net.to(device)
        # the head and the LM head it scores with multiply as the target does (SmolLM2, 2 cores: drafting an
        # EAGLE-2 tree took ~60 ms a step through torch's linear, most of it the 49,152-row LM head)
        self._linears = routed_like(target, nn.ModuleList([self.net, self._lm_head]))
        if self.embedding is not None:
            self.embedding = self.embedding.to(device)
        self._embed = table if self.embedding is None else self.embedding

    def _reset(self) -> None:
        self._past = None                       # (keys, values) [1, Hkv, U, hd] of committed units
        self._pending = None                    # [P, d] target features not yet in a unit
        self._next = 0                          # first position without a unit
        self._root_out = None                   # [d] the last committed unit's output
        self._prompt_embeds = None              # [T, d] what the target consumed for the prompt
        self._pause, self._backoff = 0, 0       # in a batch: steps left without drafting, the next pause (``cut``)

    def begin(self, start: SequenceStart) -> None:
        if self._embed is None:
            raise RuntimeError("EagleDrafter.begin before bind(target)")
        if start.hidden_states is None:
            raise RuntimeError("EagleDrafter needs the target's features (needs_hidden_states)")
        if start.input_ids.shape[0] != 1:
            raise NotImplementedError("EagleDrafter drafts one sequence at a time (the batched engine forks it)")
        self._reset()
        self._pending = start.hidden_states[0]
        self._prompt_embeds = None if start.input_embeds is None else start.input_embeds[0]

    def observe(self, step: StepResult) -> None:
        if step.hidden_states is None:
            raise RuntimeError("EagleDrafter needs the target's features at the accepted nodes")
        self._pending = torch.cat([self._pending, step.hidden_states[0]], dim=0)
        if step.accepted_len:
            self._backoff = 0
        if self._predicted:
            self.evidence = [0.95 * self.evidence[0] + step.accepted_len, 0.95 * self.evidence[1] + self._predicted]
        else:
            self.evidence = [0.995 * e for e in self.evidence]
        self._predicted = 0.0

    def cut(self, draft: Draft, nodes: int) -> Draft:
        """A batch's cut (flashmm.engine.pricing). Cut to its root, the head's passes pause for 1, 2, 4, .. 32 steps
        (its row's features wait and join in one pass), until a draft of its is accepted: at batch 8 on a CPU the
        batch's pricing keeps few of its nodes, and each row's EAGLE-2 tree costs passes of its own."""
        self._predicted = sum(self._values[: nodes - 1]) / self._calibration
        if nodes <= 1:
            self._backoff = next_pause(self._backoff, paid=False)
            self._pause = self._backoff
        return draft.head(nodes)

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("EagleDrafter drafts one sequence at a time")
        if self._pause > 0:  # (paused by a batch's cut: nothing drafted, the features wait)
            self._pause -= 1
            return root_only(committed)
        with self._linears:
            self._sync(committed)
            if self.max_draft_tokens is not None:
                max_tokens = min(max_tokens, self.max_draft_tokens)
            if max_tokens <= 0:
                return root_only(committed)
            grown = self.grow(committed, max_tokens)
        keep = self._best_paying(grown) if self.adaptive else list(range(len(grown.rows)))
        if not keep:
            return root_only(committed)
        node_of = {-1: 0, **{kept: j + 1 for j, kept in enumerate(keep)}}
        tokens = torch.tensor([[grown.rows[i] for i in keep]], dtype=committed.dtype, device=committed.device)
        parents = [-1] + [node_of[grown.parents[i] - 1] for i in keep]     # grown.parents: 0 = root, j = row j - 1
        draft = Draft(tokens=torch.cat([committed[:, -1:], tokens], dim=1), tree=TokenTree.from_parents(parents),
                      q_probs=None)
        if self.adaptive:
            draft.values = torch.tensor([1.0] + self._values)
        return draft

    def _best_paying(self, grown: GrownTree) -> list[int]:
        """Adaptive drafting: the grown nodes worth verifying (indices into grown.rows, best first, each after
        its parent): the prefix of the nodes ranked by calibrated path probability with the most tokens per
        unit of verify time (a child never outranks its parent: its path probability is at most its parent's,
        and ties keep the parent, grown first)."""
        self._calibration = (self.evidence[0] + 2.0) / (self.evidence[1] + 2.0)
        values = [min(1.0, self._calibration * math.exp(score)) for score in grown.scores]
        order = sorted(range(len(values)), key=lambda i: (-values[i], i))
        keep = order[: best_paying_prefix([values[i] for i in order], self.length.cost)]
        self._values = [values[i] for i in keep]
        self._predicted = sum(self._values) / self._calibration
        return keep

    # ------------------------------------------------------------------ the head
    def head_pass(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                  past=None):
        """One pass of the head over units (EagleNet.forward's arguments and result); a drafter whose head
        reads more than the units (ViSpec's global visual feature) passes it here."""
        return self.net(embeds, features, positions, mask, past)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The target's LM head on head outputs ``out`` [.., d] → float32 logits [.., V] (with a draft_vocab,
        -inf outside it: the head drafts from those tokens only; the target still verifies every token)."""
        scores = self._lm_head(out.to(self._lm_head.weight.dtype)).float()
        if self.draft_vocab is None:
            return scores[..., : self._vocab]
        full = scores.new_full((*scores.shape[:-1], self._vocab), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab.to(scores.device), scores)

    def _sync(self, committed: torch.Tensor) -> None:
        """Add units next .. root-1 to the committed cache; keep the last one's output."""
        out, self._past, self._pending = feed_committed(self.head_pass, self._embed, self._prompt_embeds, committed,
                                                        self._next, self._pending, self._past, "EagleDrafter")
        self._next = committed.shape[1] - 1
        self._root_out = out[0, -1]

    def grow(self, committed: torch.Tensor, max_tokens: int) -> GrownTree:
        """The draft tree after the synced root (chain: top_k = 1, depth = min(depth, max_tokens)); rows are
        target token ids."""
        root_logp = self.logits(self._root_out).log_softmax(-1)
        units = TreeUnits()
        root_pos = committed.shape[1] - 1                  # the root unit's position is root_pos - 1

        def expand(chosen, nodes):
            feats = torch.stack([self._root_out if nodes[i].parent < 0 else units.outputs[nodes[i].parent]
                                 for i in chosen])[None]                                      # [1, m, d]
            ids = torch.tensor([nodes[i].row for i in chosen], device=committed.device)
            embeds = self._embed(ids)[None]                                                   # [1, m, d]
            positions = torch.tensor([root_pos - 1 + nodes[i].depth for i in chosen], device=feats.device)[None]
            past_len = self._past[0].shape[2]
            mask = units.mask(chosen, nodes, past_len, feats.device)
            past = self._past if units.count == 0 else (torch.cat([self._past[0], units.keys], 2),
                                                         torch.cat([self._past[1], units.values], 2))
            out, (keys, values) = self.head_pass(embeds, feats, positions, mask, past)
            units.add(chosen, keys[:, :, -len(chosen):], values[:, :, -len(chosen):], out[0])
            return self.logits(out[0]).log_softmax(-1)

        if self.tree == "chain":
            return grow(root_logp, expand, top_k=1, depth=min(self.depth, max_tokens), max_tokens=max_tokens)
        if self.tree == "static":
            return grow_static(root_logp, expand, self.paths[:max_tokens])
        return grow(root_logp, expand, top_k=self.top_k, depth=self.depth, max_tokens=max_tokens)


# ------------------------------------------------------------------------------------------ the folder
def weight_names(folder: Path) -> set[str] | None:
    """The tensor names of the folder's weights, read without loading them (safetensors' header, or a
    memory-mapped ``weights_only`` load of pytorch_model.bin); None when there are none or they cannot be
    read that way (the loader then names the file and why)."""
    if (folder / "model.safetensors").is_file():
        from safetensors import SafetensorError, safe_open  # noqa: PLC0415

        try:
            with safe_open(os.fspath(folder / "model.safetensors"), framework="pt") as handle:
                return set(handle.keys())
        except (SafetensorError, OSError):
            return None
    if (folder / "pytorch_model.bin").is_file():
        try:
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, OSError, EOFError):
            return None  # code in it, corrupt, or an old non-zip file mmap cannot map (RuntimeError): the loader names it
        return set(state) if isinstance(state, dict) else None
    return None


def is_eagle_folder(folder, config: dict) -> bool:
    """Whether ``folder`` (its config.json parsed as ``config``) holds an EAGLE-1/2 head: a one-layer config
    without EAGLE-3's ``draft_vocab_size``, beside weights named ``fc.weight`` and ``layers.0.*`` (a plain
    one-layer causal LM's are ``model.*``); weights that cannot be listed are judged by the config alone."""
    folder = Path(folder)
    if "draft_vocab_size" in config or config.get("num_hidden_layers") != 1:
        return False
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        return False
    names = weight_names(folder)
    if names is None:
        return True
    return "fc.weight" in names and any(n.startswith("layers.0.") for n in names)


def _refuse(config_path: Path, what: str, value, why: str, head: str):
    return UnsupportedDrafterFormat(f"{config_path}: {what} is {value!r}; flashmm's {head} cannot run it ({why})")


def eagle_config(config_path: Path, config: dict, head: str = "EAGLE-1/2 head") -> EagleConfig:
    """The EagleConfig of an EAGLE-1/2 config.json, read as EConfig / cnets1 read it; refuses what flashmm's
    head cannot run exactly (``head`` names it in the refusal: ViSpec's config is read here too)."""
    checks = (
        ("num_hidden_layers", config.get("num_hidden_layers"), 1, "one decoder layer"),
        ("hidden_act", config.get("hidden_act", "silu"), "silu", "SwiGLU"),
    )
    for what, value, want, why in checks:
        if value != want:
            raise _refuse(config_path, what, value, why, head)
    rope = config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise _refuse(config_path, "rope_scaling", rope, "unscaled rotary positions", head)
    heads = config.get("num_attention_heads")
    with blamed_on(config_path, "the head's sizes", errors=(KeyError, TypeError, ValueError)):
        return EagleConfig(
            hidden_size=int(config["hidden_size"]), num_attention_heads=int(heads),
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(config.get("rope_theta", 10000.0)),
            fc_bias=bool(config.get("bias", True)), qkv_bias=bool(config.get("qkv_bias", False)))


def read_head_weights(folder: Path, vocab_size: int, hidden_size: int) -> tuple[str, dict, torch.Tensor | None]:
    """An EAGLE-style head folder's weights: (the weight file, for messages; its fp32 tensors but embed_tokens;
    its own embed_tokens [V, d] or None). DrafterFileError naming the file for a pickle that is not plain tensors
    or an embed_tokens of another shape than (vocab_size, hidden_size)."""
    where = next((str(folder / n) for n in WEIGHT_FILES if (folder / n).is_file()), str(folder))
    state = {k: v.float() for k, v in read_weights(folder).items() if not k.endswith(_IGNORED)}
    embedding = state.pop("embed_tokens.weight", None)
    if embedding is not None and tuple(embedding.shape) != (vocab_size, hidden_size):
        raise DrafterFileError(where, f"embed_tokens.weight is {tuple(embedding.shape)}, the config says "
                                      f"({vocab_size}, {hidden_size})")
    return where, state, embedding


def load_eagle_checkpoint(path, draft_vocab: torch.Tensor | None = None, **options) -> EagleDrafter:
    """An EagleDrafter from the EAGLE repository's EAGLE-1/2 folder ``path``; ``options`` go to EagleDrafter.
    UnsupportedDrafterFormat for a variant flashmm cannot run, DrafterFileError naming the file for a
    malformed one (a pickle that is not plain tensors among them)."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    config = read_json(config_path)
    cfg = eagle_config(config_path, config)
    where, state, embedding = read_head_weights(folder, cfg.vocab_size, cfg.hidden_size)
    net = EagleNet(cfg)
    load_weights(net, state, where)
    name = config.get("base_model_name_or_path") or config.get("_name_or_path") or None
    vocab_path = folder / DRAFT_VOCAB_FILE
    if draft_vocab is None and vocab_path.is_file():  # a head flashmm trained: the tokens it drafts from
        draft_vocab = read_safetensors(vocab_path).get("ids")
        if draft_vocab is None or draft_vocab.dim() != 1 or draft_vocab.is_floating_point():
            raise DrafterFileError(vocab_path, "needs one 1-D integer tensor 'ids' (the token ids drafted from)")
    with blamed_on(config_path, "the drafting options", options):
        return EagleDrafter(net, embedding=embedding, folder=folder, verifier=name, draft_vocab=draft_vocab, **options)


__all__ = ["EAGLE_COMMIT", "LAYOUT", "EagleDrafter", "EagleOptions", "eagle_config", "is_eagle_folder",
           "load_eagle_checkpoint", "read_head_weights", "weight_names"]
