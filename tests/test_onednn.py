"""oneDNN linear routing: products checked in float64, routing scoped to tree forwards, output exact."""
import platform

import pytest
import torch

import flashmm
import flashmm.targets.onednn as onednn
from flashmm.drafters import MTP, DraftModel, Eagle3Drafter, Hydra, Medusa, PromptLookup
from flashmm.drafters.nets.eagle3_step import Eagle3Step
from flashmm.drafters.nets.hydra_net import HydraHeads
from flashmm.drafters.nets.mtp_net import MTPModules
from flashmm.targets.onednn import OneDNNLinears, resolve_linear_backend

from test_eagle3 import head_for
from test_heads import random_medusa
from text_models import VOCAB, prompt, tiny_lm

needs_onednn = pytest.mark.skipif(not onednn.onednn_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 13, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_product_matches_float64(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(96, 160, bias=bias)
    x = torch.randn(1, rows, 96)
    exact = x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)
    with torch.no_grad(), OneDNNLinears(layer) as routed:
        assert len(routed.routes) == 1
        y = layer(x)
        y_strided = layer(x.transpose(1, 2).contiguous().transpose(1, 2))  # same values, strided
    assert y.shape == (1, rows, 160) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=1e-5)
    torch.testing.assert_close(y_strided, y, rtol=0, atol=0)


@needs_onednn
def test_routes_only_plain_fp32_layers_and_restores_them():
    class Quantized(torch.nn.Linear):
        pass

    hooked = torch.nn.Linear(8, 8)
    hooked.forward = lambda x: x  # what an accelerate offload hook does: an instance forward
    model = torch.nn.ModuleDict(dict(plain=torch.nn.Linear(8, 8), sub=Quantized(8, 8), hooked=hooked,
                                     bf16=torch.nn.Linear(8, 8).to(torch.bfloat16)))
    routes = OneDNNLinears(model)
    assert [layer for layer, _ in routes.routes] == [model["plain"]]
    with routes:
        assert "forward" in model["plain"].__dict__
    assert "forward" not in model["plain"].__dict__
    assert model["hooked"].__dict__["forward"] is not None  # left as it was


def test_resolve_linear_backend():
    model = tiny_lm("llama")
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    expected = "onednn" if onednn.onednn_available() and x86 else "torch"
    assert resolve_linear_backend("auto", model) == expected
    assert resolve_linear_backend("torch", model) == "torch"
    with pytest.raises(ValueError, match="linear must be one of"):
        resolve_linear_backend("mkl", model)
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # the user switched oneDNN off: auto respects that
    try:
        assert resolve_linear_backend("auto", model) == "torch"
    finally:
        torch.backends.mkldnn.enabled = enabled
    model.to(torch.bfloat16)
    assert resolve_linear_backend("auto", model) == "torch"
    with pytest.raises(ValueError, match="needs an fp32 model on CPU"):
        resolve_linear_backend("onednn", model)


@needs_onednn
@pytest.mark.parametrize("arch", ["phi3", "gemma3"])
def test_forwards_route_through_onednn_and_stay_exact(arch, monkeypatch):
    """Every linear of the prefill and of every tree forward goes through oneDNN, and a draft LM's
    too; greedy output equals generate's; the layers are the model's own again afterwards;
    linear="torch" routes nothing. (Targets of the Llama families run the fused step instead:
    tests/test_fused.py; a Llama draft LM still routes its layers.)"""
    calls = []
    original, original_bf16 = onednn._onednn_linear, onednn._onednn_bf16_linear

    def counting(layer, weight, x):
        calls.append((layer, x.shape[-2]))
        return original(layer, weight, x)

    def counting_bf16(layer, weight, bias, x):   # a draft LM's, where bf16_kernels
        calls.append((layer, x.shape[-2]))
        return original_bf16(layer, weight, bias, x)

    monkeypatch.setattr(onednn, "_onednn_linear", counting)
    monkeypatch.setattr(onednn, "_onednn_bf16_linear", counting_bf16)
    model = tiny_lm(arch)
    own = {m for m in model.modules() if type(m) is torch.nn.Linear}
    ids = prompt(40, seed=3)
    reference = model.generate(ids, do_sample=False, max_new_tokens=24)
    draft = tiny_lm(arch, seed=5)
    for drafter in (DraftModel(draft, max_draft_tokens=4, tree_width=2, adaptive=False), PromptLookup()):
        sm = flashmm.wrap(model, drafter, linear="onednn")
        calls.clear()  # (wrap's self-check runs one tree forward: flashmm.targets.support)
        assert torch.equal(sm.generate(ids, max_new_tokens=24), reference)
        target_rows = [rows for layer, rows in calls if layer in own]
        assert len(target_rows) == len(own) * (1 + sm.last_stats.verify_steps)  # the prefill, then each tree
        assert target_rows[:len(own)] == [40] * (len(own) - 1) + [1]  # the prompt's 40 rows first (the head: the last)
        drafted = [layer for layer, _ in calls if layer not in own]
        assert bool(drafted) == isinstance(drafter, DraftModel)  # the draft LM multiplies as the target does
        assert not any("forward" in m.__dict__ for m in [*model.modules(), *draft.modules()])
    calls.clear()
    sm = flashmm.wrap(model, PromptLookup(), linear="torch")
    assert torch.equal(sm.generate(ids, max_new_tokens=24), reference)
    assert calls == []


def routed_calls(monkeypatch) -> list:
    """The layers multiplied through oneDNN from now on, in fp32 or in bf16 (a drafter's, bf16_kernels)."""
    calls = []
    fp32, bf16 = onednn._onednn_linear, onednn._onednn_bf16_linear
    monkeypatch.setattr(onednn, "_onednn_linear", lambda layer, weight, x: calls.append(layer) or fp32(layer, weight, x))
    monkeypatch.setattr(onednn, "_onednn_bf16_linear",
                        lambda layer, weight, bias, x: calls.append(layer) or bf16(layer, weight, bias, x))
    return calls


@needs_onednn
@pytest.mark.skipif(not onednn.bf16_kernels(), reason="oneDNN without bf16 kernels here")
@pytest.mark.parametrize("bias", [True, False])
def test_a_drafters_bf16_product_is_the_bf16_rounded_product(bias):
    """OneDNNLinears(bf16=True): fp32 in and out, the product of the bf16-rounded input and weights accumulated
    in fp32 and rounded to bf16 once (checked in float64: within 2^-8 of each output, plus the accumulation's
    rounding), and not the fp32 product; routing is undone on exit, and a drafter bound to a oneDNN target gets it."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 160, bias=bias)
    x = torch.randn(5, 96)
    rounded = x.bfloat16().double() @ layer.weight.bfloat16().double().T \
        + (layer.bias.bfloat16().double() if bias else 0)
    with torch.no_grad(), OneDNNLinears(layer, bf16=True) as routed:
        y = layer(x)
    assert routed.packed and y.dtype == torch.float32 and "forward" not in layer.__dict__
    bound = rounded.abs() * 2.0 ** -8 + 96 * 2.0 ** -23 * (x.double().abs() @ layer.weight.double().abs().T) + 1e-6
    assert ((y.double() - rounded).abs() <= bound).all()
    exact = x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)
    assert (y.double() - exact).abs().max() > 1e-4       # not an fp32 product
    target = flashmm.wrap(tiny_lm("llama"), "prompt_lookup", linear="onednn").target
    assert [r for _, r in onednn.routed_like(target, layer).routes][0].func is onednn._onednn_bf16_linear


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_without_onednns_bf16_kernels_a_drafters_product_keeps_fp32_inputs(monkeypatch, bias):
    """Where oneDNN has no bf16 kernels (AVX2) and flashmm's compiled kernel runs, a drafter still multiplies in bf16
    (bf16_drafting): its few rows on that kernel, more rows as the bf16-rounded weights' fp32 product through oneDNN.
    Both are the float64 product of the fp32 input and the bf16-rounded weight, to fp32 rounding."""
    monkeypatch.setattr(onednn, "_onednn_bf16", lambda: False)
    torch.manual_seed(1)
    layer = torch.nn.Linear(96, 160, bias=bias)
    for rows in (1, 9):                       # the kernel's one row, oneDNN's fp32 product of nine
        x = torch.randn(rows, 96)
        exact = x.double() @ layer.weight.bfloat16().double().T + (layer.bias.double() if bias else 0)
        bound = 96 * 2.0 ** -23 * (x.double().abs() @ layer.weight.double().abs().T) + 1e-6
        with torch.no_grad(), OneDNNLinears(layer, bf16=True):
            y = layer(x)
        assert y.dtype == torch.float32 and ((y.double() - exact).abs() <= bound).all()
        assert (y.double() - (x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0))).abs().max() > 1e-5


@needs_onednn
def test_an_eagle3_head_multiplies_as_the_target_does(monkeypatch):
    """On a target whose forwards run on oneDNN every linear of the EAGLE-3 head does too (on
    "torch" none does), its layers are their own again between drafts, and greedy output is generate's. Where
    the drafters multiply in bf16 on the compiled kernels, the head's layer runs there (Eagle3Step) and only
    its LM head through oneDNN."""
    calls = routed_calls(monkeypatch)
    model = tiny_lm("llama")
    net = head_for(model, list(range(3, VOCAB)), seed=1)
    head_layers = {m for m in net.modules() if type(m) is torch.nn.Linear}
    ids = prompt(12, seed=0)
    reference = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    for linear in ("onednn", "torch"):
        sm = flashmm.wrap(model, Eagle3Drafter(net, depth=3, top_k=3, adaptive=False), linear=linear)
        calls.clear()
        assert torch.equal(sm.generate(ids, max_new_tokens=16, eos_token_id=[]), reference)
        step = isinstance(sm.drafter._pass, Eagle3Step)
        routed = {net.lm_head} if step else head_layers
        assert set(calls) & head_layers == (routed if linear == "onednn" else set())
        assert not any("forward" in m.__dict__ for m in net.modules())


@needs_onednn
@pytest.mark.parametrize("family", ["medusa", "hydra", "mtp"])
def test_heads_multiply_as_the_target_does(family, monkeypatch):
    """Medusa / Hydra / MTP: the LM-head rows they predict (and their own linears) multiply through
    oneDNN while they draft on a oneDNN target, not on "torch"; greedy output is generate's."""
    calls = routed_calls(monkeypatch)
    model = tiny_lm("llama")
    d = model.config.hidden_size
    own = {m for m in model.modules() if type(m) is torch.nn.Linear}
    ids = prompt(12, seed=0)
    reference = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    for linear in ("onednn", "torch"):
        torch.manual_seed(0)
        drafter = {"medusa": lambda: Medusa(random_medusa(model), tree="static", max_draft_tokens=6, adaptive=False),
                   "hydra": lambda: Hydra(HydraHeads(d, 3), tree="static", max_draft_tokens=6, adaptive=False),
                   "mtp": lambda: MTP(MTPModules(d, 3, num_attention_heads=model.config.num_attention_heads,
                                                 num_key_value_heads=model.config.num_key_value_heads,
                                                 intermediate_size=model.config.intermediate_size),
                                      adaptive=False)}[family]()
        sm = flashmm.wrap(model, drafter, linear=linear)
        calls.clear()
        assert torch.equal(sm.generate(ids, max_new_tokens=16, eos_token_id=[]), reference)
        drafted = [layer for layer in calls if layer not in own]
        assert (drafter._lm_head in drafted) == (linear == "onednn")
        assert not any("forward" in m.__dict__ for m in [drafter._lm_head, *drafter.heads.modules()])


def test_falls_back_to_f_linear_for_autograd_and_other_dtypes():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16, requires_grad=True)
    with OneDNNLinears(layer):
        layer(x).sum().backward()  # the oneDNN op has no backward: this must take F.linear
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            y = layer(x.detach())
        with torch.no_grad(), pytest.raises(RuntimeError, match="dtype"):
            layer(x.detach().to(torch.bfloat16))  # another dtype: F.linear's own error, as unrouted
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(3, -1))
    assert y.dtype == torch.bfloat16  # autocast still applies


@needs_onednn
def test_nesting_leaves_the_outer_routing_in_place():
    layer = torch.nn.Linear(8, 8)
    with OneDNNLinears(layer):
        outer = layer.__dict__["forward"]
        inner = OneDNNLinears(layer)
        assert inner.routes == []
        with inner:
            pass
        assert layer.__dict__["forward"] is outer
    assert "forward" not in layer.__dict__


@needs_onednn
@pytest.mark.skipif(not onednn.can_pack(), reason="this torch cannot reorder weights for oneDNN")
def test_packed_weights_give_the_same_products_and_follow_weight_changes():
    """Packed (blocked-layout) weights multiply into the plain layout's products to fp32 rounding,
    for every row count, batched or not; a packed copy is made once and remade when the weight changes."""
    model = tiny_lm("llama")
    packed, plain = OneDNNLinears(model), OneDNNLinears(model, pack=False)
    assert packed.packed and not plain.packed
    with torch.no_grad():
        for shape in ((1, 1), (1, 5), (1, 40), (3, 7)):
            ids = torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(shape[1]))
            with packed:
                a = model(ids).logits
            with plain:
                b = model(ids).logits
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a, model(ids).logits, rtol=1e-5, atol=1e-5)  # MKL's, to rounding
    layer = model.lm_head
    first = onednn.packed_weight(layer)
    assert onednn.packed_weight(layer) is first  # kept
    with torch.no_grad():
        layer.weight.mul_(2.0)  # changed in place: packed again
    again = onednn.packed_weight(layer)
    assert again is not first
    x = torch.randn(4, layer.in_features)
    torch.testing.assert_close(onednn._onednn_linear(layer, again, x), x @ layer.weight.T, rtol=1e-4, atol=1e-4)
