"""speculators' MTP drafter: one MTP layer run at every draft step, as vLLM's speculators package trains it.

    flashmm.drafters.load("path/to/mtp")        # or flashmm.wrap(model, "path/to/mtp")

A speculators ``mtp`` folder (config.json with ``speculators_model_type: "mtp"``, model.safetensors holding
``mtp_layers.0.*``) is one MTP module (flashmm.drafters.native_mtp.MTPModule) whose block is a Qwen3 decoder
layer (q_norm / k_norm in its attention) of ``transformer_layer_config``; its token embeddings and LM head
are the target's (speculators saves neither and loads the verifier's), over the whole vocabulary (speculators
refuses a draft vocabulary for MTP). With M(h, e) = final_layernorm(Layer(input_proj([token_layernorm(e) ;
hidden_layernorm(h)]))), its training forward (speculators 0.9.0 models/mtp/core.py ``MTPDraftModel.forward``)
runs, for steps s = 0, 1, ... over anchors i = 0 .. T-1 of target tokens x and states h::

    g^0_i = M(h_i, E(x_{i+1}))         at position i, causal over step 0's anchors <= i
    g^s_i = M(g^{s-1}_i, E(x_{i+s+1})) at position i, causal over step s's own anchors <= i
    logits^s_i = lm_head(g^s_i)        predicting x_{i+s+2}

so each step is a fresh causal pass of the one layer at the anchors' own positions (not shifted by s), fed
the previous step's final_layernorm output, which also goes straight to the LM head.

Drafting at root R (x_0 .. x_R committed, the target's states h_0 .. h_{R-1} known) computes exactly that
forward at anchor R-1 with the drafted tokens in place of the unknown ones: step s drafts d_{s+1} (its
argmax at anchor R-1) and reads x_{R+k} = d_k. Step s keeps its own KV cache of the anchors whose inputs are
all committed (j <= R-s-1); the s anchors after them read drafted tokens and are recomputed at every step,
so a round runs each step over the newly committed anchors plus s. Drafts are deterministic (q = None):
verification keeps greedy output equal to the target's and sampled output distributed as the target's.

vLLM serves these folders as its native MTP models (configs/speculators/algos.py ``update_mtp``), chaining
steps at positions R, R+1, ... over one cache; that is a different drafter beyond the first step, which the
training forward above does not compute, so flashmm follows speculators' forward.

h is the target's final-normed last hidden state (HF's ``output_hidden_states[-1]``), as vLLM hands its MTP
models and flashmm's native MTP reads it. speculators' training data records the verifier's "last layer"
through vLLM's hidden-state capture at layer id n, which is taken before the final norm; flashmm's targets
return no pre-norm state, so a module fine-tuned on such data drafts from the normed one here (the output is
exact either way; only acceptance could differ).

Read, not copied: speculators 0.9.0 models/mtp/core.py, model_definitions.py (MTPLayerMixin: the norms, the
embedding-first concatenation, final_layernorm), config.py (num_nextn_predict_layers must be 1), model.py
(DraftVocabMixin: embed_tokens / lm_head from the verifier); convert/mtp/converter.py (the key names).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import SamplingParams
from ..targets import cache as kv
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .base import Drafter, SequenceStart, StepResult, register, root_only
from .files import CONFIG_ERRORS, DrafterFileError, blamed_on, read_json
from .head_base import committed_embeds
from .native_mtp import Layout, MTPModule, causal_bias
from .options import DrafterOptions, check_at_least
from .published import CONFIG_FILE, SPECULATORS_VERSION, UnsupportedDrafterFormat, read_weights

#: speculators' MTP keys (models/mtp/model_definitions.py; the decoder layer's own keys beside the parts)
LAYOUT = Layout("mtp_layers.0.", "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm", None,
                "num_nextn_predict_layers")
#: what speculators saves beside the layer only in older folders, never used: it loads the verifier's
_VERIFIER_COPIES = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight")
_NEEDED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
           "rms_norm_eps")


@dataclass(frozen=True)
class SpeculatorsMTPOptions(DrafterOptions):
    """SpeculatorsMTP's options (see the class)."""

    max_draft_tokens: int = 3

    def __post_init__(self):
        check_at_least(self, 1, "max_draft_tokens")


def layer_config(config_path: Path, config: dict):
    """The Qwen3Config of a speculators ``mtp`` config.json's ``transformer_layer_config``, refusing what this
    drafter does not run exactly (another layer type, several MTP layers, a draft vocabulary, sliding
    windows, scaled RoPE)."""
    from transformers import Qwen3Config  # noqa: PLC0415 (transformers' model code only when one is read)

    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DrafterFileError(config_path, "has no 'transformer_layer_config' object")
    missing = [key for key in _NEEDED if key not in layer]
    if missing:
        raise DrafterFileError(config_path, f"transformer_layer_config needs {missing}")
    refusals = []
    if layer.get("model_type") != "qwen3":
        refusals.append(f"transformer_layer_config.model_type is {layer.get('model_type')!r}; flashmm runs "
                        "speculators' Qwen3 MTP layer ('qwen3'), not yet its qwen3_next / qwen3_5 ones")
    if config.get("num_nextn_predict_layers", 1) != 1:
        refusals.append(f"num_nextn_predict_layers is {config['num_nextn_predict_layers']!r}; speculators' MTP "
                        "has one layer")
    if config.get("draft_vocab_size") not in (None, layer["vocab_size"]):
        refusals.append(f"draft_vocab_size is {config['draft_vocab_size']!r}, not the vocabulary "
                        f"{layer['vocab_size']} (speculators' MTP drafts the whole vocabulary)")
    if layer.get("use_sliding_window") or set(layer.get("layer_types") or ["full_attention"]) != {"full_attention"}:
        refusals.append("the layer uses a sliding window; flashmm runs full attention")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        refusals.append(f"the RoPE type is {rope.get('rope_type', rope.get('type'))!r}; flashmm runs unscaled RoPE")
    if refusals:
        raise UnsupportedDrafterFormat(f"{config_path}: " + "; ".join(refusals))
    with blamed_on(config_path, "transformer_layer_config", errors=(KeyError, *CONFIG_ERRORS)):
        cfg = Qwen3Config.from_dict(layer)
    cfg._attn_implementation = "sdpa"  # speculators' choice for this layer; exact in float32 either way
    return cfg


def read_module(folder: Path, cfg) -> MTPModule:
    """The MTP module of the speculators folder ``folder`` (float32), its layer a Qwen3DecoderLayer of ``cfg``."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm  # noqa: PLC0415

    state = {k: v for k, v in read_weights(folder).items() if k not in _VERIFIER_COPIES}
    where = next((folder / n for n in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                                       "model.pt") if (folder / n).is_file()), folder)
    others = sorted(k for k in state if not k.startswith(LAYOUT.prefix))
    if others:
        raise DrafterFileError(where, f"holds tensors outside speculators' one MTP layer ({LAYOUT.prefix}*): "
                                      f"{others[:6]}")
    tensors = {k[len(LAYOUT.prefix):]: v.float() for k, v in state.items()}
    with blamed_on(folder / CONFIG_FILE, "transformer_layer_config", errors=(RuntimeError, *CONFIG_ERRORS)):
        block = Qwen3DecoderLayer(cfg, 0)                       # sizes the config allows but a layer cannot take
    return MTPModule(block, Qwen3RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, cfg.vocab_size, LAYOUT, tensors,
                     where).float()


@register
class SpeculatorsMTP(Drafter):
    """A speculators ``mtp`` drafter (see the module docstring): a chain of ``max_draft_tokens`` tokens, one
    run of the MTP layer per token.

    module: the MTP module (its block a Qwen3 decoder layer); layer_config: its Qwen3Config (the rotary
    embedding's); folder: where it was read from (named by refusals). max_draft_tokens: the chain's depth
    (default from a folder: its ``speculative_tokens``, the steps it was trained for).

    Options: SpeculatorsMTPOptions, as keywords or ``options=``."""

    name = "speculators_mtp"
    needs_hidden_states = True  # the final-normed hidden states (output_hidden_states' last entry)

    def __init__(self, module: MTPModule, layer_config, options: SpeculatorsMTPOptions | None = None, *,
                 folder: str | os.PathLike | None = None, **given):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding  # noqa: PLC0415

        self._options = options = SpeculatorsMTPOptions.build(type(self).__name__, given, options)
        self.module = module.eval().requires_grad_(False)
        self.layer_config = layer_config
        self.rotary = Qwen3RotaryEmbedding(layer_config)
        self.max_draft_tokens = options.max_draft_tokens
        self.folder = None if folder is None else Path(folder)
        self.info = {"method": "mtp", "format": f"speculators {SPECULATORS_VERSION}",
                     "source": None if folder is None else os.fspath(folder)}
        self._embed = self._head = None

    def bind(self, target) -> None:
        cfg = self.layer_config
        wrong = [(what, ours, theirs) for what, ours, theirs in (
            ("hidden size", cfg.hidden_size, target.hidden_size),
            ("vocabulary", cfg.vocab_size, target.vocab_size)) if ours != theirs]
        if wrong:
            raise ValueError(f"{self.folder or 'this drafter'}: this speculators mtp drafter does not fit the target: "
                             + "; ".join(f"{what}: drafter {ours}, target {theirs}" for what, ours, theirs in wrong))
        weight = target.output_embeddings().weight
        self.module.to(device=weight.device, dtype=weight.dtype)
        self.rotary.to(weight.device)
        self._embed, self._head = target.input_embeddings(), target.output_embeddings()

    def begin(self, start: SequenceStart) -> None:
        if self._embed is None:
            raise RuntimeError("SpeculatorsMTP.begin before bind(target)")
        if start.hidden_states is None:
            raise ValueError("speculators_mtp needs the target's hidden states at the prompt")
        self._hidden = start.hidden_states[0]        # h_0 .. h_{T-1} [T, d]
        self._prompt_embeds = None if start.input_embeds is None else start.input_embeds[0]
        self._caches = []                            # per step s: its KV cache of committed anchors
        self._outputs = []                           # per step s: g^s [done_s, d] at its committed anchors

    def observe(self, step: StepResult) -> None:
        self._hidden = torch.cat([self._hidden, step.hidden_states[0].to(self._hidden.dtype)])

    @torch.no_grad()
    def chain(self, committed: torch.Tensor, depth: int,
              continuation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain at root R of committed [1, R+1] (R >= 1): (drafted tokens [depth], each step's logits at
        anchor R-1 [depth, V]). Step s reads x_{R+k} = d_k for k <= s, d_k its own argmax, or
        ``continuation[k-1]`` when given (teacher forcing, as speculators' training forward reads the true
        tokens)."""
        from transformers import DynamicCache  # noqa: PLC0415

        ids, root = committed[0], committed.shape[1] - 1
        if self._hidden.shape[0] < root:
            raise RuntimeError(f"speculators_mtp is out of step with the target: root {root}, "
                               f"{self._hidden.shape[0]} hidden states")
        inputs = self._hidden                        # what step 0 reads at anchor j: h_j
        sequence, logits = ids, []
        for s in range(depth):
            if s == len(self._caches):
                self._caches.append(DynamicCache())
                self._outputs.append(inputs[:0])
            # anchors 0 .. done-1 stay in step s's cache (anchor R-1 always runs: its output drafts)
            done = min(self._outputs[s].shape[0], root - 1)
            self._outputs[s] = self._outputs[s][:done]
            kv.crop(self._caches[s], done)           # the anchors that read drafted tokens last round
            tokens = sequence[done + s + 1: root + s + 1]                      # x_{j+s+1}, j = done .. R-1
            embeds = committed_embeds(self._embed, self._prompt_embeds, tokens, done + s + 1)
            positions = torch.arange(done, root, device=embeds.device)
            g = self.module(embeds[None], inputs[done:root][None], self.rotary(embeds[None], positions[None]),
                            causal_bias(done, root - done, embeds.dtype, embeds.device), self._caches[s])[0]
            inputs = torch.cat([self._outputs[s], g])                          # g^s at anchors 0 .. R-1
            self._outputs[s] = inputs[:max(root - s, done)]                    # committed: j <= R-s-1
            logits.append(self._head(g[-1]))
            token = logits[-1].argmax(-1, keepdim=True) if continuation is None else continuation[s: s + 1]
            sequence = torch.cat([sequence, token.to(sequence.device)])
        return sequence[root + 1:], torch.stack(logits)

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("speculators_mtp drafts one sequence at a time (batches fork it per row)")
        depth = min(self.max_draft_tokens, max_tokens)
        if depth < 1 or committed.shape[1] < 2:
            return root_only(committed)
        drafted, _ = self.chain(committed, depth)
        return Draft(tokens=torch.cat([committed[0, -1:], drafted])[None], tree=TokenTree.chain(depth), q_probs=None)

    @classmethod
    def from_dir(cls, path, **options) -> "SpeculatorsMTP":
        """A speculators ``mtp`` folder (this drafter has no flashmm folder format of its own)."""
        return cls.from_speculators(Path(path), read_json(Path(path) / CONFIG_FILE), **options)

    @classmethod
    def from_speculators(cls, folder, config: dict, **options) -> "SpeculatorsMTP":
        """A speculators ``mtp`` folder as a drafter; ``max_draft_tokens`` defaults to its ``speculative_tokens``."""
        folder = Path(folder)
        config_path = folder / CONFIG_FILE
        cfg = layer_config(config_path, config)
        module = read_module(folder, cfg)
        proposals = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        steps = proposals[0].get("speculative_tokens") if isinstance(proposals[0], dict) else None
        defaults = {"max_draft_tokens": steps} if isinstance(steps, int) and "options" not in options else {}
        with blamed_on(config_path, "the drafting options", options):
            drafter = cls(module, cfg, folder=folder, **{**defaults, **options})
        verifier = (config.get("speculators_config") or {}).get("verifier") or {}
        drafter.info["target"] = verifier.get("name_or_path") if isinstance(verifier, dict) else None
        return drafter


__all__ = ["LAYOUT", "SpeculatorsMTP", "SpeculatorsMTPOptions", "layer_config", "read_module"]
