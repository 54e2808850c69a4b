"""Compile every kernel for an H100 (sm_90) on the CPU, with the launchers' tile configurations.

The interpreter used by the other kernel tests checks numerics but not what only the GPU
compiler checks (control flow and types the code generator rejects, dot shapes, shared memory,
ptxas). This test runs Triton's real pipeline down to a cubin with the ptxas that ships with
triton, in a subprocess (the interpreter flag must be off when the kernel modules load).
"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")  # triton has wheels only on Linux; the kernels are optional elsewhere

SCRIPT = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashmm.kernels import attention, compaction, verification

TARGET = GPUTarget("cuda", 90, 32)
TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

def build(fn, types, constexprs, num_warps=4, num_stages=2):
    options = {"num_warps": num_warps, "num_stages": num_stages}
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=TARGET, options=options)
    assert kernel.asm["cubin"], fn.__name__
    return kernel

CASES = [(torch.bfloat16, 128, 256, True, True, True),    # dtype, D, rows, split, prefix_start, prefix_valid
         (torch.float16, 64, 12, False, False, False),
         (torch.float32, 128, 64, True, False, True)]
for dtype, head_dim, rows, split, prefix_start, prefix_valid in CASES:
    cfg = attention.launch_config(dtype, head_dim, rows)
    t = "*" + TRITON_DTYPE[dtype]
    build(attention._tree_attention_kernel,
          dict(Q=t, K=t, V=t, Mask="*i32", PrefixStart="*i32", PrefixValid="*i8", Out=t, PartAcc="*fp32",
               PartM="*fp32", PartL="*fp32", qk_scale="fp32"),
          dict(GROUP=4, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
               HAS_PREFIX_START=prefix_start, HAS_PREFIX_VALID=prefix_valid, SPLIT=split,
               INPUT_PRECISION=cfg["INPUT_PRECISION"]),
          cfg["num_warps"], cfg["num_stages"])
    build(attention._tree_attention_combine_kernel,
          dict(PartAcc="*fp32", PartM="*fp32", PartL="*fp32", Out=t), dict(BLOCK_R=16, BLOCK_D=cfg["BLOCK_D"]))
ints = dict(Tokens="*i64", Parents="*i64", Path="*i64", AcceptedLen="*i64", NextToken="*i64")
for t in ("*fp32", "*bf16"):
    build(verification._verify_greedy_kernel, dict(ints, Logits=t), dict(BLOCK_N=256, BLOCK_P=16, BLOCK_V=1024))
    for has_q in (True, False):
        build(verification._verify_sampling_kernel, dict(ints, P=t, Q=t, U="*fp64", Work="*fp32"),
              dict(HAS_Q=has_q, BLOCK_N=256, BLOCK_P=16, BLOCK_V=1024))
build(compaction._kv_keep_kernel, dict(Base="*bf16", Offsets="*i64", Path="*i64"), dict(BLOCK_L=16, BLOCK_D=128))
print("compiled")
"""


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)          # a real compile, not a cache hit
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="only the CPU-side compile is checked here")
def test_launch_config_fits_device():
    from flashmm.kernels.attention import launch_config
    cfg = launch_config(torch.bfloat16, 128, 256)
    shared = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    tile_bytes = 2 * (cfg["BLOCK_M"] + 2 * cfg["BLOCK_N"] * cfg["num_stages"]) * cfg["BLOCK_D"]
    assert tile_bytes <= shared
