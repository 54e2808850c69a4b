"""Drafters' passes on the compiled kernels (flashmm.drafters.nets.kernel_layer): the EAGLE-3 head's
(eagle3_step) and FLASH's (flash_step) against their own nets computed in float64 with the same bf16-rounded
weights: outputs and caches, a pass that writes into the room behind the last pass's cache, one given a shorter
cache (a tree's units given up), a full room grown, a prompt's pass that takes the net's forward; and drafters
bound to a CPU target draft through them, greedy output the target's."""
import copy

import pytest
import torch

import flashmm
import flashmm.targets.onednn
from flashmm.drafters import Eagle3Drafter
from flashmm.drafters.flash import FlashDrafter
from flashmm.drafters.nets import eagle3_step, flash_step, kernel_layer
from flashmm.drafters.nets.eagle3_net import Eagle3Config, Eagle3Net
from flashmm.drafters.nets.flash_modules import FlashConfig, FlashNet

from text_models import prompt, tiny_lm

pytestmark = pytest.mark.skipif(eagle3_step.unavailable(Eagle3Net(Eagle3Config(
    64, 64, 4, 2, 16, 128, 100, 32, (0, 1, 1)))) is not None, reason="the compiled kernels do not run here")


def bf16_reference(net: torch.nn.Module) -> torch.nn.Module:
    """``net`` in float64 with its linear weights rounded to bf16 (what the kernels multiply)."""
    reference = copy.deepcopy(net).double()
    for module in reference.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.to(torch.bfloat16).double()
    return reference


def nets(seed: int = 0) -> tuple[Eagle3Net, Eagle3Net]:
    """(a random head, the same head in float64 with its weights rounded to bf16: the reference)."""
    torch.manual_seed(seed)
    net = Eagle3Net(Eagle3Config(hidden_size=64, target_hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, intermediate_size=128, vocab_size=100, draft_vocab_size=32,
                                 feature_layers=(0, 1, 1))).eval()
    for norm in (net.midlayer.input_layernorm, net.midlayer.hidden_norm, net.midlayer.post_attention_layernorm,
                 net.norm):
        norm.weight.data.uniform_(0.5, 1.5)
    reference = copy.deepcopy(net).double()
    for module in reference.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.to(torch.bfloat16).double()
    return net, reference


def units(count: int, past: int, wide: bool, seed: int):
    """(embeds [1, T, d], features [1, T, 3D or d], positions [1, T], a causal mask [1, T, P + T])."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, count, 64, generator=g)
    features = torch.randn(1, count, 192 if wide else 64, generator=g)
    mask = torch.ones(1, count, past + count, dtype=torch.bool)
    mask[0, :, past:] = torch.tril(mask[0, :, past:])
    return embeds, features, torch.arange(past, past + count)[None], mask


def reference_pass(reference: Eagle3Net, batch, past):
    embeds, features, positions, mask = batch
    past = None if past is None else tuple(t.double() for t in past)
    out, present = reference(embeds.double(), features.double(), positions, mask, past)
    return out, present


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-4 * float(b.abs().max()))


@torch.no_grad()
def test_passes_equal_the_net_in_float64_and_write_behind_their_cache():
    net, reference = nets()
    step = eagle3_step.Eagle3Step(net)
    prompt_units = units(kernel_layer.MAX_UNITS + 6, 0, wide=True, seed=1)  # the net's own forward
    out, past = step(*prompt_units)
    assert torch.equal(out, net(*prompt_units)[0])
    ref_past = tuple(t.double() for t in past)
    committed = units(3, past[0].shape[2], wide=True, seed=2)             # committed units: new room
    out, past = step(*committed, past)
    ref_out, ref_past = reference_pass(reference, committed, ref_past)
    assert close(out, ref_out) and close(past[0], ref_past[0]) and close(past[1], ref_past[1])
    room = past[0]._base
    drafted = units(4, past[0].shape[2], wide=False, seed=3)              # a tree's level: written behind them
    out, tree = step(*drafted, past)
    ref_tree_out, _ = reference_pass(reference, drafted, ref_past)
    assert tree[0]._base is room and close(out, ref_tree_out)
    more = units(2, past[0].shape[2], wide=True, seed=4)                  # the tree given up: its rows reused
    out, past = step(*more, past)
    ref_out, ref_past = reference_pass(reference, more, ref_past)
    assert past[0]._base is room and close(out, ref_out) and close(past[1], ref_past[1])
    assert close(step.norm(out), reference.norm(ref_out))


@torch.no_grad()
def test_a_full_room_is_grown_with_its_rows():
    net, reference = nets(1)
    step = eagle3_step.Eagle3Step(net)
    past, ref_past = None, None
    for i in range(kernel_layer.ROOM_BLOCK // 40 + 2):                    # past the first room's capacity
        batch = units(40, 0 if past is None else past[0].shape[2], wide=True, seed=i)
        out, past = step(*batch, past)
        ref_out, ref_past = reference_pass(reference, batch, ref_past)
        assert close(out, ref_out) and close(past[0], ref_past[0])


def test_a_drafter_on_a_cpu_target_drafts_through_it_and_stays_exact(monkeypatch):
    target = tiny_lm("llama")
    torch.manual_seed(0)
    net = Eagle3Net(Eagle3Config.for_target(target.config, 64, (0, 1, 1))).eval()
    net.set_vocab(torch.arange(64))
    if not flashmm.targets.onednn.bf16_drafting():
        pytest.skip("drafters multiply in fp32 here (neither oneDNN's bf16 kernels nor flashmm's run)")
    calls = []
    forward = eagle3_step.Eagle3Step.forward
    monkeypatch.setattr(eagle3_step.Eagle3Step, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    ids = prompt(12)
    sm = flashmm.wrap(target, Eagle3Drafter(net, adaptive=False))  # "auto": bf16 here
    out = sm.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, target.generate(ids, max_new_tokens=24, do_sample=False))
    assert sm.last_stats.drafted_tokens > 0 and len(calls) >= sm.last_stats.verify_steps


# ----------------------------------------------------------------------------------------------- FLASH
def flash_nets(seed: int = 0) -> tuple[FlashNet, FlashNet]:
    torch.manual_seed(seed)
    net = FlashNet(FlashConfig(hidden_size=64, vocab_size=100, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, intermediate_size=128, num_queries=4, tokens_per_step=3)).eval()
    for norm in (net.block.input_norm, net.block.post_norm):
        norm.weight.data.uniform_(0.5, 1.5)
    return net, bf16_reference(net)


@torch.no_grad()
def test_flash_passes_equal_the_net_in_float64():
    net, reference = flash_nets()
    step = flash_step.FlashStep(net)
    g = torch.Generator().manual_seed(0)
    prompt_units = torch.randn(1, kernel_layer.MAX_UNITS + 3, 64, generator=g)   # the net's own extend
    predicted, past = step.extend(prompt_units, None, predict=False)
    assert predicted is None and torch.equal(past[0], net.extend(prompt_units, None, predict=False)[1][0])
    ref_past = tuple(t.double() for t in past)
    rooms = set()
    for count in (3, 1, 5, 2):                                                     # committed units, step by step
        units = torch.randn(1, count, 64, generator=g)
        predicted, past = step.extend(units, past)
        ref_predicted, ref_past = reference.extend(units.double(), ref_past)
        rooms.add(past[0]._base.data_ptr())
        assert close(predicted, ref_predicted) and close(past[0], ref_past[0]) and close(past[1], ref_past[1])
    assert len(rooms) == 1                                                         # one room, written behind


def test_a_flash_drafter_on_a_cpu_target_drafts_through_it_and_stays_exact(monkeypatch):
    if not flashmm.targets.onednn.bf16_drafting():
        pytest.skip("drafters multiply in fp32 here (neither oneDNN's bf16 kernels nor flashmm's run)")
    target = tiny_lm("llama")
    calls = []
    extend = flash_step.FlashStep.extend
    monkeypatch.setattr(flash_step.FlashStep, "extend", lambda self, *a, **k: calls.append(1) or extend(self, *a, **k))
    ids = prompt(12)
    sm = flashmm.wrap(target, FlashDrafter.from_target(target, num_queries=4, tokens_per_step=3, seed=0,
                                                       pricing="none"))
    out = sm.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, target.generate(ids, max_new_tokens=24, do_sample=False))
    assert sm.last_stats.drafted_tokens > 0 and len(calls) >= sm.last_stats.verify_steps
