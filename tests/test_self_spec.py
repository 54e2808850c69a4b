"""Self-speculation (LayerSkip, SWIFT, Kangaroo) and ProPD pruning: the layer runner equals the model's
own forward, drafting leaves the target's cache as it found it, and decoding is exact (greedy
token-identical to model.generate; sampling matches the target's distribution)."""
from functools import partial

import pytest
import torch

import flashmm
from flashmm.config import SamplingParams
from flashmm.drafters.kangaroo import Kangaroo
from flashmm.drafters.nets.kangaroo_net import KangarooAdapter
from flashmm.drafters.layerskip import LayerSkip, chain_tau, choose_exit_layer
from flashmm.drafters.swift import Swift
from flashmm.sampling import warp_logits
from flashmm.targets.base import SequenceStart
from flashmm.targets.cache import cache_argument
from flashmm.targets.layers import LayerRunner, check_supported
from flashmm.targets.onednn import can_pack, onednn_available
from flashmm.targets.prune import score_draft, unprune
from flashmm.tree.draft import Draft
from flashmm.tree.token_tree import TokenTree
from stats_utils import chi_square_pvalue
from text_models import prompt, ragged_batch, tiny_lm

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
    ref_cache = flashmm.targets.cache.new_cache()
    model(input_ids=ids, **{cache_argument(model): ref_cache}, use_cache=True)
    reference = model(input_ids=nodes, **{cache_argument(model): ref_cache}, use_cache=True,
                      attention_mask=tree.attention_bias(12, torch.float32),
                      position_ids=tree.positions(12)[None]).logits
    runner = LayerRunner(model)
    cache = flashmm.targets.cache.new_cache()
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
    cache2 = flashmm.targets.cache.new_cache()
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
    sm = flashmm.wrap(model, LayerSkip(adaptive=False, exit_layer=exit_layer, max_draft_tokens=3))
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False), greedy_reference(model, ids, 24))
    if exit_layer == 3:  # one layer short of the model: its early exit agrees often
        assert sm.last_stats.accepted_tokens > 0


def test_layerskip_leaves_the_target_cache_as_the_engine_left_it():
    model = deep("llama")
    sm = flashmm.wrap(model, LayerSkip(adaptive=False, exit_layer=2, max_draft_tokens=4))
    ids = prompt(9, seed=4)
    target, drafter = sm.target, sm.drafter
    _, seq = target.prefill(ids, None, False)
    committed = torch.cat([ids, torch.tensor([[7]])], 1)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in seq.kv.layers]
    drafter.begin(SequenceStart(input_ids=ids, target_cache=partial(target.drafting_cache, seq)))
    draft = drafter.propose(committed, 4, flashmm.config.SamplingParams(), None)
    assert draft.num_draft_tokens == 4
    for (k, v), layer in zip(before, seq.kv.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
    # the drafted chain is the E-layer greedy continuation, recomputed from scratch
    runner, text = LayerRunner(model), committed
    for token in draft.tokens[0, 1:].tolist():
        out = model(input_ids=text, output_hidden_states=True)
        assert int(runner.logits(out.hidden_states[2])[0, -1].argmax()) == token
        text = torch.cat([text, torch.tensor([[token]])], 1)


def test_exit_layer_choice_measures_exact_chain_acceptance():
    assert chain_tau([torch.tensor([True, True, False, True])], 2) == pytest.approx(1 + (2 + 1 + 0 + 1) / 4)
    model = deep("llama")
    text = greedy_reference(model, prompt(6, seed=5), 20)[0]
    choices = choose_exit_layer(model, [text], draft_tokens=(2,))
    assert sorted(c.exit_layer for c in choices) == [1, 2, 3]
    assert choices[0].speedup >= choices[-1].speedup
    # tau of E measured offline = what a greedy decode of the same text with LayerSkip(E) gets
    best = choices[0]
    sm = flashmm.wrap(model, LayerSkip(adaptive=False, exit_layer=best.exit_layer, max_draft_tokens=2))
    sm.generate(text[None, :6], max_new_tokens=14, do_sample=False)
    assert sm.last_stats.accepted_tokens > 0


def test_adaptive_pricing_declines_drafts_that_cost_a_whole_step():
    """Pricing values a draft token by the weights it reads: SWIFT skipping nothing costs a full
    target step per draft token, so it never drafts (plain decoding, exact); LayerSkip's first layer
    of four plus the LM head costs less, and its price is exactly that share of the weights."""
    model = deep("qwen3")
    sm = flashmm.wrap(model, Swift(skip=((), ()), max_draft_tokens=4, confidence=0.0))
    ids = prompt(10, seed=8)
    assert torch.equal(sm.generate(ids, max_new_tokens=12, do_sample=False), greedy_reference(model, ids, 12))
    assert sm.last_stats.drafted_tokens == 0 and sm.drafter.draft_token_cost() == pytest.approx(1.0)
    layerskip = LayerSkip(exit_layer=1)
    flashmm.wrap(model, layerskip)
    weights = lambda modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa: E731
    head = weights([model.lm_head])
    assert layerskip.draft_token_cost() == pytest.approx(
        (weights(model.model.layers[:1]) + head) / (weights(model.model.layers) + head))


# ---------------------------------------------------------------------------- SWIFT
def test_swift_searches_a_skip_set_and_decodes_greedy_identically():
    model = deep("llama")
    drafter = Swift(adaptive=False, search_budget=6, evals_per_step=2, random_trials=3, window=16, max_draft_tokens=3,
                    search_share=None)
    sm = flashmm.wrap(model, drafter)
    ids = prompt(12, seed=6)
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False), greedy_reference(model, ids, 24))
    assert len(drafter.trials) == 6 and not drafter.searching
    assert len(drafter.skip_attention) + len(drafter.skip_mlp) == round(0.45 * 8)
    best = max(drafter.trials, key=lambda t: t[1])[0]
    assert drafter.skip_attention == {i for i in range(4) if best[i]}  # the best set found is the one used
    # reused by the next request, which searches no more
    sm.generate(prompt(12, seed=7), max_new_tokens=8, do_sample=False)
    assert len(drafter.trials) == 6


def test_swift_pays_for_its_search_out_of_decoding_time():
    model = deep("llama")
    # a share no search step fits in: one step (nothing spent yet), then none until decoding pays
    drafter = Swift(adaptive=False, search_budget=6, evals_per_step=2, random_trials=3, window=16, max_draft_tokens=3,
                    search_share=1e-9)
    sm = flashmm.wrap(model, drafter)
    ids = prompt(12, seed=6)
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False), greedy_reference(model, ids, 24))
    assert len(drafter.trials) == 2 and drafter.searching
    assert drafter.decode_seconds > 0 and drafter.search_seconds > 1e-9 * drafter.decode_seconds
    # a share every step fits in spends the whole budget in the first request
    generous = Swift(adaptive=False, search_budget=6, evals_per_step=2, random_trials=3, window=16,
                     max_draft_tokens=3, search_share=1e9)
    flashmm.wrap(model, generous).generate(ids, max_new_tokens=24, do_sample=False)
    assert len(generous.trials) == 6
    with pytest.raises(ValueError, match="search_share"):
        Swift(search_share=0.0)


def test_swift_skipping_nothing_is_the_target_itself():
    model = deep("qwen3")
    drafter = Swift(adaptive=False, skip=((), ()), max_draft_tokens=4, confidence=0.0)
    sm = flashmm.wrap(model, drafter)
    ids = prompt(10, seed=8)
    assert torch.equal(sm.generate(ids, max_new_tokens=21, do_sample=False), greedy_reference(model, ids, 21))
    assert sm.last_stats.tau == 5.0  # every drafted token accepted
    window = ids[0]
    full = model(window[None]).logits[0].argmax(-1)
    assert drafter.matchness(window, full, (0,) * 8) == 1.0
    assert drafter.matchness(window, full, (1,) * 8) < 1.0


# ---------------------------------------------------------------------------- Kangaroo
def untrained_kangaroo(model, exit_layer=2, **options):
    adapter = KangarooAdapter(model)
    adapter.init_from(model, exit_layer)
    return Kangaroo(adapter.state_dict(), exit_layer=exit_layer, **{"adaptive": False, **options})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kangaroo_greedy_is_token_identical_and_its_adapter_cache_is_teacher_forced(arch):
    model = deep(arch)
    drafter = untrained_kangaroo(model, confidence=0.0, max_draft_tokens=3)
    sm = flashmm.wrap(model, drafter)
    ids = prompt(11, seed=9)
    out = sm.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, greedy_reference(model, ids, 20))
    assert sm.last_stats.accepted_tokens > 0
    # the adapter cache's committed rows equal the adapter run over the text's layer-2 states at once
    rows = drafter._chain_start
    states = model(out[:, :rows], output_hidden_states=True).hidden_states[2]
    reference = flashmm.targets.cache.new_cache()
    runner = LayerRunner(model)
    drafter.adapter(states, runner.rotary(states, torch.arange(rows)[None]), runner.causal_mask(rows, 0), reference)
    torch.testing.assert_close(drafter.adapter_cache.layers[0].keys[:, :, :rows], reference.layers[0].keys,
                               atol=1e-5, rtol=1e-5)


def test_kangaroo_saves_and_loads_through_drafter_json(tmp_path):
    model = deep("llama")
    untrained_kangaroo(model).save(tmp_path, {"method": "kangaroo", "drafter": "kangaroo", "target": "tiny"})
    loaded = flashmm.drafters.load(tmp_path, confidence=0.0)
    sm = flashmm.wrap(model, loaded)
    ids = prompt(8, seed=10)
    assert torch.equal(sm.generate(ids, max_new_tokens=12, do_sample=False), greedy_reference(model, ids, 12))
    with pytest.raises(ValueError, match="trained drafter"):
        flashmm.wrap(model, "kangaroo")
    with pytest.raises(ValueError, match="another target"):
        flashmm.wrap(tiny_lm("llama", num_hidden_layers=4, hidden_size=32), loaded)


# ---------------------------------------------------------------------------- sampling
V = 8
SAMPLING = dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95)
PROMPT = torch.tensor([[3, 7, 3, 7, 3]])


def exact_joint(target) -> torch.Tensor:
    params = SamplingParams(**SAMPLING)
    with torch.no_grad():
        first = warp_logits(target(PROMPT).logits[0, -1].double(), params).softmax(-1)
        ext = torch.cat([PROMPT.expand(V, -1), torch.arange(V)[:, None]], dim=1)
        second = warp_logits(target(ext).logits[:, -1].double(), params).softmax(-1)
    return first[:, None] * second  # [V, V]


def test_sampling_has_the_target_distribution():
    """Trials alternate LayerSkip and SWIFT (both chains of SelfDrafter): a mixture of exact methods has
    the target's distribution, and a bias in either shows in the histogram."""
    target = tiny_lm("llama", seed=1, vocab_size=V, num_hidden_layers=4, bos_token_id=None, eos_token_id=None,
                     pad_token_id=None)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.15)
    wrapped = [flashmm.wrap(target, LayerSkip(adaptive=False, exit_layer=2, max_draft_tokens=2)),
               flashmm.wrap(target, Swift(adaptive=False, skip=((1,), (2,)), max_draft_tokens=2, confidence=0.0))]
    counts, g = torch.zeros(V, V), torch.Generator().manual_seed(1234)
    for trial in range(400):
        a, b = wrapped[trial % 2].generate(PROMPT, max_new_tokens=2, generator=g, **SAMPLING)[0, -2:].tolist()
        counts[a, b] += 1
    assert all(sm.last_stats.drafted_tokens > 0 for sm in wrapped)
    p = chi_square_pvalue(counts, exact_joint(target))
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"


# ---------------------------------------------------------------------------- ProPD
def test_propd_scores_only_the_surviving_subtree_exactly():
    model = deep("qwen2")
    ids = prompt(10, seed=11)
    tree = TokenTree.from_parents([-1, 0, 0, 0, 1, 1, 2, 4])
    tokens = torch.tensor([[ids[0, -1].item(), 5, 9, 17, 33, 40, 41, 60]])
    spec = flashmm.config.SpecConfig(prune="propd", prune_layer=2, prune_top_k=3)
    sm = flashmm.wrap(model, "prompt_lookup", prune="propd", prune_layer=2, prune_top_k=3)
    target = sm.target
    _, seq = target.prefill(ids[:, :-1], None, False)
    draft = Draft(tokens=tokens, tree=tree)
    verified, scored = score_draft(target, seq, draft, False, spec, SamplingParams())
    # reference: the whole tree through the model, and its early exit after layer 2
    full_cache = flashmm.targets.cache.new_cache()
    model(input_ids=ids[:, :-1], **{cache_argument(model): full_cache}, use_cache=True)
    ref = model(input_ids=tokens, **{cache_argument(model): full_cache}, use_cache=True, output_hidden_states=True,
                attention_mask=tree.attention_bias(9, torch.float32), position_ids=tree.positions(9)[None])
    early_top = LayerRunner(model).logits(ref.hidden_states[2])[0].topk(3).indices
    parents = tree.parents.tolist()
    alive = [True] + [False] * 7
    for i in range(1, 8):
        alive[i] = alive[parents[i]] and tokens[0, i].item() in early_top[parents[i]].tolist()
    kept = [i for i in range(8) if alive[i]]
    assert scored.kept.tolist() == kept and 1 < len(kept) < 8 and verified.tree.num_nodes == len(kept)
    torch.testing.assert_close(scored.logits, ref.logits[:, kept], atol=1e-5, rtol=1e-5)
    assert verified.tree.parents.tolist() == [-1] + [kept.index(parents[i]) for i in kept[1:]]
    # every layer's cache holds the prefix then exactly the survivors' rows
    for mine, theirs in zip(seq.kv.layers, full_cache.layers):
        torch.testing.assert_close(mine.keys, theirs.keys[:, :, [*range(9), *[9 + i for i in kept]]],
                                   atol=1e-5, rtol=1e-5)
    # the drafter observes its own tree: path and logits mapped back
    path, back = unprune(scored, torch.tensor([[0, 1]]))  # early logits at every pruned node
    assert path.tolist() == [[0, kept[1]]] and back.logits.shape[1] == 8
    pruned = [i for i in range(8) if i not in kept]
    torch.testing.assert_close(back.logits[:, pruned], LayerRunner(model).logits(ref.hidden_states[2])[:, pruned],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 4])
def test_propd_greedy_is_token_identical_with_a_tree_drafter(top_k):
    model = deep("llama")
    drafter = flashmm.drafters.DraftModel(deep("llama", seed=1), tree_width=2, max_draft_tokens=6, adaptive=False)
    sm = flashmm.wrap(model, drafter, prune="propd", prune_layer=2, prune_top_k=top_k)
    ids = prompt(10, seed=12)
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False), greedy_reference(model, ids, 24))
    assert sm.last_stats.pruned_tokens > 0
    with pytest.raises(ValueError, match="prune must be"):
        flashmm.wrap(model, "prompt_lookup", prune="early")


def test_shipped_smollm2_kangaroo_is_an_adapter_only_folder():
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(__file__).resolve().parents[1] / "assets/text_drafters/smollm2/kangaroo"
    info = flashmm.drafters.saved.read_info(folder)
    assert info["method"] == "kangaroo" and info["exit_layer"] == 2
    assert info["command"].startswith("python -m flashmm.train kangaroo --target smollm2 ")
    weights = load_file(str(folder / "model.safetensors"))
    assert {k.split(".")[0] for k in weights} == {"input_norm", "self_attn", "post_norm"}  # no layers, no LM head
    assert all(w.dtype == torch.float16 for w in weights.values())
    assert (folder / "model.safetensors").stat().st_size < 30e6


def test_swift_stops_searching_when_its_best_set_could_not_pay():
    model = deep("llama")
    ids = prompt(12, seed=6)
    # a draft that costs as much as the target's forward never pays, whatever the matchness
    drafter = Swift(search_budget=12, evals_per_step=2, random_trials=4, window=16, max_draft_tokens=3,
                    search_share=None)
    sm = flashmm.wrap(model, drafter)
    drafter.draft_token_cost = lambda: 1.0
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False), greedy_reference(model, ids, 24))
    assert drafter.gave_up and len(drafter.trials) == 4 and not drafter.searching
    # free drafts pay at any matchness above zero: the search runs its whole budget
    free = Swift(search_budget=12, evals_per_step=2, random_trials=4, window=16, max_draft_tokens=3,
                 search_share=None)
    sm = flashmm.wrap(model, free)
    free.draft_token_cost = lambda: 0.0
    free.length.verify_cost = None  # the linear cost model: 1 + small per-token costs
    sm.generate(ids, max_new_tokens=24, do_sample=False)
    assert free.best_matchness > 0 and not free.gave_up and len(free.trials) == 12


# ---------------------------------------------------------------------------- batches, packed weights
PACKED = pytest.mark.skipif(not (onednn_available() and can_pack()),
                            reason="this torch has no oneDNN linear with packed weights")
SELF_DRAFTERS = {
    "layerskip": lambda model: LayerSkip(adaptive=False, exit_layer=2, max_draft_tokens=3),
    "swift": lambda model: Swift(adaptive=False, search_budget=6, evals_per_step=2, random_trials=3, window=16,
                                 max_draft_tokens=3, search_share=None),
    "kangaroo": lambda model: untrained_kangaroo(model, confidence=0.0, max_draft_tokens=3),
}


@PACKED
@pytest.mark.parametrize("method", sorted(SELF_DRAFTERS))
def test_self_speculation_decodes_a_ragged_batch_after_a_prompt_on_packed_weights(method):
    """Issue 42: after one prompt the target holds its linears packed for oneDNN, and a batch forked the
    drafter per row, deep-copying the target with them (NotImplementedError: Cannot access storage of
    OpaqueTensorImpl). Each row is now the model's own batched generate."""
    model = deep("llama")
    sm = flashmm.wrap(model, SELF_DRAFTERS[method](model), linear="onednn")
    ids = prompt(10, seed=3)
    assert torch.equal(sm.generate(ids, max_new_tokens=12, do_sample=False), greedy_reference(model, ids, 12))
    assert sm.target.linears().packed
    batch, mask = ragged_batch((13, 6, 9), seed=2)
    call = dict(attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert torch.equal(sm.generate(batch, **call), model.generate(batch, **call))


@PACKED
def test_a_fork_shares_the_target_and_its_weights_and_copies_per_row_state():
    model = deep("llama")
    drafter = untrained_kangaroo(model, confidence=0.0, max_draft_tokens=3)
    sm = flashmm.wrap(model, drafter, linear="onednn")
    sm.generate(prompt(10, seed=3), max_new_tokens=6, do_sample=False)  # the target's linears are packed now
    row = drafter.fork()
    # shared wherever the drafter holds them: the target (with its packed weights), the model's layers
    # (through the layer runner), the adapter
    assert row.target is sm.target and row.adapter is drafter.adapter
    assert row.runner.lm_head is model.lm_head and all(a is b for a, b in zip(row.runner.layers, model.model.layers))
    # copied: what one sequence learns and caches
    assert row.length is not drafter.length and row.adapter_cache is not drafter.adapter_cache
    before = drafter.length.alpha
    row.length.update(3, 0)
    assert drafter.length.alpha == before != row.length.alpha


def test_propd_decodes_a_batch_row_by_row_as_batched_generate():
    """ProPD prunes one sequence's tree: a padded batch decodes row by row (warned), each row equal to
    the model's own batched generate; the one loop refuses it for rows verified together, before any
    forward."""
    from text_models import ragged_batch

    model = deep("llama")
    drafter = flashmm.drafters.DraftModel(deep("llama", seed=1), tree_width=2, max_draft_tokens=6, adaptive=False)
    sm = flashmm.wrap(model, drafter, prune="propd", prune_layer=2, prune_top_k=4)
    ids, mask = ragged_batch((14, 9, 11))
    out = sm.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False))
    assert sm.last_stats.pruned_tokens > 0
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    decoding = flashmm.engine.loop.Decoding(sampling=SamplingParams(), max_new_tokens=4)
    with pytest.raises(ValueError, match="prune='propd'.*one by one"):
        flashmm.engine.loop.decode(sm.target, drafter, ids, [decoding] * 3, sm.spec, None, attention_mask=mask)
    assert not calls
