"""oneDNN's matmul for a CPU model's linear layers during flashmm's forwards (prefill and trees).

A tree verification multiplies every weight matrix by a handful of rows (the N tree nodes).
ATen's fp32 ``linear`` hands that to MKL's sgemm, which on the 2-core AMD EPYC these
benchmarks run on is slower for 2..13 rows than for one row; oneDNN's matmul (the primitive
inductor's CPU fusions call, ``torch.ops.mkldnn._linear_pointwise``) multiplies the same rows
in about three quarters of the time. Measured (SmolLM2-135M, fp32, 2 threads, 600-token video
prompt): one forward of 13 tree tokens 107 → 82 ms, of 1 token 60 → 47 ms.

The weights are reordered once into oneDNN's blocked layout (``packed_weight``; a second copy of
the linear weights, kept while the model lives, for models whose linear weights total at most
PACK_LIMIT_BYTES): SmolLM2-135M's one-token step then takes 18 ms instead of 25 ms, and its
LM head multiplies one row in 1.2 ms instead of 2.3 ms (6.3 ms through MKL).

The prompt's prefill goes through it too: MKL's sgemm is as slow for hundreds of rows on these
cores (SmolLM2-135M, 2 threads: a 138-token prompt 0.21 → 0.12 s, 600 tokens 0.91 → 0.57 s,
8 × 138 tokens 1.32 → 0.72 s).

The products agree with ``F.linear`` to fp32 rounding, not bit for bit, just as a forward of
N rows never matches N one-row forwards bit for bit (so the prefix cache is not bit for bit the
one ``generate`` builds; ``linear="torch"`` keeps the model's own layers everywhere).
"""
from __future__ import annotations

import contextlib
import platform
import weakref
from functools import lru_cache, partial

import torch

from ..kernels import blocks

LINEAR_BACKENDS = ("auto", "onednn", "torch")
#: weights are reordered once into oneDNN's blocked layout, a second copy kept while the model
#: lives, when the routed weights total at most this many bytes (larger models multiply unpacked)
PACK_LIMIT_BYTES = 4 << 30
#: the row count the blocked layout is chosen for: one layout serves every row count, and on the
#: benchmark CPU 64 made SmolLM2's LM head fastest for one row (1.2 ms against 2.3 ms unpacked)
PACK_ROWS = 64
_PACKED: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple]" = weakref.WeakKeyDictionary()
_PACKED_BF16: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple]" = weakref.WeakKeyDictionary()
_SMALL_BF16: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple]" = weakref.WeakKeyDictionary()


def onednn_available() -> bool:
    """torch has oneDNN's linear op and the user has not switched oneDNN off
    (``torch.backends.mkldnn.enabled``)."""
    return (torch.backends.mkldnn.is_available() and bool(torch.backends.mkldnn.enabled)
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def resolve_linear_backend(linear: str, model: torch.nn.Module) -> str:
    """"auto" → "onednn" for an fp32 model on an x86-64 CPU when torch has oneDNN, else "torch".

    "auto" stays off other CPUs (ARM builds run oneDNN over other kernels) because the speedup
    was measured on x86-64 only; "onednn" asks for it wherever torch has it."""
    if linear not in LINEAR_BACKENDS:
        raise ValueError(f"linear must be one of {LINEAR_BACKENDS}, got {linear!r}")
    weight = model.get_output_embeddings().weight
    on_cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if linear == "onednn" and not (on_cpu_fp32 and onednn_available()):
        raise ValueError("linear='onednn' needs an fp32 model on CPU and a torch built with oneDNN "
                         f"(model: {weight.dtype} on {weight.device}; oneDNN: {onednn_available()}); "
                         "use linear='auto' or 'torch'")
    if linear == "auto":
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        return "onednn" if on_cpu_fp32 and x86 and onednn_available() else "torch"
    return linear


def can_pack() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packed_weight(layer: torch.nn.Linear) -> torch.Tensor:
    """``layer``'s weight in oneDNN's blocked layout, reordered once and kept (per layer, while it
    lives) until the weight is replaced or changed in place. oneDNN multiplies it faster, into the
    plain layout's products to fp32 rounding."""
    key = (layer.weight.data_ptr(), layer.weight._version)
    hit = _PACKED.get(layer)
    if hit is None or hit[0] != key:
        hit = (key, torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACK_ROWS))
        _PACKED[layer] = hit
    return hit[1]


def bf16_kernels() -> bool:
    """Whether torch's oneDNN has bf16 kernels here (x86-64 with AVX-512, or AMX): then drafters whose target
    multiplies through oneDNN multiply their own linear layers in bfloat16 (``OneDNNLinears(bf16=True)``), and
    greedy verification screens the LM head in bfloat16 (flashmm.targets.head_screen).

    A draft only proposes tokens: the target's verification decides every emitted token from its own fp32
    logits, so a draft computed in bf16 changes which tokens are proposed (rarely: SmolLM2's EAGLE-3 head
    drafted τ 2.41 against 2.43 over 8 Spec-Bench dev questions), never the output; sampled drafts carry the
    probabilities they were drawn from, whatever their precision. The weights are read at half the bytes:
    that head's drafting took 15 ms of a 53 ms step on the 2-core EPYC, and EAGLE-3 decoded 50.9 tok/s against
    47.7 with the same outputs. ``linear="torch"`` keeps every layer, the drafters' too, as the model has it."""
    return onednn_available() and can_pack() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


#: how a drafter multiplies its linear layers beside a target on oneDNN: "auto" (bf16 where ``bf16_drafting``),
#: "fp32" (as the target does: its draft logits then equal a float64 forward's to fp32 rounding)
DRAFT_PRECISIONS = ("auto", "fp32")


def resolve_draft_precision(precision: str, linear_backend: str) -> str:
    """"bf16" or "fp32": what a drafter of a target whose linears run on ``linear_backend`` multiplies in."""
    if precision not in DRAFT_PRECISIONS:
        raise ValueError(f"draft_precision must be one of {DRAFT_PRECISIONS}, got {precision!r}")
    return "bf16" if precision == "auto" and linear_backend == "onednn" and bf16_drafting() else "fp32"


def bf16_drafting() -> bool:
    """Whether a drafter beside a target on oneDNN multiplies in bf16 here: with oneDNN's bf16 kernels
    (``bf16_kernels``), or without them (AVX2) with flashmm's compiled kernel, which multiplies a drafting step's
    few rows from bf16 weights; its many-row products (a prompt's pass) then multiply the bf16-rounded weights in
    fp32, through oneDNN's fp32 kernels. Either way the weights are the bf16 rounding of the drafter's and the
    inputs and sums stay fp32 (oneDNN's bf16 kernels round the inputs too)."""
    return bf16_kernels() or (onednn_available() and can_pack() and _small_kernel())


def packed_bf16_weight(layer: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``layer``'s weight in bfloat16 in oneDNN's blocked layout, its bias in bfloat16 or None), made once and
    kept like ``packed_weight``'s. Without oneDNN's bf16 kernels (``bf16_drafting``): the weight's bf16 rounding
    held in fp32, and the bias as it is."""
    key = (layer.weight.data_ptr(), layer.weight._version)
    hit = _PACKED_BF16.get(layer)
    if hit is None or hit[0] != key:
        rounded = layer.weight.detach().bfloat16()
        if _onednn_bf16():
            bias = None if layer.bias is None else layer.bias.detach().bfloat16()
        else:
            rounded, bias = rounded.float(), None if layer.bias is None else layer.bias.detach()
        hit = (key, (torch.ops.mkldnn._reorder_linear_weight(rounded, PACK_ROWS), bias))
        _PACKED_BF16[layer] = hit
    return hit[1]


@lru_cache(maxsize=1)
def _onednn_bf16() -> bool:
    return bf16_kernels()


def _own_linear(layer: torch.nn.Linear, x: torch.Tensor) -> bool:
    """Whether ``layer``'s product must be ``F.linear``'s: under autograd (oneDNN's op has no backward), under
    autocast (which only ``F.linear`` sees) or for an input of another dtype."""
    return x.dtype != layer.weight.dtype or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu")


#: a bf16 product of at most this many rows, and of one row at any size, runs on flashmm's compiled kernel where it
#: runs (flashmm.kernels.blocks.bf16_linear: bf16 weights, fp32 inputs and sums), for weights of at most
#: SMALL_WEIGHT values: oneDNN's call costs 24-41 us there on the 2-core EPYC (an EAGLE-3 head's layers, one row),
#: the kernel's 6-20; from 8 rows or an 8,192-row LM head at 4 rows oneDNN is faster
SMALL_ROWS, SMALL_WEIGHT = 4, 1 << 21


@lru_cache(maxsize=1)
def _small_kernel() -> bool:
    return blocks.unavailable() is None


def _small_bf16_codes(layer: torch.nn.Linear) -> torch.Tensor | None:
    """``layer``'s bf16 weight in the compiled kernel's layout, made once and kept like ``packed_weight``'s; None
    when the kernel cannot run here or the layer's rows are not a multiple of 16."""
    if not _small_kernel() or layer.weight.shape[0] % blocks.GROUP:
        return None
    key = (layer.weight.data_ptr(), layer.weight._version)
    hit = _SMALL_BF16.get(layer)
    if hit is None or hit[0] != key:
        hit = (key, blocks.bf16_codes(layer.weight))
        _SMALL_BF16[layer] = hit
    return hit[1]


def _onednn_bf16_linear(layer: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None,
                        x: torch.Tensor) -> torch.Tensor:
    """x [..., in] fp32 → [..., out] fp32: ``layer``'s product computed in bfloat16 by oneDNN (weight, bias:
    ``packed_bf16_weight(layer)``), or for a few rows by flashmm's compiled kernel (SMALL_ROWS); autograd,
    autocast and other dtypes take ``F.linear`` (as _onednn_linear)."""
    if _own_linear(layer, x):
        return torch.nn.functional.linear(x, layer.weight, layer.bias)
    count = x.numel() // x.shape[-1]
    if count == 1 or (count <= SMALL_ROWS and layer.weight.numel() <= SMALL_WEIGHT):
        codes = _small_bf16_codes(layer)
        if codes is not None:
            out = blocks.bf16_linear(x.reshape(count, x.shape[-1]), codes, layer.bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
    rows = x.reshape(-1, x.shape[-1])
    if not _onednn_bf16():  # the bf16-rounded weight in fp32 (packed_bf16_weight)
        return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "").reshape(*x.shape[:-1], -1)
    out = torch.ops.mkldnn._linear_pointwise(rows.to(torch.bfloat16), weight, bias, "none", [], "")
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def _onednn_linear(layer: torch.nn.Linear, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [..., in] → [..., out], the product of ``layer`` computed by oneDNN with ``weight`` (the
    layer's own, or packed_weight(layer)).

    Falls back to ``F.linear`` where oneDNN's op would change behaviour: autograd (the op has
    no backward), autocast (which only ``F.linear`` sees) and inputs of another dtype."""
    if _own_linear(layer, x):
        return torch.nn.functional.linear(x, layer.weight, layer.bias)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, layer.bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def routable_layers(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The layers OneDNNLinears routes: plain fp32 CPU ``nn.Linear`` whose forward is their own."""
    return [layer for layer in model.modules()
            if type(layer) is torch.nn.Linear and "forward" not in layer.__dict__
            and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32]


def packs(layers: list[torch.nn.Linear], pack: bool | None = None) -> bool:
    """Whether OneDNNLinears multiplies ``layers`` with packed weights (``pack`` None: when torch
    can and their weights total at most PACK_LIMIT_BYTES)."""
    size = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    return bool(layers) and can_pack() and (size <= PACK_LIMIT_BYTES if pack is None else pack)


class OneDNNLinears:
    """Context manager: while entered, ``model``'s fp32 CPU ``nn.Linear`` layers compute with oneDNN.

    Only plain ``nn.Linear`` layers are routed (subclasses, e.g. quantized layers, keep their
    own forward), and a layer whose ``forward`` was already replaced on the instance (an
    accelerate offload hook) is left alone. Entering and leaving swaps one instance attribute
    per layer, cheap enough to do around every tree forward. Calls under autograd or autocast,
    or with a non-fp32 input, take ``F.linear`` as before. A layer already routed by an outer
    ``OneDNNLinears`` is not routed again, so nesting is harmless. ``pack``: multiply with the
    weights in oneDNN's blocked layout (packed_weight; None: when torch can and the routed weights
    total at most PACK_LIMIT_BYTES); ``packed`` says whether they are. ``bf16``: multiply in bfloat16
    (packed bf16 copies of the weights, fp32 in and out): for drafters only (``bf16_drafting``).
    """

    def __init__(self, model: torch.nn.Module, pack: bool | None = None, bf16: bool = False):
        layers = routable_layers(model)
        self.packed = bool(layers) and (bf16 or packs(layers, pack))
        if bf16:
            self.routes = [(layer, partial(_onednn_bf16_linear, layer, *packed_bf16_weight(layer))) for layer in layers]
        else:
            self.routes = [(layer, partial(_onednn_linear, layer, packed_weight(layer) if self.packed else layer.weight))
                           for layer in layers]

    def __enter__(self) -> "OneDNNLinears":
        for layer, forward in self.routes:
            layer.__dict__["forward"] = forward
        return self

    def __exit__(self, *exc) -> None:
        for layer, _ in self.routes:
            layer.__dict__.pop("forward", None)


def routed_like(target, module: torch.nn.Module):
    """What a drafter's ``module`` runs in while drafting for ``target``: OneDNNLinears when the target's
    forwards multiply through oneDNN (only the module's fp32 CPU linears are routed; in bfloat16 when the
    target's ``draft_precision`` is "bf16"), else nothing."""
    if getattr(target, "linear_backend", "torch") == "onednn":
        return OneDNNLinears(module, bf16=getattr(target, "draft_precision", "fp32") == "bf16")
    return contextlib.nullcontext()
