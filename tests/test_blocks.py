"""Exact 4-bit block weights (flashmm.kernels.blocks): recovered bit for bit from a GGUF Q4_1 dequantisation
(gguf-py's own quantiser, as transformers reads a GGUF), multiplied to fp32 rounding of a float64 product, and
greedy decoding on them is the model's own ``generate``."""
from __future__ import annotations

import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.kernels import blocks
from flashmm.targets import fused
from flashmm.targets.onednn import onednn_available

from text_models import prompt, ragged_batch, tiny_lm

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(blocks.unavailable() is not None or not onednn_available(),
                                reason=f"the block kernel cannot run here: {blocks.unavailable()}")


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` through gguf-py's Q4_1 quantiser and dequantiser (what transformers loads from a GGUF)."""
    kind = gguf.GGMLQuantizationType.Q4_1
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), kind), kind).copy())


def quantised(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every decoder-layer linear weight replaced by its Q4_1 dequantisation, its LM head by its
    Q8_0 one (SmolLM2's GGUF has these types)."""
    with torch.no_grad():
        model.lm_head.weight.copy_(q8_0(model.lm_head.weight))
        for layer in model.model.layers:
            for linear in (*(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                           *(getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))):
                linear.weight.copy_(q4_1(linear.weight))
    return model


def test_a_dequantised_q4_1_weight_is_recovered_bit_for_bit():
    torch.manual_seed(0)
    weight = q4_1(torch.randn(96, 160))
    codes = blocks.encode(weight)
    assert codes is not None and codes.shape == (96, 160)
    assert torch.equal(blocks.reconstruct(codes), weight)
    nudged = weight.clone()
    nudged[40, 77] = torch.nextafter(nudged[40, 77], torch.tensor(float("inf")))  # one ulp off a block
    assert blocks.encode(nudged) is None
    assert blocks.encode(torch.randn(96, 160)) is None                              # fp32 weights are not blocks
    assert blocks.encode(q4_1(torch.randn(40, 64))) is None                         # rows not a multiple of 16


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
def test_the_block_product_is_the_float64_product_to_fp32_rounding(rows):
    torch.manual_seed(rows)
    weight, bias = q4_1(torch.randn(48, 192)), torch.randn(48)
    x = torch.randn(rows, 192)
    out = blocks.linear(x, blocks.encode(weight), bias)
    exact = x.double() @ weight.double().T + bias.double()
    bound = (x.abs().double() @ weight.abs().double().T + bias.abs().double()) * 192 * 2.0 ** -24
    assert out.shape == (rows, 48) and bool(((out.double() - exact).abs() <= bound).all())
    wrong = weight.clone()
    wrong[:, :16], wrong[:, 16:32] = weight[:, 16:32], weight[:, :16]  # the two nibbles of each code swapped
    assert not bool(((x.double() @ wrong.double().T + bias.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_on_block_weights_is_generate(arch, monkeypatch):
    """A fused target whose layer weights are Q4_1 blocks verifies on the block kernel; one row and a ragged
    batch of three decode exactly the model's own (batched) ``generate``."""
    model, draft = quantised(tiny_lm(arch)), tiny_lm(arch, seed=5)
    step = fused.fused_step(model)
    assert step.blocks and isinstance(step.head, fused.Weight) and step._head_blocks(1) and not step._head_blocks(blocks.MAX_ROWS_8 + 1)
    assert step.stack is not None                                  # its layers run as one compiled call
    calls = []
    original = blocks.linear
    monkeypatch.setattr(blocks, "linear", lambda *args: calls.append(args[0].shape[0]) or original(*args))
    ids = prompt(40, seed=3)
    reference = model.generate(ids, do_sample=False, max_new_tokens=24)
    batch, attention = ragged_batch()
    batch_reference = model.generate(batch, attention_mask=attention, do_sample=False, max_new_tokens=20)
    for drafter in (PromptLookup(), DraftModel(draft, max_draft_tokens=4, tree_width=2, adaptive=False)):
        sm = flashmm.wrap(model, drafter, linear="onednn")
        calls.clear()
        assert torch.equal(sm.generate(ids, max_new_tokens=24), reference)
        assert torch.equal(sm.generate(batch, attention_mask=attention, max_new_tokens=20), batch_reference)
        assert calls and max(calls) <= blocks.MAX_ROWS
    with fused.FusedForward(model, blocks=False):
        assert not fused.fused_step(model, blocks=False).blocks
        assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=24), reference)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_layer_stack_sums_what_the_layer_loop_sums(arch):
    """The fused step's layers as one compiled call (LayerStack) give the Python layer loop's logits, hidden states
    and cache rows bit for bit: a prompt (causal), one token, a chain and a tree (additive masks, grouped heads
    folded), a batch of two; qwen2's q / k / v carry biases."""
    from flashmm.targets import cache as kv  # noqa: PLC0415
    from flashmm.tree.token_tree import TokenTree  # noqa: PLC0415

    model = quantised(tiny_lm(arch))
    step = fused.fused_step(model)
    assert step.stack is not None and step.stack_rows == blocks.max_rows(step.layers[0][2].blocks)
    stack = step.stack
    tree = TokenTree.from_parents([-1, 0, 0, 1, 2])
    for batch in (1, 2):
        ids = prompt(12 * batch, seed=batch).view(batch, 12)
        outputs = {}
        for name, which in (("stack", stack), ("loop", None)):
            step.stack, cache, got = which, kv.new_cache(), []
            positions = torch.arange(12)[None].expand(batch, -1)
            got.append(step(ids, positions, cache, None, True))
            got.append(step(ids[:, -1:], torch.full((batch, 1), 12), cache, None, (1, 2)))
            got.append(step(ids[:, :4], torch.arange(13, 17)[None].expand(batch, -1), cache, None, False))
            bias = tree.attention_bias(17, torch.float32, torch.device("cpu"))
            got.append(step(ids[:, :5], tree.positions(17)[None].expand(batch, -1), cache, bias, True))
            outputs[name] = (got, [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)])
        step.stack = stack
        (stacked, stacked_rows), (looped, looped_rows) = outputs["stack"], outputs["loop"]
        for (logits_a, hidden_a), (logits_b, hidden_b) in zip(stacked, looped):
            assert torch.equal(logits_a, logits_b)
            assert (hidden_a is None) == (hidden_b is None)
            if hidden_a is not None:
                assert len(hidden_a) == len(hidden_b) and all(torch.equal(a, b) for a, b in zip(hidden_a, hidden_b))
        assert all(torch.equal(a, b) for a, b in zip(stacked_rows, looped_rows))


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    kind = gguf.GGMLQuantizationType.Q8_0
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), kind), kind).copy())


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_an_8_bit_block_weight_is_recovered_and_multiplied_exactly(rows):
    """A Q8_0 dequantisation (an LM head's usual type) is recovered bit for bit, one ulp off is refused, and
    its product is the float64 product to fp32 rounding."""
    torch.manual_seed(rows)
    weight = q8_0(torch.randn(64, 96))
    codes = blocks.encode(weight)
    assert codes is not None and codes.low is None and torch.equal(blocks.reconstruct(codes), weight)
    nudged = weight.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(float("inf")))
    assert blocks.encode(nudged) is None
    x = torch.randn(rows, 96)
    exact = x.double() @ weight.double().T
    bound = (x.abs().double() @ weight.abs().double().T) * 96 * 2.0 ** -24
    assert bool(((blocks.linear(x, codes).double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("rows", [1, 6])
def test_the_small_steps_equal_torchs(rows):
    """RMSNorm, residual + RMSNorm, the SiLU gate and rotary + cache write, compiled, against torch's ops."""
    import torch.nn.functional as F  # noqa: PLC0415

    torch.manual_seed(rows)
    x, delta, weight = torch.randn(rows, 96), torch.randn(rows, 96), torch.randn(96)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)  # noqa: E731
    close(blocks.rms_norm(x, weight, 1e-5), F.rms_norm(x, (96,), weight, 1e-5))
    summed, normed = blocks.add_rms_norm(x, delta, weight, 1e-5)
    close(summed, x + delta)
    close(normed, F.rms_norm(x + delta, (96,), weight, 1e-5))
    gated = torch.randn(rows, 64)
    close(blocks.silu_mul(gated), F.silu(gated[:, :32]) * gated[:, 32:])
    heads, kv_heads, dim, batch, n, length = 4, 2, 16, 2, rows, 5
    qkv = torch.randn(batch * n, (heads + 2 * kv_heads) * dim)
    angles = torch.randn(batch, n, dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, :, None], torch.cat([angles.sin()] * 2, -1)[:, :, None]
    room = (torch.zeros(batch, kv_heads, 16, dim), torch.zeros(batch, kv_heads, 16, dim))
    q = blocks.rope_append(qkv, cos, sin, heads, kv_heads, room, length)
    split = qkv.view(batch, n, heads + 2 * kv_heads, dim)
    qk = split[:, :, : heads + kv_heads]
    rotated = qk * cos + torch.cat([-qk[..., dim // 2:], qk[..., : dim // 2]], -1) * sin   # transformers' rotate_half
    close(q, rotated[:, :, :heads].transpose(1, 2))
    close(room[0][:, :, length:length + n], rotated[:, :, heads:].transpose(1, 2))
    assert torch.equal(room[1][:, :, length:length + n], split[:, :, heads + kv_heads:].transpose(1, 2))
    assert not room[0][:, :, :length].any() and not room[0][:, :, length + n:].any()


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_the_bf16_product_is_the_float64_product_of_the_bf16_weight(rows):
    """A drafter's few-row bf16 product (flashmm.kernels.blocks.bf16_linear, routed by OneDNNLinears(bf16=True)):
    the bf16 weight's float64 product with the fp32 input, to fp32 rounding; the layer routes one row there."""
    from flashmm.targets.onednn import OneDNNLinears, bf16_kernels  # noqa: PLC0415

    torch.manual_seed(rows)
    layer = torch.nn.Linear(72, 48)
    x = torch.randn(rows, 72)
    weight = layer.weight.detach().bfloat16().double()
    exact = x.double() @ weight.T + layer.bias.detach().double()
    bound = (x.abs().double() @ weight.abs().T + layer.bias.detach().abs().double()) * 72 * 2.0 ** -24
    out = blocks.bf16_linear(x, blocks.bf16_codes(layer.weight), layer.bias.detach())
    assert bool(((out.double() - exact).abs() <= bound).all())
    if not bf16_kernels():  # AVX2 without AVX-512: oneDNN packs no bf16 weight (the routing: test_onednn.py)
        return
    with torch.no_grad(), OneDNNLinears(layer, bf16=True):
        routed = layer(x[:1])
    assert bool(((routed.double() - exact[:1]).abs() <= bound[:1]).all())  # oneDNN would round x to bf16 too


def test_the_kernel_compiles_from_a_copy_in_its_cache_folder():
    """The build names no path of this checkout: an editable checkout and a wheel installed elsewhere share one
    build (ninja would recompile, ~30 s, each time the other one loaded it)."""
    from flashmm.paths import cache_dir  # noqa: PLC0415

    blocks.build()
    folder = cache_dir() / "kernels" / f"blocks-{blocks.version()}"
    ninja = (folder / "build.ninja").read_text()
    assert str(folder / blocks._SOURCE.name) in ninja and str(blocks._SOURCE.parent) not in ninja
    assert (folder / blocks._SOURCE.name).read_bytes() == blocks._SOURCE.read_bytes()


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "AVX2", reason="this machine runs the AVX2 path already")
def test_the_avx2_build_multiplies_as_exactly():
    """The kernel compiled without AVX-512 (two 8-lane halves a group; the path of AVX2-only CPUs, which an AVX-512
    machine's own build never takes): its 4-bit, 8-bit and bf16 products at every row count its tiling splits
    (one or both halves at a time, full and partial tiles) are the float64 products to fp32 rounding, equal to
    the machine's own build's up to that bound."""
    avx2 = blocks.build("-mno-avx512f")
    assert avx2.isa() == "avx2" and blocks.build().isa() != "avx2"
    torch.manual_seed(0)
    q4, q8, bias = q4_1(torch.randn(48, 192)), q8_0(torch.randn(48, 192)), torch.randn(48)
    layer = torch.nn.Linear(192, 48)
    bf16 = layer.weight.detach().bfloat16().double()
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 24):
        x = torch.randn(rows, 192)
        for weight, products in ((q4, lambda kernel, w=blocks.encode(q4): kernel.block_linear(x, w.codes, w.scale, w.low, bias)),
                                 (q8, lambda kernel, w=blocks.encode(q8): kernel.block_linear(x, w.codes, w.scale, w.scale.new_empty(0), bias)),
                                 (bf16, lambda kernel: kernel.bf16_linear(x, blocks.bf16_codes(layer.weight), bias))):
            exact = x.double() @ weight.double().T + bias.double()
            bound = (x.abs().double() @ weight.abs().double().T + bias.abs().double()) * 192 * 2.0 ** -24
            for kernel in (avx2, blocks.build()):
                assert bool(((products(kernel).double() - exact).abs() <= bound).all()), (rows, kernel.isa())
    wrong = blocks.encode(q4)
    swapped = wrong.codes.clone()
    swapped[..., :8] = wrong.codes[..., 8:]                   # a group's first 8 rows given the next 8's codes: caught
    x = torch.randn(3, 192)
    exact = x.double() @ q4.double().T
    assert not torch.allclose(avx2.block_linear(x, swapped, wrong.scale, wrong.low, None).double(), exact, atol=1e-3)


def test_sampling_on_block_weights_keeps_the_models_distribution():
    """Sampled decoding on a target verifying from block codes: the first two tokens' histogram matches the exact
    joint of the model's own forward (χ², float64 softmaxes); the lossy typical verifier fails the same test."""
    from stats_utils import chi_square_pvalue, two_token_histogram, two_token_joint  # noqa: PLC0415

    vocab, sampling = 16, dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95)
    target = quantised(tiny_lm("llama", seed=1, vocab_size=vocab, bos_token_id=None, eos_token_id=None,
                               pad_token_id=None))
    with torch.no_grad():
        target.lm_head.weight.mul_(0.15)
        target.lm_head.weight.copy_(q8_0(target.lm_head.weight))
    assert fused.fused_step(target).blocks and isinstance(fused.fused_step(target).head, fused.Weight)
    draft = tiny_lm("llama", seed=7, vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    prompt_ids = torch.tensor([[3, 5, 3, 5, 3]])
    joint = two_token_joint(target, prompt_ids, sampling)
    exact = flashmm.wrap(target, DraftModel(draft, max_draft_tokens=2, adaptive=False), linear="onednn")
    assert exact.target.unfused is None
    assert chi_square_pvalue(two_token_histogram(exact, prompt_ids, sampling, 300, vocab), joint) > 1e-3
    biased = flashmm.wrap(target, DraftModel(draft, max_draft_tokens=2, adaptive=False), linear="onednn",
                          verifier="typical_lossy", typical_epsilon=0.05, typical_delta=0.05)
    assert chi_square_pvalue(two_token_histogram(biased, prompt_ids, sampling, 300, vocab), joint) < 1e-3
