"""Exact 4-bit block weights on a CPU: the linear layers of a model whose fp32 weights are a 4-bit
quantisation, dequantised (a GGUF's Q4_1 tensors as transformers loads them), multiplied from their
4-bit codes instead of their fp32 values.

transformers reads a GGUF by dequantising it: SmolLM2-135M-Instruct.Q4_1 becomes 540 MB of fp32 weights
whose every block of 32 consecutive values in a row is ``d * q + m`` (q = 0..15; d, m per block). Those
fp32 values are the model: flashmm keeps them exactly. ``encode`` recovers (q, d, m) from the fp32 tensor
and accepts it only when ``d * q + m`` computed in fp32 gives back every value bit for bit; the kernel
(blocks_cpu.cpp) rebuilds each weight that way, in registers, and multiplies in fp32. The products
differ from oneDNN's as two fp32 summation orders do, and a step reads 5 bits a weight instead of 32:
SmolLM2's 210 layer weights, measured on the 2-core EPYC, multiply one row in 3.9 ms against oneDNN's
22 ms (``eval/results/blocks_linear.md``).

The kernel is C++ compiled on first use (torch.utils.cpp_extension, ~25 s) for this machine's CPU and kept
under ``cache_dir()/kernels``; it needs AVX2 or AVX-512 (``unavailable`` says why it cannot run, and the fused
step then multiplies with oneDNN as before).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

#: 32 consecutive weights of a row share a scale and a minimum (GGUF's Q4_1 block)
BLOCK = 32
#: rows of the weight the kernel expands together (16 fp32 lanes of AVX-512, two registers of AVX2)
GROUP = 16
#: the most rows of input the kernel multiplies: 4-bit weights; more go to oneDNN's fp32 matmul, which is as fast
#: from about 90 rows on with AVX-512 (SmolLM2's layer weights on the 2-core EPYC, eval/results/blocks_linear.md)
MAX_ROWS = 64
#: the same with AVX2 alone, whose kernel expands 8 rows at a time: oneDNN is as fast from about 24-32 rows on
#: (SmolLM2's layer weights on a 2-core AVX2 EPYC, eval/results/blocks_linear_avx2.md)
MAX_ROWS_AVX2 = 24
#: the same for 8-bit weights (SmolLM2's Q8_0 LM head: 1.6 ms against oneDNN's 2.8 for 4 rows, 3.0 against 3.8 for 8)
MAX_ROWS_8 = 8
_SOURCE = Path(__file__).with_name("blocks_cpu.cpp")


@dataclass(frozen=True)
class BlockWeight:
    """A weight [out, in] as its block codes (blocks_cpu.cpp's layout). 4-bit: codes uint8
    [out / 16, in / 32, 16, 16], scale and low fp32 [out / 16, in / 32, 16]; 8-bit: codes int8
    [out / 16, in / 32, 32, 16], scale, low None."""
    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0] * GROUP, self.codes.shape[1] * BLOCK


def unavailable() -> str | None:
    """Why the block kernel cannot run here (a phrase), None when it can."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is written for x86-64 (this is {platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "AVX512_BF16", "AMX"):
        return f"it needs AVX2 or AVX-512 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        return f"compiling it needs {' and '.join(missing)} on the PATH"
    return None


def encode(weight: torch.Tensor) -> BlockWeight | None:
    """weight [out, in] fp32 → its BlockWeight when every block of 32 values in a row is exactly
    ``d * q + m`` in fp32 (4-bit: q = 0..15; the block's minimum m taken by some q = 0, d a float16 near
    (max − min) / 15, as llama.cpp's Q4_1 quantiser writes them) or exactly ``d * q`` (8-bit: q = −128..127,
    the largest magnitude at |q| = 127, Q8_0), else None. Exact by construction: the codes are kept only when
    rebuilding every value gives the tensor back bit for bit."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[0] % GROUP or weight.shape[1] % BLOCK:
        return None
    weight = weight.detach()
    rows, blocks = weight.shape[0], weight.shape[1] // BLOCK
    regroup = lambda t: t.view(rows // GROUP, GROUP, blocks).transpose(1, 2).contiguous()  # noqa: E731
    # most tensors that are not blocks fail on their first rows
    if _codes(weight[:GROUP]) is not None and (found := _codes(weight)) is not None:
        q, scale, low = found                                                # [N, K/32, 32], [N, K/32] x 2
        q = q.view(rows // GROUP, GROUP, blocks, BLOCK).permute(0, 2, 3, 1)  # [g, b, t, l]
        codes = (q[:, :, :16] | (q[:, :, 16:] << 4)).contiguous()           # [g, b, j, l]
        return BlockWeight(codes, regroup(scale), regroup(low))
    if _codes8(weight[:GROUP]) is not None and (found := _codes8(weight)) is not None:
        q, scale = found
        codes = q.view(rows // GROUP, GROUP, blocks, BLOCK).permute(0, 2, 3, 1).contiguous()  # [g, b, t, l]
        return BlockWeight(codes, regroup(scale), None)
    return None


def _codes8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q int8 [N, K/32, 32], d fp32 [N, K/32]) with d * q == ``weight`` exactly, or None."""
    rows, cols = weight.shape
    values = weight.view(rows, cols // BLOCK, BLOCK)
    scale = values.abs().amax(-1, keepdim=True) / 127       # exact where the largest value is d * ±127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(values / safe).clamp_(-128, 127)
    if not bool((safe * q == values).all()):
        return None
    return q.to(torch.int8), scale[..., 0]


def _codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q uint8 [N, K/32, 32], d, m fp32 [N, K/32]) rebuilding ``weight`` exactly, or None."""
    rows, cols = weight.shape
    values = weight.view(rows, cols // BLOCK, BLOCK)
    low = values.amin(-1, keepdim=True)
    span = values.amax(-1, keepdim=True) - low
    nearest = (span / 15).half()
    q = torch.zeros(values.shape, dtype=torch.uint8)
    scale = torch.zeros_like(low)
    done = span == 0                                                        # constant blocks: q = 0
    for step in (0, 1, -1, 2, -2):                                          # float16 neighbours of span / 15
        if bool(done.all()):
            break
        d = (nearest.view(torch.int16) + step).view(torch.float16).float() if step else nearest.float()
        d = torch.where(d > 0, d, torch.ones_like(d))
        codes = torch.round((values - low) / d).clamp_(0, 15)
        good = ((d * codes + low) == values).all(-1, keepdim=True) & ~done  # d * codes is exact: one rounding
        q = torch.where(good, codes.to(torch.uint8), q)
        scale = torch.where(good, d, scale)
        done |= good
    if not bool(done.all()):
        return None
    # the kernel's one-fma rebuild needs d * q exact: d a float16 value (11 significant bits) is
    assert bool((scale.half().float() == scale).all())
    return q, scale[..., 0], low[..., 0]


@lru_cache(maxsize=1)
def version() -> str:
    """The kernel's identity here: its source, this torch installation and this CPU (a measured cost of a step on
    it is valid for this identity only; another environment's torch builds its own)."""
    source = _SOURCE.read_bytes()
    return hashlib.sha256(source + torch.__version__.encode() + torch.__file__.encode() + platform.processor().encode()
                          + torch.backends.cpu.get_cpu_capability().encode()).hexdigest()[:16]


@lru_cache(maxsize=None)
def build(*extra_cflags: str):
    """The kernel compiled for this machine (``-march=native``), ``extra_cflags`` appended: the tests build the
    AVX2 path on an AVX-512 machine with ``-mno-avx512f``. Its ``isa()`` names the vector path it compiled."""
    from torch.utils.cpp_extension import load  # noqa: PLC0415 (imports setuptools; only when a model needs it)

    from flashmm.paths import cache_dir  # noqa: PLC0415

    key = version() + "".join(f"_{flag.strip('-').replace('-', '_')}" for flag in extra_cflags)
    build_dir = cache_dir() / "kernels" / f"blocks-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # compiled from a copy inside its build folder: the build names no path outside it, so installs of the same
    # source (an editable checkout, a wheel in a virtual environment) share one build instead of recompiling
    # (~30 s) each time another one loads it
    source = build_dir / _SOURCE.name
    if not source.is_file():
        partial = build_dir / f".{_SOURCE.name}.{os.getpid()}"
        partial.write_bytes(_SOURCE.read_bytes())
        os.replace(partial, source)
    return load(f"flashmm_blocks_{key}", [str(source)], build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", *extra_cflags],
                extra_ldflags=["-fopenmp"], verbose=False)


def max_rows(weight: BlockWeight) -> int:
    """The most rows of input ``weight`` is multiplied for here (MAX_ROWS or MAX_ROWS_AVX2, MAX_ROWS_8)."""
    return _max_rows_4bit() if weight.low is not None else MAX_ROWS_8


@lru_cache(maxsize=1)
def _max_rows_4bit() -> int:
    return MAX_ROWS_AVX2 if torch.backends.cpu.get_cpu_capability() == "AVX2" else MAX_ROWS


def linear(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] fp32 → x Wᵀ + bias [M, out], W the fp32 weight ``weight`` encodes (its exact values)."""
    low = weight.low if weight.low is not None else weight.scale.new_empty(0)
    return build().block_linear(x.contiguous(), weight.codes, weight.scale, low, bias)


def bf16_codes(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] → its bf16 rounding as ``bf16_linear`` reads it (int16 [out / 16, in, 16]), or None when
    out is not a multiple of 16."""
    out, cols = weight.shape
    if out % GROUP:
        return None
    bits = weight.detach().to(torch.bfloat16).view(torch.int16)
    return bits.view(out // GROUP, GROUP, cols).transpose(1, 2).contiguous()


def bf16_linear(x: torch.Tensor, codes: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] fp32 → x Wᵀ + bias [M, out] for the bf16 weight ``codes`` (``bf16_codes``), x kept in fp32 and
    every product summed in fp32. For up to MAX_ROWS rows."""
    return build().bf16_linear(x.contiguous(), codes, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, D] fp32 → its rows' RMSNorm (``torch.rms_norm``'s, to fp32 rounding), in one pass."""
    return build().rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its rows' RMSNorm): a residual step and the norm after it, x and delta [M, D] fp32."""
    return build().add_rms_norm(x.contiguous(), delta.contiguous(), weight, eps)


def silu_mul(gated: torch.Tensor) -> torch.Tensor:
    """gated [M, 2F] = [gate | up] fp32 → silu(gate) * up [M, F]."""
    return build().silu_mul(gated.contiguous())


def rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                room: tuple[torch.Tensor, torch.Tensor], length: int) -> torch.Tensor:
    """One step's rotary embeddings and cache write: qkv [B * n, (heads + 2 kv_heads) * D] fp32 (q, k, v heads in
    turn), cos / sin [B, n, 1 or absent, D] (the model's rotary_emb's) → q [B, heads, n, D] rotated, the rotated
    keys and the values written into ``room`` (keys, values) [B, kv_heads, capacity, D] at rows length .. + n."""
    batch, n, dim = cos.shape[0], cos.shape[1], cos.shape[-1]
    return build().rope_append(qkv.contiguous(), cos.reshape(batch, n, dim), sin.reshape(batch, n, dim),
                                 heads, kv_heads, room, length)


def reconstruct(weight: BlockWeight) -> torch.Tensor:
    """The fp32 weight [out, in] ``weight`` encodes, rebuilt in PyTorch as the kernel rebuilds it."""
    codes = weight.codes.to(torch.int32)
    if weight.low is None:                                                  # 8-bit: d * q
        values = weight.scale[:, :, None] * codes.float()
    else:                                                                   # 4-bit: d * q + m
        q = torch.cat([codes & 15, codes >> 4], dim=2).float()              # [g, b, t, l]
        values = weight.scale[:, :, None] * q + weight.low[:, :, None]      # [g, b, 1, l] against [g, b, t, l]
    out, cols = weight.shape
    return values.permute(0, 3, 1, 2).reshape(out, cols)
