"""tree_attention kernel vs its float32 reference and a brute-force per-query softmax.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (set before the kernel module loads).
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashmm.kernels.attention import (dense_tree_mask, launch_config, split_count, tree_attention,  # noqa: E402
                                       tree_attention_ref)
from flashmm.tree.token_tree import TokenTree  # noqa: E402
from tree_shapes import make_tree

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def make_inputs(bsz, hkv, group, n, prefix, d, dtype, gen, hf_layout=False):
    """q [B, Hq, N, D], k, v [B, Hkv, P+N, D]; hf_layout gives the strided views HF passes."""
    hq = hkv * group
    if hf_layout:   # q from [B, N, Hq, D].transpose(1, 2), as after a q_proj(...).view(...)
        q = torch.randn(bsz, n, hq, d, generator=gen).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(bsz, hq, n, d, generator=gen).to(dtype)
    k = torch.randn(bsz, hkv, prefix + n, d, generator=gen).to(dtype)
    v = torch.randn(bsz, hkv, prefix + n, d, generator=gen).to(dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def run_poisoned(q, k, v, mask, prefix, **kw):
    out = torch.full_like(q, float("nan"))
    result = tree_attention(q, k, v, mask, prefix, out=out, **kw)
    assert result is out
    assert not torch.isnan(out).any(), "kernel left output elements unwritten"
    return out


def brute_force(q, k, v, allowed, scale):
    """float64 per-(b, head, query) softmax over the visible keys only."""
    bsz, hq, n, _ = q.shape
    group = hq // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(bsz):
        for h in range(hq):
            for i in range(n):
                cols = allowed[b, i].nonzero().squeeze(1).cpu()
                kk = k[b, h // group, cols].double().cpu()
                s = (kk @ q[b, h, i].double().cpu()) * scale
                out[b, h, i] = s.softmax(0) @ v[b, h // group, cols].double().cpu()
    return out


# Every N x prefix pair once; GQA ratio, batch, dtype and tree shape cycle through their values.
NS = (1, 3, 31, 32, 33, 100)
PREFIXES = (0, 1, 517)
CASES = []
for i, (n, prefix) in enumerate([(n, p) for n in NS for p in PREFIXES]):
    group = (1, 4, 8)[i % 3]
    CASES.append(dict(n=n, prefix=prefix, group=group, bsz=1 if n * group > 256 else (1, 2, 3)[(i // 3) % 3],
                      hkv=1 + (i % 2), dtype=(torch.float32, torch.float16)[(i // 2) % 2],
                      kind=("random", "chain", "star")[(i // 4) % 3], d=(16, 32, 24)[i % 3]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{n}-P{prefix}-G{group}-B{bsz}-{kind}-{d}-{dt}".format(
    dt=str(c["dtype"]).split(".")[-1], **c))
def test_matches_reference(case):
    gen = torch.Generator().manual_seed(case["n"] * 1000 + case["prefix"])
    tree = make_tree(case["kind"], case["n"], gen)
    q, k, v = make_inputs(case["bsz"], case["hkv"], case["group"], case["n"], case["prefix"], case["d"],
                          case["dtype"], gen, hf_layout=case["prefix"] == 1)
    mask = tree.packed_mask.to(DEVICE)[None].expand(case["bsz"], -1, -1)
    out = run_poisoned(q, k, v, mask, case["prefix"])
    ref = tree_attention_ref(q, k, v, mask, case["prefix"])
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[q.dtype], rtol=TOL[q.dtype])


def test_reference_equals_brute_force_per_row_trees():
    """The reference itself, against float64 per-query attention, with a different tree per row."""
    gen = torch.Generator().manual_seed(1)
    trees = [make_tree(kind, 9, gen) for kind in ("random", "chain", "star")]
    mask = torch.stack([t.packed_mask for t in trees]).to(DEVICE)
    q, k, v = make_inputs(3, 2, 2, 9, 5, 16, torch.float32, gen)
    start = torch.tensor([[0] * 9, [2] * 9, list(range(9))], dtype=torch.int32, device=DEVICE)
    allowed = dense_tree_mask(mask, 5, start)
    expected = brute_force(q, k, v, allowed, 0.3)
    torch.testing.assert_close(tree_attention_ref(q, k, v, mask, 5, 0.3, start).double().cpu(), expected,
                               atol=1e-5, rtol=1e-5)
    out = run_poisoned(q, k, v, mask, 5, sm_scale=0.3, prefix_start=start)
    torch.testing.assert_close(out.double().cpu(), expected, atol=1e-5, rtol=1e-5)
    for b, tree in enumerate(trees):   # the unpacked mask is the tree's ancestor mask
        assert torch.equal(allowed[b, :, 5:].cpu(), tree.ancestor_mask)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_prefix_matches_reference(num_splits):
    """Flash-decoding path (prefix split over programs, then merged), with per-query prefix starts
    so that some splits see no visible key for some rows."""
    gen = torch.Generator().manual_seed(num_splits)
    tree = make_tree("random", 10, gen)
    q, k, v = make_inputs(2, 1, 4, 10, 517, 16, torch.float32, gen)
    mask = tree.packed_mask.to(DEVICE)
    start = torch.randint(0, 517, (2, 10), generator=gen, dtype=torch.int32).to(DEVICE)
    for prefix_start in (None, start):
        out = run_poisoned(q, k, v, mask, 517, prefix_start=prefix_start, num_splits=num_splits,
                           block_m=32, block_n=64)
        ref = tree_attention_ref(q, k, v, mask[None], 517, prefix_start=prefix_start)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 64), (64, 32)])
def test_tile_sizes(block_m, block_n):
    """Tiles that cut the packed (node, head) rows and the 32-bit mask words at odd places."""
    gen = torch.Generator().manual_seed(block_m + block_n)
    tree = make_tree("random", 45, gen)
    q, k, v = make_inputs(1, 2, 3, 45, 40, 16, torch.float16, gen)
    mask = tree.packed_mask.to(DEVICE)
    out = run_poisoned(q, k, v, mask, 40, block_m=block_m, block_n=block_n)
    ref = tree_attention_ref(q, k, v, mask[None], 40)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_split_count_fills_one_wave_at_most():
    """Never a second, nearly empty wave; short prefixes unsplit; >= 256 prefix rows per split."""
    for prefix in (0, 512, 1023, 1024, 2048, 8192, 32768):
        for programs in (1, 8, 16, 24, 64, 131, 132, 500):
            for sms in (1, 78, 132):
                s = split_count(prefix, programs, sms)
                assert s >= 1
                assert s == 1 or (programs * s <= sms and prefix // s >= 256 and prefix >= 1024)
    assert split_count(32768, 16, 132) == 8 and split_count(512, 8, 132) == 1


def test_launch_config_tiles():
    """Tall 128-row tiles (8 warps) only for many rows at D = 128; tiles cover tiny trees."""
    for dtype in (torch.float16, torch.bfloat16):
        assert launch_config(dtype, 128, 256)["BLOCK_M"] == 128 and launch_config(dtype, 128, 256)["num_warps"] == 8
        assert launch_config(dtype, 64, 1024)["BLOCK_M"] == 64
        assert launch_config(dtype, 128, 12)["BLOCK_M"] == 16
        assert launch_config(dtype, 256, 1024)["BLOCK_N"] == 32
    fp32 = launch_config(torch.float32, 128, 1024)
    assert fp32["INPUT_PRECISION"] == "ieee" and fp32["BLOCK_M"] == 32


def test_prefix_start_per_row_left_padding():
    gen = torch.Generator().manual_seed(7)
    tree = make_tree("random", 33, gen)
    q, k, v = make_inputs(3, 1, 4, 33, 64, 32, torch.float32, gen)
    mask = tree.packed_mask.to(DEVICE)
    start = torch.tensor([0, 17, 64], dtype=torch.int32, device=DEVICE)   # 64: whole prefix padded
    out = run_poisoned(q, k, v, mask, 64, prefix_start=start)
    ref = tree_attention_ref(q, k, v, mask[None], 64, prefix_start=start[:, None])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # Row 2 sees no prefix: it must equal attention over the tree rows alone.
    alone = tree_attention_ref(q[2:], k[2:, :, 64:], v[2:, :, 64:], mask[None], 0)
    torch.testing.assert_close(out[2:], alone, atol=2e-5, rtol=2e-5)


def test_default_scale_and_chain_equals_causal():
    """A chain is causal attention over prefix + chain: compare with SDPA's bottom-right causal."""
    gen = torch.Generator().manual_seed(3)
    n, prefix = 12, 30
    q, k, v = make_inputs(2, 2, 1, n, prefix, 32, torch.float32, gen)
    out = run_poisoned(q, k, v, TokenTree.chain(n - 1).packed_mask.to(DEVICE), prefix)
    causal = torch.ones(n, prefix + n, dtype=torch.bool, device=DEVICE).tril(prefix)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    scaled = run_poisoned(q, k, v, TokenTree.chain(n - 1).packed_mask.to(DEVICE), prefix,
                          sm_scale=1.0 / math.sqrt(32))
    torch.testing.assert_close(scaled, out, atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the interpreter has no bf16 arithmetic")
def test_bfloat16_on_gpu():
    gen = torch.Generator().manual_seed(5)
    tree = make_tree("random", 64, gen)
    q, k, v = make_inputs(2, 2, 4, 64, 2048, 128, torch.bfloat16, gen)
    mask = tree.packed_mask.to(DEVICE)
    out = run_poisoned(q, k, v, mask, 2048)
    ref = tree_attention_ref(q, k, v, mask[None], 2048)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_input_validation():
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_inputs(1, 2, 2, 5, 3, 16, torch.float32, gen)
    mask = TokenTree.chain(4).packed_mask.to(DEVICE)
    with pytest.raises(TypeError, match="int32"):
        tree_attention(q, k, v, mask.long(), 3)
    with pytest.raises(ValueError, match="prefix_len"):
        tree_attention(q, k, v, mask, 2)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(q[:, :3], k, v, mask, 3)
    with pytest.raises(TypeError, match="share"):
        tree_attention(q.half(), k, v, mask, 3)
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention(q, k, v, TokenTree.chain(5).packed_mask.to(DEVICE), 3)
