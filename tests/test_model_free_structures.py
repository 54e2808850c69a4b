"""The data structures behind the model-free drafters, against brute force: the suffix trie of
SuffixDecoding, REST's suffix array and retrieval, Token Recycling's matrix on disk, trie merging
(graph-structured drafting) and the tree sizer that stops drafting when it does not pay."""
from collections import Counter

import numpy as np
import pytest
import torch

import flashmm
from flashmm.drafters import Rest, SuffixDecoding, TokenRecycling
from flashmm.drafters.base import SequenceStart, StepResult
from flashmm.drafters.rest import Datastore, read_documents, suffix_array
from flashmm.drafters.suffix import SuffixTrie
from flashmm.sampling import SamplingParams
from flashmm.tree.trie import DraftTrie, TreeSizer, shadow_accepted

from text_models import prompt, tiny_lm


def test_suffix_trie_counts_every_substring():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 4, n).tolist() for n in (30, 1, 17, 45)]
    trie = SuffixTrie(max_depth=6)
    for doc in docs:
        state = trie.new_document()
        for k in range(0, len(doc), 7):  # appended in pieces, as a sequence grows
            state = trie.extend(state, doc[k : k + 7])
    brute = Counter(tuple(d[i : i + n]) for d in docs for n in range(1, 7) for i in range(len(d) - n + 1))
    seen = {}

    def walk(node, path):
        for token, child in trie.children[node].items():
            seen[path + (token,)] = trie.count[child]
            walk(child, path + (token,))

    walk(0, ())
    assert seen == dict(brute)
    context = docs[2][:9]
    node, p = trie.longest_match(context, max_match=5)
    # brute force: the longest suffix (<= 5) that occurs followed by some token
    followed = {tuple(d[i : i + n]) for d in docs for n in range(1, 6) for i in range(len(d) - n)}
    best = max((n for n in range(1, 6) if tuple(context[-n:]) in followed), default=0)
    assert p == best and trie.find(context[-p:]) == node
    paths = trie.grow(node, 50)
    assert paths
    for path, score in paths:  # score = Π count(prefix + token) / Σ over the prefix's continuations
        expected, prefix = 1.0, tuple(context[-p:])
        for token in path:
            siblings = sum(c for key, c in brute.items() if len(key) == len(prefix) + 1 and key[:-1] == prefix)
            expected *= brute[prefix + (token,)] / siblings
            prefix += (token,)
        assert score == pytest.approx(expected)


def test_suffix_lookup_follows_the_most_frequent_continuation_of_the_longest_match():
    """SuffixLookup (FLASH's lookup="suffix"): the longest matched context suffix in the current text
    or earlier outputs, then the most frequent child at every step; the current text wins a tie."""
    from flashmm.drafters.suffix import SuffixLookup  # noqa: PLC0415

    outputs = SuffixTrie()
    earlier = SuffixLookup(outputs, [])
    earlier.sync(torch.tensor([[7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 9, 2, 5]]))    # an earlier output
    lookup = SuffixLookup(outputs, [4, 7, 8, 3, 6, 7, 8])
    assert lookup.continuation(4) == ([3, 6, 7, 8], 2)                        # "7 8": the prompt wins the tie
    lookup.sync(torch.tensor([[4, 7, 8, 3, 6, 7, 8, 9]]))
    assert lookup.continuation(4) == ([2, 7, 8, 9], 3)                        # "7 8 9": earlier outputs, 2 > 1
    assert SuffixLookup(SuffixTrie(), [1, 2]).continuation(3) == ([], 0)


def test_suffix_array_and_retrieval_match_brute_force():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 5, 400)
    tokens[rng.integers(0, 400, 12)] = -1  # document separators
    array = suffix_array(tokens)
    assert array.tolist() == sorted(range(len(tokens)), key=lambda i: tokens[i:].tolist())
    store = Datastore(tokens)
    for _ in range(50):
        pattern = rng.integers(0, 5, int(rng.integers(1, 5))).tolist()
        brute = [i for i in range(len(tokens)) if tokens[i : i + len(pattern)].tolist() == pattern]
        assert sorted(store.occurrences(pattern).tolist()) == brute
    context = rng.integers(0, 5, 20).tolist()
    lo, hi, p = store.longest_match(context, max_match=6)
    hits = [i for i in range(len(tokens)) if tokens[i : i + p].tolist() == context[-p:]]
    assert hits and not any(tokens[i : i + p + 1].tolist() == context[-p - 1 :] for i in range(len(tokens)))
    assert sorted(store.array[lo:hi].tolist()) == hits


@pytest.mark.parametrize("size, depth, max_match", [(600, 3, 8), (6000, 5, 2)])
def test_datastore_tree_growth_matches_brute_force_counts(size, depth, max_match):
    """Datastore.longest_match / grow against a scan of the corpus: the longest occurring context
    suffix, and every continuation prefix (up to max_depth, cut at separators) with score = its
    share of the occurrences, best first, each extending one before it; a sampled range counts every
    k-th occurrence. The larger corpus's short matches have ranges of ~1,000 occurrences: grow reads them a
    depth at a time, dropping runs that cannot reach the best max_nodes."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 4, size)
    tokens[rng.integers(0, size, size // 30)] = -1
    store = Datastore(tokens)
    for trial in range(20):
        context = rng.integers(0, 4, 12).tolist()
        lo, hi, p = store.longest_match(context, max_match=max_match, min_match=1)
        occurs = [n for n in range(1, max_match + 1)
                  if any(tokens[i:i + n].tolist() == context[-n:] for i in range(size))]
        assert p == max(occurs, default=0)
        if p == 0:
            continue
        hits = sorted(int(i) for i in store.array[lo:hi])
        assert hits == [i for i in range(size) if tokens[i:i + p].tolist() == context[-p:]]
        counts = Counter()
        for i in hits:
            follow = tokens[i + p:i + p + depth].tolist()
            follow = follow[:follow.index(-1)] if -1 in follow else follow
            counts.update(tuple(follow[:d]) for d in range(1, len(follow) + 1))
        grown = store.grow(lo, hi, p, max_nodes=10_000, max_depth=depth)
        assert {tuple(path): score for path, score in grown} == pytest.approx(
            {path: c / len(hits) for path, c in counts.items()})
        assert [score for _, score in grown] == sorted((score for _, score in grown), reverse=True)
        for k in (4, 24):
            top = store.grow(lo, hi, p, max_nodes=k, max_depth=depth)
            assert [score for _, score in top] == pytest.approx(
                [c / len(hits) for c in sorted(counts.values(), reverse=True)[:k]])  # the k most frequent
            assert all(counts[tuple(path)] == round(score * len(hits)) for path, score in top)
            before = set()
            for path, _ in top:                                     # each path extends one returned before
                assert len(path) == 1 or tuple(path[:-1]) in before
                before.add(tuple(path))
        sampled = store.grow(lo, hi, p, max_nodes=10_000, max_depth=1, max_occurrences=max(1, len(hits) // 2))
        every = store.array[lo:hi:-(-len(hits) // max(1, len(hits) // 2))] + p
        firsts = Counter(int(tokens[i]) for i in every if i < size and tokens[i] != -1)
        assert {path: score for path, score in ((tuple(a), b) for a, b in sampled)} == pytest.approx(
            {(t,): c / len(every) for t, c in firsts.items()})


def test_rest_from_corpus_files(tmp_path):
    """Token files and flashmm corpus records (answers' ids) become documents; save/load round trip."""
    np.save(tmp_path / "a.npy", np.array([5, 6, 7, -1, 8, 9]))
    (tmp_path / "b.jsonl").write_text('{"greedy": {"ids": [1, 2, 3], "text": "x", "finished": true}, '
                                      '"sampled": [{"ids": [4], "text": "y", "finished": true}]}\n{"ids": [7, 7]}\n')
    assert read_documents(tmp_path / "a.npy") == [[5, 6, 7], [8, 9]]
    assert read_documents(tmp_path / "b.jsonl") == [[1, 2, 3], [4], [7, 7]]
    rest = Rest.from_corpus([tmp_path / "a.npy", tmp_path / "b.jsonl"])
    assert rest.datastore.tokens.tolist() == [5, 6, 7, -1, 8, 9, -1, 1, 2, 3, -1, 4, -1, 7, 7, -1]
    rest.save(tmp_path / "store.safetensors")
    again = Rest(datastore=tmp_path / "store.safetensors")
    assert np.array_equal(again.datastore.array, rest.datastore.array)
    with pytest.raises(ValueError, match="tokenizer"):
        (tmp_path / "c.txt").write_text("hello")
        Rest.from_corpus([tmp_path / "c.txt"])


def test_a_compact_datastore_builds_its_suffix_array_once(tmp_path, monkeypatch):
    """save(compact=True) keeps the tokens alone (int32); the first load builds the suffix array the
    full file holds and caches it, a later load reads the cache and builds nothing."""
    from flashmm.drafters import rest as rest_module  # noqa: PLC0415

    monkeypatch.setenv("FLASHMM_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 6, size=int(rng.integers(1, 9))).tolist() for _ in range(40)]
    flat = [t for doc in docs for t in doc + [-1]]
    full = Rest(rest_module.Datastore(np.array(flat)))
    full.save(tmp_path / "full.safetensors")
    full.save(tmp_path / "compact.safetensors", compact=True)
    assert (tmp_path / "compact.safetensors").stat().st_size < 0.3 * (tmp_path / "full.safetensors").stat().st_size
    first = Rest(datastore=tmp_path / "compact.safetensors").datastore
    assert first.tokens.tolist() == flat and np.array_equal(first.array, full.datastore.array)
    assert len(list((tmp_path / "cache").glob("suffix_array_*.npz"))) == 1

    def refuse(tokens):
        raise AssertionError("the cached suffix array should have been read")
    monkeypatch.setattr(rest_module, "suffix_array", refuse)
    again = Rest(datastore=tmp_path / "compact.safetensors").datastore
    assert np.array_equal(again.array, full.datastore.array)
    assert again.occurrences([1, 2]).tolist() == full.datastore.occurrences([1, 2]).tolist()


def test_token_recycling_matrix_persists_and_round_trips(tmp_path):
    target = tiny_lm("llama", seed=0)
    drafter = TokenRecycling()
    sm = flashmm.wrap(target, drafter)
    ids = prompt(20, seed=3)
    sm.generate(ids, max_new_tokens=30)
    first = sm.last_stats
    seen = drafter.successors[:, 0] >= 0
    assert int(seen.sum()) >= 10
    # each scored token's row holds the target's top-k after it (checked on the last new token's parent)
    out = sm.generate(ids, max_new_tokens=30)
    assert sm.last_stats.tau > first.tau  # the second call drafts from what the first taught
    drafter.save(tmp_path / "tr.safetensors")
    loaded = TokenRecycling.load(tmp_path / "tr.safetensors")
    assert torch.equal(loaded.successors, drafter.successors)
    fresh = flashmm.wrap(target, loaded)
    assert torch.equal(fresh.generate(ids, max_new_tokens=30), out)
    assert fresh.last_stats.tau > first.tau


def test_token_recycling_rows_are_the_target_top_k():
    """After a step, the row of each scored node's input token is the target's top-k at that node."""
    target = tiny_lm("llama", seed=0)
    drafter = TokenRecycling()
    sm = flashmm.wrap(target, drafter)
    ids = prompt(20, seed=8)
    out = sm.generate(ids, max_new_tokens=12, eos_token_id=[])
    text = out[0].tolist()
    # the root of every step was a committed token scored at its own position; the last row written
    # for a token that appears once in the output is its top-k in context
    once = [i for i in range(ids.shape[1], len(text) - 1) if text.count(text[i]) == 1]
    assert once
    logits = target(out).logits[0]
    for i in once:
        assert drafter.successors[text[i]].tolist() == logits[i].topk(drafter.score_topk).indices.tolist()


def test_merging_shares_prefixes():
    merged, separate = DraftTrie(), DraftTrie(merge=False)
    hypotheses = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    for g, h in enumerate(hypotheses):
        merged.add(h, 0.5, group=g)
        separate.add(h, 0.5, group=g)
    assert len(merged) - 1 == 6 and len(separate) - 1 == 9  # 1,2 shared by three hypotheses
    draft = merged.to_draft(torch.tensor([[9]]), merged.ranked())
    paths = {tuple(draft.tokens[0, p].tolist()[1:]) for p in draft.tree.paths}
    assert paths == {(1, 2, 3), (1, 2, 4), (1, 5), (6,)}


def test_pricing_stops_drafting_what_is_rejected():
    """A datastore whose continuations the target never writes: drafting stops after a few steps
    (and the output stays exact)."""
    target = tiny_lm("llama", seed=0)
    ids = prompt(16, seed=2)
    plain = target.generate(ids, max_new_tokens=80, do_sample=False, eos_token_id=None)[0].tolist()
    # every token of the output followed by a token the target does not write next
    wrong = []
    for i in range(len(plain) - 1):
        wrong += [plain[i], (plain[i + 1] + 1) % 128, (plain[i + 1] + 2) % 128, -1]
    rest = Rest(Datastore(np.asarray(wrong)), min_match=1)
    rest.pricing = "constants"  # a tiny model's measured verify cost is flat: drafting would be free
    sm = flashmm.wrap(target, rest)
    out = sm.generate(ids, max_new_tokens=80, eos_token_id=[])
    assert out[0].tolist() == plain
    stats = sm.last_stats
    drafting_steps = stats.drafted_at_depth[1]
    assert stats.accepted_tokens == 0 and 0 < drafting_steps <= 14, drafting_steps  # of 79 steps


def test_shadow_accepted_reads_the_committed_text():
    """A shadow's accepted length is its deepest path the committed text follows; undecided while
    a longer path could still match."""
    paths = [(5,), (5, 6), (5, 6, 7), (8,)]
    assert shadow_accepted(paths, [5, 6, 9]) == 2
    assert shadow_accepted(paths, [8]) == 1 and shadow_accepted(paths, [3, 4, 4]) == 0
    assert shadow_accepted(paths, [5, 6]) is None and shadow_accepted(paths, []) is None
    assert shadow_accepted(paths, [5, 6, 7, 1]) == 3


def test_plain_steps_teach_the_sizer_through_shadows():
    """A drafter whose hypotheses stopped paying resumes as soon as the text it declined to draft
    starts matching them (no costly retries); without the text it only drifts back by idle decay."""
    trie = DraftTrie()
    trie.add([1, 2, 3, 4], [0.9, 0.8, 0.7, 0.6])
    sizer = TreeSizer()
    for _ in range(20):                      # drafted and rejected: drafting stops
        sizer.choose(trie, 8)
        sizer.update(0)
    assert sizer.choose(trie, 8) == []
    text = [7, 7]
    for _ in range(6):                       # plain steps whose text is exactly what would have been drafted
        sizer.choose(trie, 8, position=len(text))
        text += [1, 2, 3, 4]
        sizer.update(0, torch.tensor([text]))
    assert not sizer.shadows and len(sizer.choose(trie, 8, position=len(text))) == 4
    sizer.new_sequence()
    assert not sizer.shadows


def test_sizer_learns_acceptance_per_depth():
    """Frequency scores need not fall with depth as acceptance does: a chain scored 1.0 throughout
    whose first token is always accepted and whose second never is ends up drafted one node deep
    (one calibration for all depths would have kept all four at c = 1/4), and the depth-1
    calibration approaches 1, the deeper ones 0."""
    sizer = TreeSizer()
    trie = DraftTrie()
    trie.add([1, 2, 3, 4], 1.0)
    for _ in range(60):
        sizer.choose(trie, 8)
        sizer.update(1)
    assert len(sizer.choose(trie, 8)) == 1
    assert sizer.calibration(0, 1) > 0.9 and sizer.calibration(0, 2) < 0.1
    assert sizer.calibration(0) == pytest.approx(sizer.evidence[(0, None)][0] / sizer.evidence[(0, None)][1], rel=0.1)


def test_sizer_calibration_learns_and_recovers():
    sizer = TreeSizer()
    trie = DraftTrie()
    trie.add([1, 2, 3, 4], [0.9, 0.8, 0.7, 0.6])
    assert len(sizer.choose(trie, 8)) == 4
    for _ in range(20):
        sizer.choose(trie, 8)
        sizer.update(0)
    assert sizer.choose(trie, 8) == []
    for _ in range(1000):  # plain steps: the estimate drifts back to its prior and drafting resumes
        sizer.update(0)
    assert len(sizer.choose(trie, 8)) == 4
