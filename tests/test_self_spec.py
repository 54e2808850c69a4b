"""Self-speculation (LayerSkip, SWIFT, Kangaroo) and ProPD pruning: the layer runner equals the model's
own forward, drafting leaves the target's cache as it found it, and decoding is exact (greedy
token-identical to model.generate; sampling matches the target's distribution)."""
import pytest
import torch

import flashmm
from flashmm.drafters.layerskip import LayerSkip, chain_tau, choose_exit_layer
from flashmm.targets.layers import LayerRunner, check_supported
from flashmm.tree import TokenTree
from text_models import prompt, tiny_lm

torch.set_num_threads(1)
FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def deep(arch: str, layers: int = 4, seed: int = 0):
    return tiny_lm(arch, seed=seed, num_hidden_layers=layers)


@pytest.mark.parametrize("arch", FAMILIES)
def test_layer_runner_equals_model_forward_on_a_tree_after_a_cached_prefix(arch):
    model = deep(arch)
    ids = prompt(12, seed=1)
    tree = TokenTree.from_parents([-1, 0, 0, 1, 1, 2])
    nodes = torch.tensor([[5, 9, 17, 33, 40, 41]])
    # reference: the model's own forward of the prefix, then of the tree with a 4D mask
    ref_cache = flashmm.cache.new_cache()
    model(input_ids=ids, past_key_values=ref_cache, use_cache=True)
    reference = model(input_ids=nodes, past_key_values=ref_cache, use_cache=True,
                      attention_mask=tree.attention_bias(12, torch.float32),
                      position_ids=tree.positions(12)[None]).logits
    runner = LayerRunner(model)
    cache = flashmm.cache.new_cache()
    pos = torch.arange(12)[None]
    # the prefix in two slices of layers, the tree in two slices with an early-exit read between
    hidden = runner.run(runner.embed(ids), 0, 2, cache, runner.causal_mask(12, 0), pos)
    hidden = runner.run(hidden, 2, 4, cache, runner.causal_mask(12, 0), pos)
    mask, tpos = runner.tree_mask(tree, 12), tree.positions(12)[None]
    hidden = runner.run(runner.embed(nodes), 0, 3, cache, mask, tpos)
    logits = runner.logits(runner.run(hidden, 3, 4, cache, mask, tpos))
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
    for a, b in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
    # the early exit equals norm + head on output_hidden_states[3]
    full = model(input_ids=torch.cat([ids, nodes[:, :1]], 1), output_hidden_states=True)
    early = model.lm_head(model.model.norm(full.hidden_states[3]))[:, -1]
    cache2 = flashmm.cache.new_cache()
    runner.run(runner.embed(ids), 0, 3, cache2, runner.causal_mask(12, 0), pos)
    one = runner.logits(runner.run(runner.embed(nodes[:, :1]), 0, 3, cache2, None, torch.tensor([[12]])))[:, -1]
    torch.testing.assert_close(one, early, atol=1e-5, rtol=1e-5)


def test_layer_runner_refuses_other_families_naming_the_supported_ones():
    with pytest.raises(ValueError, match="llama.*mistral.*qwen2.*qwen3"):
        check_supported(tiny_lm("gemma3"))
    with pytest.raises(ValueError, match="supports the decoder-only families"):
        flashmm.wrap(tiny_lm("phi3"), "layerskip")


def test_skipping_every_sublayer_of_a_layer_equals_running_without_it():
    model = deep("llama")
    runner = LayerRunner(model)
    ids = prompt(8, seed=2)
    mask, pos = runner.causal_mask(8, 0), torch.arange(8)[None]
    skipped = runner.run(runner.embed(ids), 0, 4, None, mask, pos, skip_attention={1, 2}, skip_mlp={1, 2})
    direct = runner.run(runner.run(runner.embed(ids), 0, 1, None, mask, pos), 3, 4, None, mask, pos)
    torch.testing.assert_close(skipped, direct)
    assert not torch.allclose(runner.run(runner.embed(ids), 0, 4, None, mask, pos, skip_mlp={2}), skipped)


def greedy_reference(model, ids, n):
    return model.generate(ids, max_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("arch, exit_layer", [("llama", 1), ("mistral", 2), ("qwen2", 3), ("qwen3", 3)])
def test_layerskip_greedy_is_token_identical(arch, exit_layer):
    model = deep(arch)
    ids = prompt(10, seed=3)
    sm = flashmm.wrap(model, LayerSkip(exit_layer=exit_layer, max_draft_tokens=3))
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False), greedy_reference(model, ids, 24))
    if exit_layer == 3:  # one layer short of the model: its early exit agrees often
        assert sm.last_stats.accepted_tokens > 0


def test_layerskip_leaves_the_target_cache_as_the_engine_left_it():
    model = deep("llama")
    sm = flashmm.wrap(model, LayerSkip(exit_layer=2, max_draft_tokens=4))
    ids = prompt(9, seed=4)
    target, drafter = sm.target, sm.drafter
    target.prefill(ids, None, False)
    committed = torch.cat([ids, torch.tensor([[7]])], 1)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in target.kv_cache.layers]
    draft = drafter.propose(committed, 4, flashmm.config.SamplingParams(), None)
    assert draft.num_draft_tokens == 4
    for (k, v), layer in zip(before, target.kv_cache.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
    # the drafted chain is the E-layer greedy continuation, recomputed from scratch
    runner, text = LayerRunner(model), committed
    for token in draft.tokens[0, 1:].tolist():
        out = model(input_ids=text, output_hidden_states=True)
        assert int(runner.logits(out.hidden_states[2])[0, -1].argmax()) == token
        text = torch.cat([text, torch.tensor([[token]])], 1)
    target.release()


def test_exit_layer_choice_measures_exact_chain_acceptance():
    assert chain_tau([torch.tensor([True, True, False, True])], 2) == pytest.approx(1 + (2 + 1 + 0 + 1) / 4)
    model = deep("llama")
    text = greedy_reference(model, prompt(6, seed=5), 20)[0]
    choices = choose_exit_layer(model, [text], draft_tokens=(2,))
    assert sorted(c.exit_layer for c in choices) == [1, 2, 3]
    assert choices[0].speedup >= choices[-1].speedup
    # tau of E measured offline = what a greedy decode of the same text with LayerSkip(E) gets
    best = choices[0]
    sm = flashmm.wrap(model, LayerSkip(exit_layer=best.exit_layer, max_draft_tokens=2))
    sm.generate(text[None, :6], max_new_tokens=14, do_sample=False)
    assert sm.last_stats.accepted_tokens > 0
