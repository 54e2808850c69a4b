"""The screened LM head (flashmm.targets.head_screen) against float64 products: its bound holds, its argmax is the
exact product's (near-ties included), a head without the bound's margin gets near-ties wrong, and greedy decoding
uses it only where nothing but the argmax is read."""
import pytest
import torch

import flashmm
from flashmm.targets.head_screen import ArgmaxHead
from flashmm.targets.onednn import bf16_kernels

from text_models import prompt, tiny_lm

pytestmark = pytest.mark.skipif(not bf16_kernels(), reason="oneDNN without bf16 kernels here")


def near_ties(vocab: int = 4096, width: int = 576, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [vocab, width], positions [64, width]) where each position's two best rows are closer than bf16
    resolves: rows 2i and 2i + 1 differ by 2e-5 noise (bf16's spacing at their scale is 2.4e-4), and position i
    prefers the pair i by a wide margin, so only fp32 products can order the pair."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, width, generator=g) * 0.05
    weight[1::2] = weight[0::2] + torch.randn(vocab // 2, width, generator=g) * 2e-5
    positions = torch.randn(64, width, generator=g)
    positions += 3.0 * weight[0:128:2] / weight[0:128:2].norm(dim=1, keepdim=True) * positions.norm(dim=1, keepdim=True)
    return weight, positions


def separated_argmax(weight: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float64 products' argmax [N], where it leads the runner-up by more than fp32 rounding [N] bool)."""
    exact = x.double() @ weight.double().T
    top2 = exact.topk(2, dim=1)
    return top2.indices[:, 0], (top2.values[:, 0] - top2.values[:, 1]) > 1e-5 * exact.abs().amax(1)


def test_the_bound_holds_and_the_argmax_is_the_float64_products():
    """On a random head at SmolLM2's scale and on near-ties: every screened value is within its bound of the
    float64 product, and every position's argmax is the float64 argmax wherever that argmax is separated from
    the runner-up by more than fp32 rounding."""
    g = torch.Generator().manual_seed(1)
    cases = [(torch.randn(8192, 576, generator=g) * 0.07, torch.randn(40, 576, generator=g) * 4), near_ties()]
    for weight, x in cases:
        head = ArgmaxHead(weight)
        screened, bound = head.screened(x)
        assert ((screened.double() - x.double() @ weight.double().T).abs() <= bound.double()).all()
        want, separated = separated_argmax(weight, x)
        assert separated.sum() >= 32
        assert torch.equal(head(x).argmax(1)[separated], want[separated])


def test_the_screen_alone_gets_near_ties_wrong():
    """The bf16 screen's own argmax (a head without the bound and the fp32 products) picks the wrong row of
    well-separated near-ties, so the test above can fail."""
    weight, x = near_ties()
    want, separated = separated_argmax(weight, x)
    screened, _ = ArgmaxHead(weight).screened(x)
    assert (screened.argmax(1)[separated] != want[separated]).sum() >= 5


def screen_calls(monkeypatch) -> list[int]:
    """The positions of every screened-head call from now on, one entry a call."""
    calls = []
    original = ArgmaxHead.__call__
    monkeypatch.setattr(ArgmaxHead, "__call__", lambda self, x: calls.append(x.shape[0]) or original(self, x))
    return calls


def test_greedy_decoding_screens_only_where_the_argmax_is_all_that_is_read(monkeypatch):
    """A greedy generate on the fused step verifies through the screened head and is generate's; asked for
    its logits (output_logits) or with a processor (repetition_penalty) it never screens, and the logits it
    returns are the model's own."""
    model = tiny_lm("llama", seed=0)
    ids = prompt(24, seed=4)
    calls = screen_calls(monkeypatch)
    sm = flashmm.wrap(model, "prompt_lookup")
    want = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False), want) and calls
    calls.clear()
    reference = model.generate(ids, max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True)
    out = sm.generate(ids, max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert calls == [] and torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(reference.logits), rtol=1e-4, atol=1e-4)
    penalised = model.generate(ids, max_new_tokens=24, do_sample=False, repetition_penalty=1.3)
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False, repetition_penalty=1.3), penalised)
    assert calls == []


def test_a_plain_greedy_generate_on_the_screened_step_is_generate(monkeypatch):
    """FusedForward(argmax_only=True), the benchmarks' plain_onednn baseline for greedy decoding, runs the screened
    head and decodes generate's tokens."""
    from flashmm.targets.fused import FusedForward

    model = tiny_lm("llama", seed=2)
    ids = prompt(16, seed=5)
    calls = screen_calls(monkeypatch)
    want = model.generate(ids, max_new_tokens=20, do_sample=False)
    with FusedForward(model, argmax_only=True):
        got = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(got, want) and len(calls) >= 19
