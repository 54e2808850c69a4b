"""The target's own verification forward for Llama-family decoders on a CPU: one fused step.

A speculative step on a CPU is one target forward of a few tokens, and for a small model that
forward is bound by reading the weights once, not by arithmetic: SmolLM2-135M's linears read
540 MB, 31–37 ms on the 2-core benchmark machine for 1 to 16 tokens. transformers' eager forward
adds some 15–20 ms of Python and small ops around them (the cache's ``torch.cat`` of every layer
each step, mask building, rotary embeddings computed per call, five ops per RMSNorm). This module
runs the same arithmetic as the model's own layers with the overhead taken out:

- q, k and v are one oneDNN matmul (their weights concatenated and packed once), gate and up another;
  o, down and the LM head multiply packed weights (flashmm.targets.onednn); weights whose fp32 values are a
  GGUF's Q4_1 / Q8_0 blocks multiply from their exact codes instead (flashmm.kernels.blocks), and the small
  steps between the matmuls then run compiled there too;
- RMSNorm is ``torch.rms_norm``; rotary embeddings come from the model's own ``rotary_emb`` (every rope
  type it implements) and are applied to q and k in one pass;
- keys and values are written in place into room preallocated behind each cache layer's tensors
  (``append``): the cache stays a transformers ``DynamicCache`` whose layers' ``keys`` / ``values``
  are views of the first rows, so every cache operation flashmm has (keep a path, crop, select rows,
  admit a row) and the model's own forward still work on it;
- attention is ``scaled_dot_product_attention``, a step's grouped query heads folded onto their kv head
  (``attend``, flashmm.targets.fused_attention): one call per layer, or in a batch one per run of rows, from the first key slot one of
  them sees (``row_groups``); a batch's
  linear layers run on each row's real positions alone (``nodes``).

It computes the model's function to fp32 rounding, not bit for bit (as oneDNN's linears already
do, see flashmm.targets.onednn): greedy output is compared with ``generate`` by the tests. Only models
whose layers are exactly this computation are run here (``supports``); everything else keeps the
model's own forward. torch.compile was measured on top of it (eval/results/compile_probe.md) and
was not faster on this CPU than these eager packed matmuls.
"""
from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import blocks as block_kernel
from . import cache as kv
from .graphs import padded_causal
from .fused_attention import FOLD_MAX, attend, query_runs, row_groups
from .fused_room import append, reserve, room_of
from .head_screen import ArgmaxHead
from .onednn import PACK_LIMIT_BYTES, PACK_ROWS, OneDNNLinears, bf16_kernels, can_pack, onednn_available, packed_weight

#: causal LMs whose decoder layers are RMSNorm → attention (rotary, grouped heads, optional q/k/v bias
#: and per-head q/k RMSNorm) → RMSNorm → SiLU-gated MLP, with nothing else in between
FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
#: vision-language models whose text forwards are such a decoder's (their language_model) and their LM head:
#: the forwards after the prompt's (no media) run fused, the prompt's the model's own
VLM_FAMILIES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                "LlavaOnevisionForConditionalGeneration")
DECODERS = tuple(name.replace("ForCausalLM", "Model") for name in FAMILIES)


def parts(model: torch.nn.Module) -> tuple | None:
    """(decoder, LM head, text config) of a model the step can run, else None."""
    name = type(model).__name__
    if name in FAMILIES:
        return model.model, model.lm_head, model.config
    if name in VLM_FAMILIES and type(getattr(model.model, "language_model", None)).__name__ in DECODERS:
        return model.model.language_model, model.lm_head, model.config.get_text_config()
    return None
_STEPS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def supports(model: torch.nn.Module, layout) -> str | None:
    """None when ``model`` runs on FusedDecoder, else why not (a phrase)."""
    found = parts(model)
    if found is None:
        return f"{type(model).__name__} is not one of {', '.join(FAMILIES + VLM_FAMILIES)} (with one of their decoders)"
    decoder, head_layer, config = found
    for module in (*decoder.modules(), head_layer):
        if "forward" in module.__dict__ or _foreign_hooks(module):
            return f"its {type(module).__name__} has a replaced or hooked forward, which the fused step would skip"
    for layer in decoder.layers:
        linears = (*(getattr(layer.self_attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
                   *(getattr(layer.mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")), head_layer)
        if any(type(linear) is not torch.nn.Linear for linear in linears):
            return "its projections are not plain nn.Linear layers (quantized or adapted)"
    head = model.get_output_embeddings().weight
    if head.device.type != "cpu" or head.dtype != torch.float32:
        return "the fused step runs fp32 models on a CPU"
    if not (onednn_available() and can_pack()):
        return "torch has no oneDNN linear"
    if layout.restricted:
        return "it has sliding-window or chunked-attention layers"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return "its MLP is not the plain SiLU-gated one"
    if getattr(config, "mlp_bias", False) or getattr(head_layer, "bias", None) is not None:
        return "its MLP or head has biases"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"it was loaded with attn_implementation={config._attn_implementation!r}"
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if size > PACK_LIMIT_BYTES:
        return f"its weights ({size >> 20} MiB) exceed the packing limit"
    return None


def _foreign_hooks(module: torch.nn.Module) -> list:
    """``module``'s forward hooks other than transformers' own output recorders (installed for good the first
    time hidden states are asked for; they only copy outputs)."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return [hook for hook in hooks if not getattr(hook, "__module__", "").startswith("transformers.")]


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def _linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] → [M, out]: ``weight`` a oneDNN-packed tensor, or a Weight (its block codes for up to
    ``block_kernel.max_rows`` rows, its packed tensor for more)."""
    if isinstance(weight, Weight):
        if weight.blocks is not None and x.shape[0] <= block_kernel.max_rows(weight.blocks):
            return block_kernel.linear(x, weight.blocks, bias)
        weight = weight.packed
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@dataclass(frozen=True)
class Weight:
    """A weight of the fused step: packed for oneDNN, and its exact block codes when the fp32 values are a
    dequantised 4-bit or 8-bit block quantisation (flashmm.kernels.blocks)."""
    packed: torch.Tensor
    blocks: "block_kernel.BlockWeight | None"


def _weight(weight: torch.Tensor, packed: torch.Tensor | None, blocks: bool) -> "Weight | torch.Tensor":
    """The fused step's form of ``weight`` [out, in] (``packed``: its oneDNN packing when already made): a
    Weight with its block codes when ``blocks`` and the values are blocks, else the packed tensor."""
    packed = _pack(weight) if packed is None else packed
    codes = block_kernel.encode(weight) if blocks else None
    return packed if codes is None else Weight(packed, codes)


def _torch_add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    x = x + delta
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


def _torch_silu_mul(gated: torch.Tensor) -> torch.Tensor:
    return F.silu(gated[:, : gated.shape[1] // 2]) * gated[:, gated.shape[1] // 2:]


#: (RMSNorm, residual add + RMSNorm, SiLU gate) between the matmuls of a step, by whether the step multiplies
#: block codes: then its compiled kernel is loaded and these run there, one pass each instead of torch's
#: several small ops (flashmm.kernels.blocks)
_SMALL_STEPS = {False: (lambda x, weight, eps: F.rms_norm(x, (x.shape[-1],), weight, eps), _torch_add_norm, _torch_silu_mul),
                True: (block_kernel.rms_norm, block_kernel.add_rms_norm, block_kernel.silu_mul)}


def _unpacked(packed: torch.Tensor, real: torch.Tensor | None, rows: int) -> torch.Tensor:
    """packed [N, k], the values at positions ``real`` of ``rows`` → [rows, k], zeros elsewhere (as given
    when nothing was packed)."""
    if real is None:
        return packed
    return packed.new_zeros(rows, packed.shape[1]).index_copy_(0, real, packed)


class FusedDecoder:
    """A Llama-family causal LM's forward (``supports``) on packed, fused weights: called like the model
    with a DynamicCache, it returns (logits, hidden states) as the model's forward would."""

    def __init__(self, model: torch.nn.Module, blocks: bool = True):
        decoder, head, config = parts(model)
        self.rotary = decoder.rotary_emb
        self.embed = decoder.embed_tokens
        self.final_norm = (decoder.norm.weight, decoder.norm.variance_epsilon)
        first = decoder.layers[0].self_attn
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        encode = blocks and block_kernel.unavailable() is None
        self.layers = [self._layer(layer, encode) for layer in decoder.layers[: config.num_hidden_layers]]
        self.head = _weight(head.weight, packed_weight(head), encode)  # packed: shared with OneDNNLinears' routing
        #: whether some weights multiply from their block codes (dequantised 4-bit or 8-bit blocks, the
        #: ``blocks`` argument and a CPU the kernel runs on: flashmm.kernels.blocks)
        self.blocks = any(isinstance(weight, Weight) for layer in self.layers for weight in (*layer, self.head))
        self.head_rows = head.weight.shape[0]
        #: the screened LM head (flashmm.targets.head_screen); None where oneDNN has no bf16 kernels
        self.argmax_head = ArgmaxHead(head.weight) if bf16_kernels() else None
        #: the layers as one compiled call (blocks_cpu.cpp's LayerStack) when every layer multiplies from block codes
        #: and has no q / k norms; None otherwise. ``stack_rows``: the most rows it takes (its weights' kernel limit)
        self.stack, self.stack_rows = self._stack()

    def _stack(self):
        """(LayerStack, the most rows its weights multiply from their codes) or (None, 0): the layer loop's fast path,
        the same kernels and attention call in the same order (the same sums bit for bit), one call a step instead of
        ~20 Python-level calls a layer."""
        weights, eps = [], []
        empty = torch.empty(0)
        for index, (_, _, qkv_w, qkv_b, qk_norm, o_w, o_b, norm2, eps2, gate_up, down) in enumerate(self.layers):
            matrices = (qkv_w, o_w, gate_up, down)
            if qk_norm is not None or not all(isinstance(w, Weight) and w.blocks is not None for w in matrices):
                return None, 0
            following = self.layers[index + 1][:2] if index + 1 < len(self.layers) else self.final_norm
            codes = [(w.blocks.codes, w.blocks.scale, w.blocks.low if w.blocks.low is not None else empty)
                     for w in matrices]
            weights += [*codes[0], empty if qkv_b is None else qkv_b.contiguous(), *codes[1],
                        empty if o_b is None else o_b.detach().contiguous(), norm2.detach(), *codes[2], *codes[3],
                        following[0].detach()]
            eps += [eps2, following[1]]
        if not self.layers:
            return None, 0
        rows = min(block_kernel.max_rows(layer[i].blocks) for layer in self.layers for i in (2, 5, 9, 10))
        stack = block_kernel.build().LayerStack(weights, eps, self.heads, self.kv_heads, self.scaling, FOLD_MAX)
        return stack, rows

    def _head_blocks(self, rows: int) -> bool:
        """Whether the LM head multiplies ``rows`` rows from its block codes (exact, and cheaper than the screened
        bf16 head there)."""
        return isinstance(self.head, Weight) and rows <= block_kernel.max_rows(self.head.blocks)

    @staticmethod
    def _layer(layer, blocks: bool) -> tuple:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv_bias = None
        if any(p.bias is not None for p in projections):
            qkv_bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                                  for p in projections]).detach()
        qk_norm = (attn.q_norm.weight, attn.q_norm.variance_epsilon, attn.k_norm.weight, attn.k_norm.variance_epsilon) \
            if hasattr(attn, "q_norm") else None
        return (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                _weight(torch.cat([p.weight for p in projections]), None, blocks), qkv_bias, qk_norm,
                _weight(attn.o_proj.weight, packed_weight(attn.o_proj), blocks), attn.o_proj.bias,
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                _weight(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None, blocks),
                _weight(mlp.down_proj.weight, packed_weight(mlp.down_proj), blocks))

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor, cache, attention_mask=None,
                 want_hidden=None, logits_to_keep: int = 0, nodes: list[int] | None = None,
                 argmax_only: bool = False, inputs_embeds: torch.Tensor | None = None,
                 head: bool = True) -> tuple[torch.Tensor, tuple | None]:
        """input_ids / position_ids [B, n] after the cache's rows; attention_mask: None (causal over the new
        rows, every cached row visible), [B, S + n] (1 = a real token, as ``generate`` passes it) or an
        additive [B or 1, 1, n, S + n] → (logits [B, n or logits_to_keep, V], the hidden states the
        model's ``output_hidden_states`` gives (embeddings, then each layer's output, the last normed), or
        None when ``want_hidden`` is falsy).

        nodes: how many of each row's n positions are real (a batch of drafts padded to the widest): the
        linear layers and the LM head run on those alone, packed; the padding positions still get keys and
        values and attend (cheap), and their logits and hidden states are zeros.
        argmax_only: only each position's argmax will be read: the LM head is the screened one where oneDNN
        has bf16 kernels (flashmm.targets.head_screen), whose logits have the fp32 head's argmax and are
        approximations elsewhere.
        inputs_embeds: [B, n, d] the decoder's inputs instead of input_ids' embeddings (a VLM's prompt, its
        visual features merged: ``FusedForward.language_model``). head: False returns the last normed hidden
        state [B, n, d] in place of the logits (what the decoder module returns; its VLM applies the head)."""
        batch, n = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
        real = None
        if nodes is not None and sum(nodes) < batch * n and not logits_to_keep:
            real = torch.tensor([b * n + i for b, count in enumerate(nodes) for i in range(count)],
                                device=position_ids.device)
        cached = cache.get_seq_length()
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        hidden = [x] if want_hidden else None
        cos, sin = self.rotary(x, position_ids)
        cos, sin = cos[:, :, None], sin[:, :, None]                        # [B, n, 1, D]
        mask, causal = self._mask(attention_mask, n, cached, x.dtype, x.device)
        groups = row_groups(mask) if mask is not None and mask.dim() == 4 and mask.shape[0] == batch > 1 else None
        if real is not None and groups is None and mask is not None and mask.dim() == 4 and mask.shape[0] == batch:
            groups = [(0, batch, 0)]
        if groups is not None:  # with nodes, a run of rows attends with as many queries as its widest has nodes
            groups = query_runs(groups, nodes, mask.shape[-1]) if real is not None else [(*group, n) for group in groups]
        width = x.shape[-1]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        half = dim // 2
        x = x.reshape(batch * n, width)
        if real is not None:
            x = x[real]                                                    # [N, width]: the real positions
        norm, add_norm, silu_mul = _SMALL_STEPS[self.blocks]
        normed = norm(x, *self.layers[0][:2]) if self.layers else None
        stacked = self.stack is not None and real is None and groups is None and batch * n <= self.stack_rows
        if stacked:
            like = x.new_empty(1, 1, 1, 1).expand(batch, kv_heads, n, dim)
            rooms, length = [], None
            for index in range(len(self.layers)):
                room, length = room_of(cache, index, like)
                rooms += room
            out = self.stack.run(x.contiguous(), normed, rooms, length, cos.reshape(batch, n, dim),
                                 sin.reshape(batch, n, dim), mask, causal, hidden is not None)
            x, normed = out[0], out[1]
            # each layer's tensors: its room's first rows, as views run returns (each ~3 us to make here)
            for index, layer in enumerate(cache.layers[: len(self.layers)]):
                layer.keys, layer.values, layer.is_initialized = out[2 + 2 * index], out[3 + 2 * index], True
            if hidden is not None:
                hidden += [layer_x.view(batch, n, width) for layer_x in out[2 + 2 * len(self.layers):]]
        layers = () if stacked else self.layers
        for index, (_, _, qkv_w, qkv_b, qk_norm, o_w, o_b, norm2, eps2, gate_up, down) in enumerate(layers):
            qkv = _unpacked(_linear(normed, qkv_w, qkv_b), real, batch * n)
            if self.blocks and qk_norm is None:  # rotary embeddings and the cache write in one compiled pass
                room, length = reserve(cache, index, qkv.new_empty(1, 1, 1, 1).expand(batch, kv_heads, n, dim))
                q = block_kernel.rope_append(qkv, cos, sin, heads, kv_heads, room, length)
                keys, values = cache.layers[index].keys, cache.layers[index].values
            else:
                qkv = qkv.view(batch, n, heads + 2 * kv_heads, dim)
                qk, v = qkv[:, :, : heads + kv_heads], qkv[:, :, heads + kv_heads:]
                if qk_norm is not None:
                    qk = torch.cat([F.rms_norm(qk[:, :, :heads], (dim,), qk_norm[0], qk_norm[1]),
                                    F.rms_norm(qk[:, :, heads:], (dim,), qk_norm[2], qk_norm[3])], dim=2)
                qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
                q = qk[:, :, :heads].transpose(1, 2)
                keys, values = append(cache, index, qk[:, :, heads:].transpose(1, 2), v.transpose(1, 2))
            if groups is None:
                attended = attend(q, keys, values, mask, causal, self.scaling)
            else:  # each run of rows attends from the first key slot one of its rows sees, with its queries
                attended = q.new_zeros(batch, heads, n, dim) if real is not None else q.new_empty(batch, heads, n, dim)
                for start, end, first, queries in groups:
                    attended[start:end, :, :queries] = attend(
                        q[start:end, :, :queries], keys[start:end, :, first:], values[start:end, :, first:],
                        mask[start:end, :, :queries, first:], False, self.scaling)
            attended = attended.transpose(1, 2).reshape(batch * n, heads * dim)
            x, normed = add_norm(x, _linear(attended if real is None else attended[real], o_w, o_b), norm2, eps2)
            following = self.layers[index + 1][:2] if index + 1 < len(self.layers) else self.final_norm
            x, normed = add_norm(x, _linear(silu_mul(_linear(normed, gate_up)), down), *following)
            if hidden is not None:
                hidden.append(_unpacked(x, real, batch * n).view(batch, n, width))
        x = normed if self.layers else F.rms_norm(x, (width,), *self.final_norm)
        if hidden is not None:
            hidden[-1] = _unpacked(x, real, batch * n).view(batch, n, width)
        if not head:
            return _unpacked(x, real, batch * n).view(batch, n, width), (tuple(hidden) if hidden is not None else None)
        if logits_to_keep:
            x = x.view(batch, n, width)[:, -logits_to_keep:].reshape(-1, width)
        screened = self.argmax_head if argmax_only and not self._head_blocks(x.shape[0]) else None
        product = screened(x) if screened is not None else _linear(x, self.head)
        logits = _unpacked(product, real, batch * n).view(batch, -1, self.head_rows)
        return logits, (tuple(hidden) if hidden is not None else None)

    @staticmethod
    def _mask(attention_mask, n: int, cached: int, dtype, device) -> tuple[torch.Tensor | None, bool]:
        """(the additive mask SDPA takes or None, is_causal) for ``__call__``'s attention_mask."""
        if attention_mask is not None and attention_mask.dim() == 4:
            return attention_mask.to(dtype), False
        if attention_mask is None or bool(attention_mask.all()):
            if n == 1:
                return None, False
            if cached == 0:
                return None, True
            allowed = torch.ones(n, cached + n, dtype=torch.bool, device=device).tril(cached)
        else:
            if attention_mask.shape[1] != cached + n:
                raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions, the cache and the "
                                 f"new tokens {cached} + {n}")
            allowed = padded_causal(attention_mask, n)[:, None]
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min), False


def _weights_key(params: list[torch.Tensor]) -> tuple:
    return tuple((p.data_ptr(), p._version) for p in params)


def fused_step(model: torch.nn.Module, blocks: bool = True) -> "FusedDecoder":
    """``model``'s FusedDecoder (``blocks``: FusedDecoder's), built once (its weights packed) and kept while the
    model lives, until one of its weights is changed in place or given new storage (load_state_dict, an
    optimizer step, ``.to``; checked every call on the parameters it was built from). The caller has checked
    ``supports``."""
    hit = _STEPS.get(model, {}).get(blocks)
    if hit is None or hit[0] != _weights_key(hit[1]):
        params = list(model.parameters())
        hit = (_weights_key(params), params, FusedDecoder(model, blocks))
        _STEPS.setdefault(model, {})[blocks] = hit
    return hit[2]


class FusedForward:
    """Context manager: while entered, ``model``'s own forward (what ``generate`` calls) is its fused step.
    The plain baseline of the benchmarks that separates speculation from the faster step
    (``plain_onednn``) decodes through it, so that baseline and flashmm multiply the same way.
    Calls with other inputs (a prompt's media, embeddings), under autograd or without a cache run the
    model's own forward (its linears on oneDNN, which itself leaves autograd to ``F.linear``).
    ``argmax_only``: every call's logits are read by their argmax alone (a greedy ``generate`` without logits
    processors, nor scores or logits returned): the step screens its LM head as flashmm's greedy verification
    does (FusedDecoder), so the plain baseline runs the very step flashmm runs. ``blocks``: FusedDecoder's (layer
    weights that are dequantised 4-bit blocks multiply from their codes, as flashmm's verification does)."""

    def __init__(self, model: torch.nn.Module, argmax_only: bool = False, blocks: bool = True):
        self.model = model
        self.step = fused_step(model, blocks)
        self.argmax_only = argmax_only
        self._signature = None          # the model's forward's, read at the first __enter__ (~85 us each time)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                use_cache=True, logits_to_keep=0, output_hidden_states=False, nodes=None, argmax_only=False, **kwargs):
        """The model's forward signature, computed by the fused step (``nodes``, ``argmax_only``: FusedDecoder's,
        flashmm's verification passes them)."""
        from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: PLC0415

        unused = {k: v for k, v in kwargs.items() if v is not None and k not in ("return_dict", "cache_position")}
        cache = cache if cache is not None else past_key_values
        if input_ids is None or unused or torch.is_grad_enabled() or not use_cache or cache is None:
            # a prompt with its media, embeddings given, autograd or no cache: the model's own forward (a VLM's
            # language model on the fused step, ``language_model``)
            with OneDNNLinears(self.model), self.language_model():
                return type(self.model).forward(self.model, input_ids=input_ids, attention_mask=attention_mask,
                                                position_ids=position_ids, use_cache=use_cache, logits_to_keep=logits_to_keep,
                                                output_hidden_states=output_hidden_states,
                                                **{kv.cache_argument(self.model): cache}, **kwargs)
        if position_ids is None:
            start = cache.get_seq_length()
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids[None].expand(input_ids.shape[0], -1)
        logits, hidden = self.step(input_ids, position_ids, cache, attention_mask, output_hidden_states,
                                   logits_to_keep if isinstance(logits_to_keep, int) else 0, nodes,
                                   argmax_only or self.argmax_only)
        named = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"  # < 5.24
        return CausalLMOutputWithPast(logits=logits, hidden_states=hidden, **{named: cache})

    @contextmanager
    def language_model(self):
        """While entered, the model's decoder (a VLM's language model) runs on the fused step when the model's
        own forward calls it with embeddings (a prompt whose media the model merged in: its vision tower,
        projector and LM head stay its own) over a cache, positions that count real tokens and without
        autograd; any other call runs the decoder's own forward."""
        decoder = parts(self.model)[0]
        own = decoder.forward

        def forward(input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, use_cache=None,
                    output_hidden_states=None, **kwargs):
            from transformers.modeling_outputs import BaseModelOutputWithPast  # noqa: PLC0415

            cache = kwargs.pop("cache", None)
            cache = kwargs.pop("past_key_values", None) if cache is None else cache
            kwargs.pop("cache_position", None)
            kwargs.pop("return_dict", None)
            plain = inputs_embeds is not None and cache is not None and use_cache is not False and \
                not torch.is_grad_enabled() and not any(v is not None for v in kwargs.values()) and \
                (attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2))
            if plain and position_ids is None:
                plain = attention_mask is None or bool(attention_mask.all())
                if plain:
                    start = cache.get_seq_length()
                    position_ids = torch.arange(start, start + inputs_embeds.shape[1], device=inputs_embeds.device)
                    position_ids = position_ids[None].expand(inputs_embeds.shape[0], -1)
            if not plain or position_ids.dim() != 2:
                return own(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
                           **({"cache": cache} if cache is not None else {}), **kwargs)
            last, hidden = self.step(None, position_ids, cache, attention_mask, output_hidden_states,
                                     inputs_embeds=inputs_embeds, head=False)
            named = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
            return BaseModelOutputWithPast(last_hidden_state=last, hidden_states=hidden, **{named: cache})

        decoder.__dict__["forward"] = forward
        try:
            yield self
        finally:
            decoder.__dict__.pop("forward", None)

    def __enter__(self) -> "FusedForward":
        def forward(*args, **kwargs):
            return self.forward(*args, **kwargs)

        # generate reads the forward's signature (which inputs it takes, logits_to_keep, the cache's name)
        if self._signature is None:
            self._signature = inspect.signature(self.model.forward)
        forward.__signature__ = self._signature
        self.model.__dict__["forward"] = forward
        return self

    def __exit__(self, *exc) -> None:
        self.model.__dict__.pop("forward", None)
