"""FLASH drafter: exactness through flashmm.wrap, drafting internals, compressors, persistence.

References: the target's own greedy ``generate`` (fp32), a from-scratch (non-incremental)
forward of the drafter's network over the whole sequence, brute-force enumeration of tree
paths, float64 formulas for the compressors.
"""
import itertools
import json
import math

import pytest
import torch

import flashmm
import flashmm.drafters.flash_batch
import flashmm.engine.loop
import flashmm.engine.pricing
from flashmm.drafters.flash import FlashDrafter
from flashmm.drafters.prompt_lookup import NgramIndex, PromptLookup
from flashmm.sampling import warp_logits
from flashmm.config import SamplingParams
from flashmm.drafters.nets.flash_modules import (FlashConfig, FlashNet, VisualCompressor, build_units,
                                                 merge_adjacent, unit_layout)
from flashmm.tree.draft import Draft
from flashmm.tree.token_tree import TokenTree
from flashmm.tree.trie import best_first_paths

import mm_models as mm
from flashmm.serve.collate import collate
from text_models import prompt, tiny_lm

MAX_NEW = 20
STATIC_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]


@pytest.fixture(scope="module")
def text_target():
    return tiny_lm("llama")


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def mm_case(request):
    model, processor = mm.tiny_vlm(request.param)
    inputs = mm.make_inputs(processor, request.param, images=1)
    reference = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return request.param, model, processor, inputs, reference


def drafter_for(model, k, **options):
    """A random FLASH drafter for ``model``. Unpriced unless ``pricing`` is given: whether measured pricing finds a
    random net's trees worth verifying depends on this machine's timings, and the exactness tests need drafts."""
    return FlashDrafter.from_target(model, num_queries=4, tokens_per_step=k, seed=0, **{"pricing": "none", **options})


# ----------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("tree", ["dynamic", "chain", "static"])
@pytest.mark.parametrize("prompt_len", [1, 17])
def test_greedy_exact_text(text_target, k, tree, prompt_len):
    ids = prompt(prompt_len, seed=prompt_len + k)
    sm = flashmm.wrap(text_target, drafter_for(text_target, k, tree=STATIC_TREE if tree == "static" else tree))
    out = sm.generate(ids, max_new_tokens=MAX_NEW)
    assert torch.equal(out, text_target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False))
    assert sm.last_stats.drafted_tokens > 0


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("compression", ["learned", "prune", "merge", "none"])
def test_greedy_exact_multimodal(mm_case, k, compression):
    kind, model, processor, inputs, reference = mm_case
    drafter = drafter_for(model, k, compression=compression)
    sm = flashmm.wrap(model, drafter, processor=processor)
    assert torch.equal(sm.generate(**inputs, max_new_tokens=MAX_NEW), reference)
    assert sm.last_stats.drafted_tokens > 0


class OracleFlash(FlashDrafter):
    """Drafts the known greedy continuation (so whole chains are accepted and observe() gets
    several features per step) and logs the drafter's own SAR predictions at each sync."""

    def setup(self, reference, chain):
        self.reference, self.chain, self.log = reference, chain, []
        return self

    def _sync(self, committed, root):
        predicted = super()._sync(committed, root)
        self.log.append((committed.clone(), predicted.clone()))
        return predicted

    def _make_draft(self, committed, dists, shape, chain, chain_values, max_tokens):
        n = committed.shape[1]
        cont = self.reference[0, n : n + self.chain].tolist()
        return Draft(tokens=committed.new_tensor([[int(committed[0, -1])] + cont]),
                     tree=TokenTree.chain(len(cont)), q_probs=None)


def full_recompute(drafter, model, committed, prompt_len, model_inputs, embeds_fn, spans):
    """The drafter net's prediction at the last unit, from scratch over the committed sequence."""
    n = committed.shape[1] - 1
    with torch.no_grad():
        feats = model(input_ids=committed, output_hidden_states=True, **model_inputs).hidden_states[-1][0]
        embeds = embeds_fn(committed)
        units, _ = build_units(drafter.net, feats[:n], embeds, n, spans, drafter.compression,
                               query=feats[prompt_len - 1])
        preds, _ = drafter.net(units[None], torch.arange(units.shape[0]), None)
    return preds[0, -1]


@pytest.mark.parametrize("k", [1, 3])
def test_incremental_state_matches_full_forward_text(text_target, k):
    ids = prompt(9, seed=4)
    reference = text_target.generate(ids, max_new_tokens=24, do_sample=False)
    drafter = OracleFlash(drafter_for(text_target, k).net, depth=7).setup(reference, chain=4)
    sm = flashmm.wrap(text_target, drafter, draft_precision="fp32")  # (the net in fp32, as the recompute)
    assert torch.equal(sm.generate(ids, max_new_tokens=24), reference)
    stats = sm.last_stats
    assert stats.accepted_tokens == stats.drafted_tokens and stats.tau > 4  # oracle chains all accepted
    embed = text_target.get_input_embeddings()
    for committed, predicted in drafter.log:
        expected = full_recompute(drafter, text_target, committed, ids.shape[1], {},
                                  lambda c: embed(c[0]), [])
        torch.testing.assert_close(predicted, expected, atol=1e-4, rtol=1e-4)


def test_prompt_prefill_skips_the_sar_head(text_target):
    """begin() only fills the drafter's cache: the first draft starts from the prefill's token."""
    drafter = drafter_for(text_target, 5)
    calls, after_begin = [], []
    hook = drafter.net.sar.register_forward_hook(lambda *args: calls.append(1))
    begin = drafter.begin
    drafter.begin = lambda start: (begin(start), after_begin.append(len(calls)))
    try:
        flashmm.wrap(text_target, drafter).generate(prompt(12, seed=5), max_new_tokens=8)
    finally:
        hook.remove()
    assert after_begin == [0] and calls  # none in the prefill, one per draft afterwards


def test_incremental_state_matches_full_forward_llava():
    model, processor = mm.tiny_vlm("llava")
    inputs = mm.make_inputs(processor, "llava", images=1)
    ids = inputs["input_ids"]
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    reference = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    drafter = OracleFlash(drafter_for(model, 5, compression="learned").net).setup(reference, chain=3)
    sm = flashmm.wrap(model, drafter, processor=processor, draft_precision="fp32")
    assert torch.equal(sm.generate(**inputs, max_new_tokens=16), reference)
    target = sm.target
    spans = target.visual_spans(ids)
    assert spans and spans[0][1] - spans[0][0] > 4  # a real span, compressed to 4 units
    for committed, predicted in drafter.log:
        expected = full_recompute(drafter, model, committed, ids.shape[1], media,
                                  lambda c: target.prompt_features(c, **media)[0][0], spans)
        torch.testing.assert_close(predicted, expected, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------- trees
def test_best_first_is_top_paths_by_probability():
    drafter = FlashDrafter(None)
    g = torch.Generator().manual_seed(0)
    depth, width, max_tokens = 4, 3, 11
    probs = torch.rand(depth, width, generator=g).sort(dim=-1, descending=True).values
    probs = (probs / probs.sum(-1, keepdim=True) * 0.9).tolist()
    chosen, chosen_scores = best_first_paths(probs, depth, max_tokens, drafter.min_path_prob)
    scores = {}
    for d in range(1, depth + 1):
        for path in itertools.product(range(width), repeat=d):
            scores[path] = math.prod(probs[i][r] for i, r in enumerate(path))
    best = sorted(scores, key=scores.get, reverse=True)[:max_tokens]
    assert set(chosen) == set(best)
    assert all(p[:-1] in set(chosen) or len(p) == 1 for p in chosen)  # prefix-closed
    assert chosen_scores == pytest.approx([scores[p] for p in chosen])
    assert chosen_scores == sorted(chosen_scores, reverse=True)      # best first: any prefix is the best of its size


def test_draft_is_a_product_tree(text_target):
    """Children of every node at depth j are the same top tokens of the depth-(j+1) distribution."""
    drafter = drafter_for(text_target, 5, tree="dynamic", top_k=3)
    seen = []
    original = drafter.propose

    def spy(*args, **kwargs):
        draft = original(*args, **kwargs)
        seen.append(draft)
        return draft

    drafter.propose = spy
    flashmm.wrap(text_target, drafter, max_draft_tokens=12).generate(prompt(10, 2), max_new_tokens=8)
    assert seen and all(d.q_probs is None for d in seen)
    for draft in seen:
        tree, tokens = draft.tree, draft.tokens[0].tolist()
        assert tree.num_nodes - 1 <= 12
        by_depth = {}
        for node in range(tree.num_nodes):
            kids = [tokens[c] for c in tree.children[node]]
            assert len(set(kids)) == len(kids)
            if kids:
                ref = by_depth.setdefault(int(tree.depth[node]), kids)
                n = min(len(ref), len(kids))
                assert ref[:n] == kids[:n]


def test_sampling_uses_tree_verifier_and_output_is_valid(text_target, monkeypatch):
    used = []
    real = flashmm.engine.loop.select_verifier

    def recording(name, do_sample, tree=None, backend="torch", **options):
        used.append((name, do_sample))
        return real(name, do_sample, tree, backend=backend, **options)

    monkeypatch.setattr(flashmm.engine.loop, "select_verifier", recording)
    drafter = drafter_for(text_target, 5, tree=STATIC_TREE)
    drafts = []
    original = drafter.propose
    drafter.propose = lambda *a, **kw: drafts.append(original(*a, **kw)) or drafts[-1]
    sm = flashmm.wrap(text_target, drafter, verifier="tree")
    sampling = dict(do_sample=True, temperature=0.8, top_k=5)
    ids = prompt(8, 5)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        out = sm.generate(ids, max_new_tokens=MAX_NEW, generator=g, **sampling)
        assert out.shape == (1, ids.shape[1] + MAX_NEW)
        with torch.no_grad():
            logits = text_target(out).logits[0, ids.shape[1] - 1 : -1]
        allowed = warp_logits(logits, SamplingParams(**sampling)).isfinite()
        emitted = out[0, ids.shape[1]:]
        assert bool(allowed[torch.arange(MAX_NEW), emitted].all())  # each token inside the target's top-5
    assert used and all(u == ("tree", True) for u in used)
    assert drafts and all(d.q_probs is None and not d.tree.is_chain for d in drafts)


# ----------------------------------------------------------------------------------- compressors
def test_learned_compression_formula():
    torch.manual_seed(0)
    comp = VisualCompressor(16, 4)
    feats = torch.randn(30, 16)
    expected = torch.softmax(comp.queries.double() @ feats.double().T / 4.0, dim=-1) @ feats.double()
    torch.testing.assert_close(comp(feats, "learned").double(), expected, atol=1e-6, rtol=1e-6)


def test_prune_keeps_top_scored_tokens_in_order():
    torch.manual_seed(1)
    comp = VisualCompressor(8, 5)
    feats, query = torch.randn(20, 8), torch.randn(8)
    scores = (feats @ query).tolist()
    keep = sorted(sorted(range(20), key=lambda i: -scores[i])[:5])
    assert torch.equal(comp(feats, "prune", query), feats[keep])
    assert torch.equal(comp(feats[:3], "prune", query), feats[:3])  # fewer tokens than C: all kept
    with pytest.raises(ValueError, match="query"):
        comp(feats, "prune")


def test_merge_adjacent_merges_duplicates_and_conserves_mass():
    torch.manual_seed(2)
    base = torch.randn(6, 8)
    feats = base.repeat_interleave(torch.tensor([3, 1, 2, 4, 1, 2]), dim=0)  # runs of equal tokens
    merged = merge_adjacent(feats, 6)
    torch.testing.assert_close(merged, base)  # identical neighbours merge first, nothing else does
    odd = torch.randn(37, 8)
    for target in (1, 5, 36):
        out = merge_adjacent(odd, target)
        assert out.shape == (target, 8)
    assert torch.equal(VisualCompressor(8, 64)(odd, "none"), odd)
    with pytest.raises(ValueError, match="compression"):
        VisualCompressor(8, 4)(odd, "pool")


def test_unit_layout():
    text = lambda *ts: [("text", t) for t in ts]  # noqa: E731
    assert unit_layout(8, []) == text(*range(8))
    # span [2, 5): units 2, 3 dropped; visual units between text 1 and text 4
    assert unit_layout(8, [(2, 5)]) == text(0, 1) + [("visual", 0)] + text(4, 5, 6, 7)
    # span at the start, and a span whose last unit is not yet known (prompt end)
    assert unit_layout(5, [(0, 2), (3, 6)]) == [("visual", 0)] + text(1, 2) + [("visual", 1)]
    with pytest.raises(ValueError, match="span"):
        unit_layout(4, [(3, 3)])


@pytest.mark.parametrize("compression", ["learned", "none"])
def test_pooled_spans_compress_each_group_once(compression):
    torch.manual_seed(3)
    cfg = FlashConfig(hidden_size=16, vocab_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      intermediate_size=32, num_queries=3, tokens_per_step=2)
    net = FlashNet(cfg).double()
    feats, embeds = torch.randn(15, 16, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64)
    spans = [(2, 5), (6, 9), (10, 12)]
    text = lambda *ts: net.text_units(embeds[[t + 1 for t in ts]], feats[list(ts)])  # noqa: E731
    group = lambda *js: net.visual_units(net.compressor(torch.cat([feats[s:e] for s, e in (spans[j] for j in js)]),
                                                       compression))  # noqa: E731
    # written out by hand from the layout rule: a group's units sit where its last span sits
    expected = {1: [text(0, 1), group(0), text(4, 5), group(1), text(8, 9), group(2), text(11, 12, 13)],
                2: [text(0, 1, 4, 5), group(0, 1), text(8, 9), group(2), text(11, 12, 13)],
                3: [text(0, 1, 4, 5, 8, 9), group(0, 1, 2), text(11, 12, 13)]}
    for pool, pieces in expected.items():
        units, text_pos = build_units(net, feats, embeds, 14, spans, compression, None, pool_spans=pool)
        torch.testing.assert_close(units, torch.cat(pieces), rtol=0, atol=0)
        assert text_pos[text_pos >= 0].tolist() == [0, 1, 4, 5, 8, 9, 11, 12, 13]
    with pytest.raises(ValueError, match="pool_spans"):
        build_units(net, feats, embeds, 14, spans, compression, None, pool_spans=0)


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_greedy_exact_with_pooled_images(kind):
    model, processor = mm.tiny_vlm(kind)
    inputs = mm.make_inputs(processor, kind, images=3)
    reference = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    units = {}
    for pool in (1, 2):
        drafter = drafter_for(model, 5, pool_spans=pool)
        sm = flashmm.wrap(model, drafter, processor=processor)
        assert torch.equal(sm.generate(**inputs, max_new_tokens=MAX_NEW), reference)
        assert sm.last_stats.drafted_tokens > 0
        units[pool] = drafter._num_units
    assert units[2] == units[1] - 4  # spans 0 and 1 share their C = 4 units


# ----------------------------------------------------------------------------------- persistence, binding
def test_save_load_round_trip_gives_identical_drafts(text_target, tmp_path):
    drafter = drafter_for(text_target, 3, tree=STATIC_TREE, compression="prune")
    drafter.save_pretrained(tmp_path)
    loaded = FlashDrafter.from_pretrained(tmp_path)
    assert loaded.net.cfg == drafter.net.cfg and loaded.drafting_options() == drafter.drafting_options()
    for key, value in drafter.net.state_dict().items():
        assert torch.equal(loaded.net.state_dict()[key], value)
    assert not any("lm_head" in k or "embed" in k for k in loaded.net.state_dict())  # head not copied

    def drafts_of(d):
        log = []
        original = d.propose
        d.propose = lambda *a, **kw: log.append(original(*a, **kw)) or log[-1]
        flashmm.wrap(text_target, d).generate(prompt(12, 9), max_new_tokens=12)
        return [(x.tokens.tolist(), x.tree.parents.tolist()) for x in log]

    assert drafts_of(drafter) == drafts_of(loaded)
    assert FlashDrafter(str(tmp_path)).net.cfg == drafter.net.cfg  # a path works as `net`
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        FlashDrafter.from_pretrained(tmp_path / "missing")
    # one resolver: flashmm.drafters.load opens the folder (drafter.json written beside it, and without it)
    info = json.loads((tmp_path / "drafter.json").read_text())
    assert info["method"] == info["drafter"] == "flash" and info["target"]["hidden_size"] == drafter.net.cfg.hidden_size
    assert drafts_of(flashmm.drafters.load(tmp_path)) == drafts_of(drafter)
    (tmp_path / "drafter.json").unlink()
    assert flashmm.drafters.load(tmp_path, max_draft_tokens=2).max_draft_tokens == 2


def test_bind_rejects_other_targets(text_target):
    drafter = drafter_for(text_target, 5)
    for other in (tiny_lm("llama", hidden_size=32), tiny_lm("llama", vocab_size=200)):
        with pytest.raises(ValueError, match="built for a target with hidden size 64 and vocabulary 128"):
            flashmm.wrap(other, drafter)


def test_from_target_sizes_from_text_config():
    model, _ = mm.tiny_vlm("llava")
    cfg = FlashDrafter.from_target(model, num_queries=7, tokens_per_step=2).net.cfg
    text = model.config.get_text_config()
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 1)
    assert cfg.vocab_size == model.get_output_embeddings().weight.shape[0] == text.vocab_size
    assert (cfg.num_queries, cfg.tokens_per_step) == (7, 2)
    assert FlashConfig.from_dict(cfg.to_dict()) == cfg


def test_untrained_default_is_built_at_bind(text_target):
    with pytest.warns(UserWarning, match="untrained"):
        sm = flashmm.wrap(text_target, "flash", allow_untrained=True)
    ids = prompt(6, 1)
    assert torch.equal(sm.generate(ids, max_new_tokens=6), text_target.generate(ids, max_new_tokens=6, do_sample=False))



@pytest.mark.parametrize("k", [1, 5])
def test_draft_vocab_is_lossless_and_only_drafts_its_tokens(text_target, k):
    """A head restricted to a token subset drafts only those tokens, scores them exactly as the full
    head does, and the output stays identical to the target's own greedy generate."""
    vocab = list(range(0, 128, 3))
    full, sub = drafter_for(text_target, k), drafter_for(text_target, k, draft_vocab=vocab[::-1] + [0])
    assert sub.draft_vocab == tuple(vocab)  # sorted, deduplicated
    drafts = []
    original = sub.propose
    sub.propose = lambda *a, **kw: drafts.append(original(*a, **kw)) or drafts[-1]
    ids = prompt(14, 4 + k)
    out = flashmm.wrap(text_target, sub).generate(ids, max_new_tokens=MAX_NEW)
    assert torch.equal(out, text_target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False))
    assert drafts and all(set(d.tokens[0, 1:].tolist()) <= set(vocab) for d in drafts)
    # the restricted head's rows are the full head's rows
    flashmm.wrap(text_target, full).generate(ids, max_new_tokens=1)
    rows = torch.tensor(vocab)
    assert torch.equal(sub._head.weight, full._head.weight[rows])
    with pytest.raises(ValueError, match="vocabulary has 128 tokens"):
        flashmm.wrap(text_target, drafter_for(text_target, k, draft_vocab=[1, 500]))


@pytest.mark.parametrize("bad, match", [(dict(compression="zip"), "compression"), (dict(tree="bushy"), "tree"),
                                        (dict(tree=[[0], []]), "non-empty"), (dict(depth=0), "depth"),
                                        (dict(top_k=0), "top_k"), (dict(draft_vocab=[]), "draft_vocab"),
                                        (dict(draft_vocab=[-1, 2]), "draft_vocab"),
                                        (dict(pool_spans=0), "pool_spans"), (dict(tree="sequoia"), "accept"),
                                        (dict(accept=[0.7, 0.5]), "accept"), (dict(pricing="ample"), "pricing")])
def test_option_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        FlashDrafter(None, **bad)


# ----------------------------------------------------------------------------------- lookup branch
def lz77_reference(ids, max_tokens, max_ngram=3, min_ngram=2):
    """Latest match of the longest tail n-gram, continued one token at a time from the growing text."""
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        starts = [s for s in range(len(ids) - n) if ids[s:s + n] == ids[len(ids) - n:]]
        if starts:
            text = list(ids)
            for i in range(max_tokens):
                text.append(text[starts[-1] + n + i])
            return text[len(ids):], n
    return [], 0


def test_lookup_continuation_is_an_overlapping_copy():
    g = torch.Generator().manual_seed(0)
    finder = PromptLookup(max_ngram=3, min_ngram=2)
    for trial in range(300):
        ids = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        assert finder.find(ids, 7) == lz77_reference(ids, 7), ids
    assert finder.find([9, 1, 2, 1, 2], 6) == ([1, 2, 1, 2, 1, 2], 2)  # period 2 drafts past the text's end


def test_incremental_ngram_index_matches_the_brute_force_lookup():
    """NgramIndex (what PromptLookup and FLASH's lookup branch use: O(new tokens) per step) gives
    the brute-force continuation after every growth of the text, and rebuilds on a text it did
    not index."""
    g = torch.Generator().manual_seed(1)
    for trial in range(60):
        index, ids = NgramIndex(3, 2), []
        for step in range(25):
            ids += torch.randint(0, 4, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
            index.sync(torch.tensor([ids]))
            assert index.continuation(7) == lz77_reference(ids, 7), ids
        index.sync(torch.tensor([[3, 1, 2, 0, 1, 2]]))  # not an extension: rebuilt
        assert index.continuation(3) == lz77_reference([3, 1, 2, 0, 1, 2], 3)


def ancestors(parents, node):
    while parents[node] > 0:
        node = parents[node]
        yield node


def token_paths(draft):
    tokens, parents = draft.tokens[0].tolist(), draft.tree.parents.tolist()
    paths = {0: ()}
    for node in range(1, len(tokens)):
        paths[node] = paths[parents[node]] + (tokens[node],)
    return paths


@pytest.mark.parametrize("chain, max_tokens", [([5, 6, 7, 8, 9, 10], 16), ([0, 1, 7, 8], 16), ([0, 1, 7, 8], 6),
                                               ([0, 9], 3), ([], 5), ([9, 9, 9, 9, 9, 9, 9, 9], 4)])
def test_lookup_chain_merges_into_the_flash_tree(chain, max_tokens):
    """The draft holds every prefix of the (max_tokens-trimmed) chain, otherwise only FLASH nodes, and the
    FLASH nodes it keeps are the highest-priority ones; siblings are distinct; within max_tokens."""
    drafter = FlashDrafter(None, top_k=2, max_draft_tokens=8, lookup_tokens=8)
    vocab, depth = 12, 3
    g = torch.Generator().manual_seed(1)
    dists = torch.rand(depth, vocab, generator=g)
    dists[:, :2] += torch.tensor([2.0, 1.0])   # ranks 0 / 1 are tokens 0 / 1 at every depth
    dists = dists / dists.sum(-1, keepdim=True)
    committed = torch.tensor([[3, 4]])
    shape = ("dynamic", depth, min(max_tokens, 8))
    chain_values = [0.9 * 0.8 ** j for j in range(len(chain))]
    draft = drafter._make_draft(committed, dists, shape, list(chain), chain_values, max_tokens)
    paths = token_paths(draft)
    nodes = list(paths.values())[1:]
    assert len(nodes) == len(set(nodes)) <= max_tokens                         # distinct siblings, within the cap
    top_p, top_ids = dists.topk(2, dim=-1)
    priority = [tuple(int(top_ids[i][r]) for i, r in enumerate(p))
                for p in best_first_paths(top_p.tolist(), depth, min(max_tokens, 8), drafter.min_path_prob)[0]]
    kept_chain = [tuple(chain[:i]) for i in range(1, len(chain) + 1) if tuple(chain[:i]) in set(nodes)]
    assert kept_chain == [tuple(chain[:i]) for i in range(1, len(kept_chain) + 1)]
    assert len(kept_chain) == min(len(chain), max_tokens)                      # the whole chain, or what fits
    flash_only = [p for p in nodes if p not in set(kept_chain)]
    assert set(flash_only) <= set(priority)
    others = [p for p in priority if p not in set(kept_chain)]
    assert set(flash_only) == set(others[:len(flash_only)])                     # highest priority kept
    # best first, every node after its parent, valued at the larger of its path probability and the chain's
    values, parents = draft.values.tolist(), draft.tree.parents.tolist()
    assert values[0] == 1.0 and values == sorted(values, reverse=True)
    assert all(parents[i] < i for i in range(1, len(parents)))
    prob = {tuple(int(top_ids[i][r]) for i, r in enumerate(p)): math.prod(float(top_p[i][r]) for i, r in enumerate(p))
            for p in best_first_paths(top_p.tolist(), depth, 64)[0]}
    on_chain = {tuple(chain[:i]): chain_values[i - 1] for i in range(1, len(chain) + 1)}
    for node, path in list(paths.items())[1:]:
        own = max(prob.get(path, 0.0), on_chain.get(path, 0.0))
        assert values[node] == pytest.approx(min([own] + [values[a] for a in ancestors(parents, node)]))


@pytest.mark.parametrize("k, lookup", [(1, "ngram"), (5, "ngram"), (5, "suffix")])
def test_lookup_branch_greedy_exact_and_drafts_past_the_sar_depth(text_target, k, lookup):
    ids = torch.cat([prompt(6, seed=3)] * 3, dim=1)                            # a repeated phrase
    drafter = drafter_for(text_target, k, lookup_tokens=8, lookup=lookup)
    drafts = []
    original = drafter.propose
    drafter.propose = lambda *a, **kw: drafts.append(original(*a, **kw)) or drafts[-1]
    sm = flashmm.wrap(text_target, drafter, max_draft_tokens=12)
    out = sm.generate(ids, max_new_tokens=MAX_NEW)
    assert torch.equal(out, text_target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False))
    assert all(d.num_draft_tokens <= 12 for d in drafts)
    assert any(d.tree.max_depth > 5 for d in drafts)                           # the lookup path goes deeper


# ----------------------------------------------------------------------------------- Sequoia trees, measured pricing
ACCEPT = [0.5, 0.2, 0.1, 0.05]


def cost_of(relative):
    """A VerifyCost whose t(n) / t(1) is relative(n) for n = 1..64."""
    from flashmm.tree.cost import VerifyCost  # noqa: PLC0415

    return VerifyCost(tuple(range(1, 65)), tuple(0.01 * relative(n) for n in range(1, 65)))


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("tree, pricing", [("sequoia", "none"), ("sequoia", "measured"), ("dynamic", "measured")])
def test_greedy_exact_with_sequoia_trees_and_measured_pricing(text_target, k, tree, pricing):
    ids = prompt(9, seed=k)
    drafter = drafter_for(text_target, k, tree=tree, accept=ACCEPT, pricing=pricing)
    sm = flashmm.wrap(text_target, drafter)
    out = sm.generate(ids, max_new_tokens=MAX_NEW)
    assert torch.equal(out, text_target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False))
    assert drafter.cost_source == pricing


def test_sequoia_tree_is_the_dynamic_programme_of_its_vector():
    from flashmm.tree.cost import best_paying_sequoia_tree  # noqa: PLC0415
    from flashmm.tree.shapes import sequoia_tree  # noqa: PLC0415

    drafter = FlashDrafter(None, tree="sequoia", accept=ACCEPT)
    _, tree = sequoia_tree(ACCEPT, 11, 5)
    assert drafter.sequoia_paths(10, 5) == tree.rank_paths()           # not priced: all 10 nodes
    # measured: a forward of n tokens costing 1 + 0.25 (n - 1) one-token forwards
    drafter.verify_cost = cost_of(lambda n: 1 + 0.25 * (n - 1))
    drafter._sequoia = {}
    n, tree, rate = best_paying_sequoia_tree(ACCEPT, drafter.verify_cost, 11, 5)
    paths = drafter.sequoia_paths(10, 5)
    assert paths == tree.rank_paths() and len(paths) == n - 1 < 10
    # by enumeration of the node counts: expected tokens per unit of verify time is largest at n
    rates = [(1 + sequoia_tree(ACCEPT, m, 5)[0]) / (1 + 0.25 * (m - 1)) for m in range(1, 12)]
    assert max(range(1, 12), key=lambda m: rates[m - 1]) == n and rate == pytest.approx(max(rates))


@pytest.mark.parametrize("slope, expected", [(0.0, 6), (0.25, 2), (10.0, 0)])
def test_measured_pricing_keeps_the_paying_prefix_of_best_first_nodes(slope, expected):
    drafter = FlashDrafter(None, pricing="measured")
    drafter.verify_cost = cost_of(lambda n: 1 + slope * (n - 1))
    scores = [0.6, 0.35, 0.2, 0.1, 0.05, 0.01]
    # (1 + sum of the first n scores) / (1 + slope n): free nodes all pay, dear ones none
    rates = [(1 + sum(scores[:n])) / (1 + slope * n) for n in range(7)]
    assert drafter._paying_prefix(scores) == max(range(7), key=lambda n: (rates[n], -n)) == expected


def test_unpaying_tree_drafts_nothing_and_stays_exact(text_target):
    ids = prompt(9, seed=3)
    drafter = drafter_for(text_target, 5, tree="dynamic", pricing="measured")
    sm = flashmm.wrap(text_target, drafter)
    drafter.verify_cost = cost_of(lambda n: 1 + 10.0 * (n - 1))  # what bind measured, overridden: no node pays
    out = sm.generate(ids, max_new_tokens=MAX_NEW)
    assert torch.equal(out, text_target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False))
    assert sm.last_stats.drafted_tokens == 0


def test_calibration_prices_nodes_by_a_power_of_their_path_probability():
    scores = [0.6, 0.35, 0.2, 0.1, 0.05, 0.01]
    slope = 0.25
    for gamma in (0.5, 1.0, 2.0):
        drafter = FlashDrafter(None, pricing="measured", calibration=gamma)
        drafter.verify_cost = cost_of(lambda n: 1 + slope * (n - 1))
        rates = [(1 + sum(s ** gamma for s in scores[:n])) / (1 + slope * n) for n in range(7)]
        assert drafter._paying_prefix(scores) == max(range(7), key=lambda n: (rates[n], -n))
    # underconfident probabilities raised to γ < 1 buy more nodes than taken at face value
    low, face = FlashDrafter(None, pricing="measured", calibration=0.5), FlashDrafter(None, pricing="measured")
    low.verify_cost = face.verify_cost = cost_of(lambda n: 1 + slope * (n - 1))
    assert low._paying_prefix(scores) > face._paying_prefix(scores)
    with pytest.raises(ValueError, match="calibration"):
        FlashDrafter(None, calibration=0.0)


@pytest.mark.parametrize("gamma", [0.8, 1.5])
def test_calibration_fit_recovers_the_power_that_generated_the_outcomes(gamma):
    """eval/flash_sequoia_vector.fit_calibration on outcomes drawn with P(rank r) = q_r^γ exactly."""
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
    from flash_sequoia_vector import fit_calibration  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        q = torch.distributions.Dirichlet(torch.full((200,), 0.5)).sample((4000,))
    q = q.sort(-1, descending=True).values[:, :8]                           # [N, 8] draft probabilities
    accept = (q.double() ** gamma)                                          # [N, 8], each row sums below 1
    assert float(accept.sum(-1).max()) < 1
    u = torch.rand(len(q), generator=g, dtype=torch.float64)[:, None]
    rank = (u >= accept.cumsum(-1)).sum(-1)                                 # 8: none of the top 8
    outcomes = list(zip(q.tolist(), rank.tolist()))
    assert fit_calibration(outcomes, 8) == pytest.approx(gamma, abs=0.06)


# ----------------------------------------------------------------------------------- a batch's rows together
def test_extend_rows_computes_each_rows_extend():
    """Rows with pasts of 0, 3 and 7 units and 1, 4 and 2 new units, padded into one forward: each row's
    predicted features and present keys / values are what its own ``extend`` gives."""
    net = FlashDrafter.from_target(tiny_lm("llama"), num_queries=4, tokens_per_step=3, seed=0).net.eval()
    g = torch.Generator().manual_seed(5)
    d = net.cfg.hidden_size
    pasts, units = [], []
    with torch.no_grad():
        for past_len, new in ((0, 1), (3, 4), (7, 2)):
            past = net.extend(torch.randn(1, past_len, d, generator=g), None, predict=False)[1] if past_len else None
            pasts.append(past)
            units.append(torch.randn(new, d, generator=g))
        predicted, presents = net.extend_rows(units, pasts)
        for b, (row, past) in enumerate(zip(units, pasts)):
            want, want_present = net.extend(row[None], past)
            torch.testing.assert_close(predicted[b], want[0, -1], rtol=1e-5, atol=1e-5)
            for got, expected in zip(presents[b], want_present):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [dict(lookup_tokens=4), dict(tree="chain", depth=5),
                                     dict(tree=[[0], [1], [0, 0], [0, 0, 0], [0, 1]], lookup_tokens=3, lookup="suffix"),
                                     dict(pricing="measured", max_draft_tokens=6)],
                         ids=["dynamic_lookup", "chain", "static_suffix", "priced"])
def test_a_batch_drafts_its_rows_together_as_each_row_would(monkeypatch, options):
    """Batched FLASH drafting (propose_batch: one net pass for every row) against the same ragged batch
    (an image, text only, two images) drafted row by row: the same draft at every step, and the model's
    own batched generate."""
    model, processor = mm.tiny_vlm("llava")
    rows = [mm.make_inputs(processor, "llava", images=1, text="Describe this picture in detail, please."),
            mm.make_inputs(processor, "llava", images=0, text="Hi."),
            mm.make_inputs(processor, "llava", images=2, text="Compare them.")]
    batch = collate(rows, processor.tokenizer.pad_token_id)
    reference = model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False)
    drafter = drafter_for(model, 3, **options)
    propose_rows = flashmm.engine.loop.propose_rows
    # (the batch's pause, a batch-wide decision row-by-row drafting cannot take, is tested on its own below)
    monkeypatch.setattr(flashmm.drafters.flash_batch, "paused", lambda drafters: False)

    def run():
        drafts = []

        def recording(*args):
            out = propose_rows(*args)
            drafts.append([(d.tokens.tolist(), d.tree.parents.tolist()) for d in out])
            return out
        monkeypatch.setattr(flashmm.engine.loop, "propose_rows", recording)
        out = flashmm.wrap(model, drafter, processor=processor).generate(**batch, max_new_tokens=MAX_NEW)
        return out, drafts
    together, drafted_together = run()
    monkeypatch.setattr(FlashDrafter, "propose_batch", None)
    apart, drafted_apart = run()
    assert torch.equal(together, reference) and torch.equal(apart, reference)
    assert drafted_together == drafted_apart and len(drafted_together) > 2


def test_a_batch_whose_drafts_are_all_cut_pauses_the_nets_passes(monkeypatch):
    """When the batch's cut leaves no row a drafted node, FLASH's net stops running for 1, 2, 4 .. steps (its rows'
    units wait and join in one pass); decoding stays the model's own batched generate."""
    model, processor = mm.tiny_vlm("llava")
    rows = [mm.make_inputs(processor, "llava", images=1, text="Describe this picture in detail, please."),
            mm.make_inputs(processor, "llava", images=0, text="Hi.")]
    batch = collate(rows, processor.tokenizer.pad_token_id)
    reference = model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False)
    passes, drafting = [], flashmm.drafters.flash_batch.draft_rows
    monkeypatch.setattr(flashmm.drafters.flash_batch, "draft_rows", lambda *a: passes.append(1) or drafting(*a))
    monkeypatch.setattr(flashmm.engine.pricing.BatchPricing, "fit", lambda self, drafters, drafts, critical=None: [
        drafter.cut(d, 1) if d.tree.num_nodes > 1 else d for drafter, d in zip(drafters, drafts)])
    sm = flashmm.wrap(model, drafter_for(model, 3), processor=processor)
    assert torch.equal(sm.generate(**batch, max_new_tokens=MAX_NEW), reference)
    steps = sm.last_stats.verify_steps // 2
    assert sm.last_stats.drafted_tokens == 0 and steps >= 8
    assert len(passes) <= 4 < steps  # the net's passes at steps 1, 3, 6, 11 (pauses of 1, 2, 4)
    # every draft kept (whether the batch's measured pricing keeps a random net's drafts depends on the machine)
    monkeypatch.setattr(flashmm.engine.pricing.BatchPricing, "fit", lambda self, drafters, drafts, critical=None: drafts)
    passes.clear()
    assert torch.equal(sm.generate(**batch, max_new_tokens=MAX_NEW), reference)
    assert len(passes) == sm.last_stats.verify_steps // 2  # drafts kept: a pass every step
