"""Batched decoding: every row verified in one target forward per step, each row identical to
the model's own batched generate on the same (left-padded) batch; sampling exact per row."""
import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.tree.cost import batch_bucket

from stats_utils import chi_square_pvalue
from text_models import prompt, ragged_batch, tiny_lm

DRAFTERS = {
    "lookup": lambda t, s: PromptLookup(),
    "self_chain": lambda t, s: DraftModel(t, max_draft_tokens=4, adaptive=False),
    "stranger_tree": lambda t, s: DraftModel(s, max_draft_tokens=6, tree_width=2, adaptive=False),
}


class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        model.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.calls += 1


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3"])
def models(request):
    return tiny_lm(request.param, seed=0), tiny_lm(request.param, seed=5)


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_batched_greedy_matches_batched_generate(models, name):
    target, stranger = models
    ids, mask = ragged_batch()
    sm = flashmm.wrap(target, DRAFTERS[name](target, stranger))
    for rows_left in range(1, ids.shape[0] + 1):  # the per-row costs batched drafts are priced by,
        sm.target.verify_cost(batch=batch_bucket(rows_left))  # measured once (forwards not counted below)
    counter = ForwardCounter(target)
    out = sm.generate(ids, attention_mask=mask, max_new_tokens=25)
    batched_calls = counter.calls
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=25))
    stats = sm.last_stats
    rows = flashmm.wrap(target, DRAFTERS[name](target, stranger), batching="rows")
    counter.calls = 0
    assert torch.equal(rows.generate(ids, attention_mask=mask, max_new_tokens=25), out)
    if name != "self_chain":  # (a self-drafting target's own draft forwards would be counted too)
        # one forward per step for all rows, against one per row and step
        assert batched_calls <= 1 + stats.verify_steps and batched_calls < stats.target_forwards
        assert counter.calls == rows.last_stats.target_forwards


def test_rows_finish_at_different_steps(models):
    """EOS hit by rows at different steps (finished rows leave the batch, pads fill their tail),
    and max_new_tokens ending in the middle of an accepted block."""
    target, _ = models
    ids, mask = ragged_batch((12, 7, 18, 5), seed=4)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
    eos = int(plain[0, ids.shape[1] + 3])
    sm = flashmm.wrap(target, DraftModel(target, max_draft_tokens=4, adaptive=False))
    for kw in (dict(max_new_tokens=20, eos_token_id=eos), dict(max_new_tokens=7, eos_token_id=eos),
               dict(max_new_tokens=13)):
        out = sm.generate(ids, attention_mask=mask, **kw)
        ref = target.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(out, ref), kw
    stopped = (ref[:, ids.shape[1]:] == eos).any(1)
    assert 0 < int(stopped.sum()) < ids.shape[0] or kw.get("eos_token_id") is None


V = 8
TRIALS = 800


def test_batched_sampling_exact_per_row():
    """Two rows decoded together (one left-padded), 2 sampled tokens each: each row's joint of
    its two tokens matches the target's exact (float64, enumerated) joint for that row."""
    target = tiny_lm("llama", seed=1, vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    draft = tiny_lm("llama", seed=2, vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        for m in (target, draft):
            m.get_output_embeddings().weight.mul_(0.15)
    prompts = [[3, 7, 3, 7, 3], [5, 1, 6]]
    ids = torch.tensor([prompts[0], [0, 0] + prompts[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    exact = []
    with torch.no_grad():
        for p in prompts:
            first = (target(torch.tensor([p])).logits[0, -1].double() / 0.9).softmax(-1)
            second = (target(torch.tensor([p + [a] for a in range(V)])).logits[:, -1].double() / 0.9).softmax(-1)
            exact.append(first[:, None] * second)
    sm = flashmm.wrap(target, DraftModel(draft, max_draft_tokens=2, adaptive=False))
    counts = torch.zeros(2, V, V)
    g = torch.Generator().manual_seed(7)
    for _ in range(TRIALS):
        out = sm.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True, temperature=0.9, generator=g)
        for b in range(2):
            a, c = out[b, -2:].tolist()
            counts[b, a, c] += 1
    for b in range(2):
        p = chi_square_pvalue(counts[b], exact[b])
        assert p > 1e-3, f"row {b} deviates from the target distribution (p = {p:.2e})"


def test_batch_width_by_hand():
    """One width for all rows: every row pays for the widest tree, so the width maximises the rows'
    expected tokens per unit of verify time (worked by hand below)."""
    from flashmm.engine.pricing import batch_width
    from flashmm.tree.cost import VerifyCost
    from flashmm.tree.draft import Draft
    from flashmm.tree.token_tree import TokenTree

    def chain(values, k=2):
        k = k if values is None else len(values) - 1
        return Draft(tokens=torch.zeros(1, k + 1, dtype=torch.long), tree=TokenTree.chain(k),
                     values=None if values is None else torch.tensor(values))

    cost = VerifyCost((1, 2, 3, 4), (1.0, 1.1, 1.6, 1.7))
    rows = [chain([1, 0.9, 0.81]), chain([1, 0.2]), chain([1])]
    # W=1: (1 + 1 + 1) / 1 = 3.0; W=2: (1.9 + 1.2 + 1) / 1.1 = 3.73; W=3: (2.71 + 1.2 + 1) / 1.6 = 3.07
    assert batch_width(rows, cost) == 2
    assert batch_width(rows, VerifyCost((1, 2, 3, 4), (1.0, 1.0, 1.0, 1.0))) == 3  # free nodes: keep all
    assert batch_width(rows[:2] + [chain(None)], cost) == 3  # a draft without values is never cut


def test_packed_cuts_against_every_choice_of_counts():
    """Rows computed alone (the fused step's packed batch): each row keeps its own count, and the counts
    chosen give the most expected tokens per unit of verify time of every choice of counts (brute force),
    here with the cost of N nodes over B rows read at N / B nodes a row."""
    import itertools

    from flashmm.engine.pricing import packed_cuts
    from flashmm.tree.cost import VerifyCost
    from flashmm.tree.draft import Draft
    from flashmm.tree.token_tree import TokenTree

    def chain(values):
        return Draft(tokens=torch.zeros(1, len(values), dtype=torch.long), tree=TokenTree.chain(len(values) - 1),
                     values=None if values is None else torch.tensor(values))

    def rate(rows, counts, cost):
        tokens = sum(sum(r[:c]) for r, c in zip(rows, counts))
        return tokens / (cost.seconds_at(sum(counts) / len(rows)) / cost.seconds[0])

    cost = VerifyCost((1, 2, 3, 4), (1.0, 1.3, 1.6, 1.9))
    for rows in ([[1, 0.9, 0.81, 0.7], [1, 0.2], [1]], [[1, 0.5, 0.4], [1, 0.6, 0.3, 0.1], [1, 0.35]],
                 [[1, 0.1, 0.05], [1, 0.2]]):
        counts = packed_cuts([chain(r) for r in rows], cost)
        best = max(rate(rows, c, cost) for c in itertools.product(*[range(1, len(r) + 1) for r in rows]))
        assert rate(rows, counts, cost) == pytest.approx(best)
    # by hand: [3, 1, 1] gives 4.71 tokens at t(5 / 3) = 1.2 (3.93 a unit); adding the 0.2 node, 4.91 at 1.3 (3.78)
    assert packed_cuts([chain([1, 0.9, 0.81]), chain([1, 0.2]), chain([1])], cost) == [3, 1, 1]


def test_critical_cuts_against_an_enumeration_of_accepted_counts():
    """A fixed batch, whose end is set by its critical rows (the most tokens left): the depth chosen maximises
    (1 + E[min over critical rows of accepted tokens]) per unit of verify time, E[min] enumerated over every
    combination of accepted counts (rows independent, P(count >= k) = values[k]) in float64; the other rows
    verify their roots alone; a critical row with nothing drafted stops every draft."""
    import itertools

    from flashmm.engine.pricing import critical_cuts
    from flashmm.tree.cost import VerifyCost
    from flashmm.tree.draft import Draft
    from flashmm.tree.token_tree import TokenTree

    def chain(values):
        if values is None:
            return Draft(tokens=torch.zeros(1, 1, dtype=torch.long), tree=TokenTree.chain(0))
        return Draft(tokens=torch.zeros(1, len(values), dtype=torch.long), tree=TokenTree.chain(len(values) - 1),
                     values=torch.tensor(values))

    def expected_min(rows, depth):
        laws = []
        for v in rows:   # P(count = k) for k = 0 .. depth
            v = [float(x) for x in v[: depth + 1]]
            laws.append([v[k] - (v[k + 1] if k < depth else 0.0) for k in range(depth + 1)])
        return sum(min(ks) * torch.tensor([law[k] for law, k in zip(laws, ks)], dtype=torch.float64).prod().item()
                   for ks in itertools.product(range(depth + 1), repeat=len(rows)))

    cost = VerifyCost((1, 2, 3, 4), (1.0, 1.05, 1.15, 1.3))
    for rows in ([[1, 0.9, 0.81, 0.73], [1, 0.8, 0.64, 0.5]], [[1, 0.5, 0.25, 0.1], [1, 0.6, 0.3, 0.1], [1, 0.9, 0.8]],
                 [[1, 0.95, 0.9, 0.85]] * 3):
        for packed in (True, False):
            drafts = [chain(r) for r in rows] + [chain([1, 0.99, 0.98])]       # the last row is ahead: not critical
            critical = [True] * len(rows) + [False]
            counts = critical_cuts(drafts, critical, cost, packed)
            assert counts[-1] == 1 and len(set(counts[:-1])) == 1

            def rate(depth):
                nodes = len(drafts) + depth * len(rows)
                t = cost.seconds_at(nodes / len(drafts)) if packed else cost.seconds_at(depth + 1)
                return (1 + expected_min(rows, depth)) / t
            best = max(range(min(len(r) for r in rows)), key=rate)
            assert rate(counts[0] - 1) == pytest.approx(rate(best))
    drafts = [chain([1, 0.9, 0.81]), chain(None), chain([1, 0.9])]
    assert critical_cuts(drafts, [True, True, False], cost, True) == [1, 1, 1]
    assert critical_cuts(drafts, [True, False, False], cost, True)[1:] == [1, 1]


def test_prompt_lookup_cut_learns_from_the_tokens_verified():
    from flashmm.config import SamplingParams
    from flashmm.drafters.base import StepResult

    pl = PromptLookup()
    pl.begin(None)
    committed = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])
    draft = pl.propose(committed, 10, SamplingParams(), None)
    n, k = pl._last
    assert k > 2 and torch.allclose(draft.values, pl.lengths[n].alpha ** torch.arange(k + 1.0))
    cut = pl.cut(draft, 3)
    assert cut.tokens.tolist() == draft.tokens[:, :3].tolist() and cut.tree.num_nodes == 3
    assert cut.values.tolist() == draft.values[:3].tolist()
    pl.observe(StepResult(committed=committed, accepted_len=2, path=torch.tensor([[0, 1, 2]])))
    assert pl.lengths[n].accepted == 2 and pl.lengths[n].rejected == 0  # both verified tokens accepted


def test_cut_drafts_stay_exact(models, monkeypatch):
    """Rows whose lookup drafts are cut to one width (forced to 2 nodes here, whatever the timings)
    still equal the model's own batched generate."""
    import flashmm.engine.pricing
    import flashmm.targets.batch

    target, _ = models
    pattern = prompt(6, seed=11)[0]
    ids, mask = ragged_batch((30, 9, 20))
    ids[0, -24:] = pattern.repeat(4)  # row 0 repeats itself: lookup drafts long chains there
    forward = flashmm.targets.batch.forward_trees
    widths = []  # (rows, width) of every batched tree forward

    def recording(target, state, tokens, trees, want_hidden, *rest):
        widths.append(tuple(tokens.shape))
        return forward(target, state, tokens, trees, want_hidden, *rest)

    monkeypatch.setattr(flashmm.engine.pricing, "batch_width", lambda drafts, cost: 2)
    monkeypatch.setattr(flashmm.engine.pricing, "packed_cuts", lambda drafts, cost: [2] * len(drafts))
    monkeypatch.setattr(flashmm.engine.pricing, "critical_cuts", lambda drafts, critical, cost, packed: None)
    monkeypatch.setattr(flashmm.targets.batch, "forward_trees", recording)
    sm = flashmm.wrap(target, PromptLookup())
    out = sm.generate(ids, attention_mask=mask, max_new_tokens=25)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=25))
    shared = [width for rows, width in widths if rows > 1]
    assert max(shared) == 2 and sm.last_stats.accepted_tokens > 0  # cut, and cut drafts were accepted


@pytest.mark.parametrize("holes", [0.0, 1.0])
def test_compacting_the_cache_every_step_or_never_is_generate(models, monkeypatch, holes):
    """A batch whose rows keep different numbers of tokens per step leaves holes in the cache;
    compacting it after every step (COMPACT_HOLES 0) or never (1) changes no token of the model's own batched
    generate, and holes were there to compact."""
    import flashmm.engine.pricing
    import flashmm.targets.batch as padded

    target, _ = models
    compactions = []
    original = padded.compact

    def counting(state):
        before = padded.holes_read(state)
        original(state)
        compactions.append((before, padded.holes_read(state)))

    monkeypatch.setattr(padded, "COMPACT_HOLES", holes)
    monkeypatch.setattr(padded, "compact", counting)
    # drafts priced for throughput, as while rows wait to join, so row 0 drafts alone (a fixed batch's critical
    # pricing drafts only when every row can gain: flashmm.engine.pricing.critical_cuts)
    monkeypatch.setattr(flashmm.engine.pricing, "critical_cuts", lambda drafts, critical, cost, packed: None)
    ids, mask = ragged_batch((30, 9, 20))
    ids[0, -24:] = prompt(6, seed=11)[0].repeat(4)  # row 0 repeats itself: its lookup drafts are accepted
    sm = flashmm.wrap(target, PromptLookup())
    out = sm.generate(ids, attention_mask=mask, max_new_tokens=24)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=24))
    assert sm.last_stats.accepted_tokens > 0
    if holes == 1.0:
        assert not compactions
    else:
        assert any(before > 0 for before, _ in compactions) and all(after == 0 for _, after in compactions)


@torch.no_grad()
def test_a_ragged_batch_keeps_each_rows_slots_in_one_run_and_drops_a_left_prompts():
    """Rows prefilled one by one hold their slots as one run up to the end (holes in front), so attention
    can start at a row's first real slot; when the long row leaves, its prompt's slots go with it."""
    from flashmm.targets.session import open_session

    model = tiny_lm("llama")
    sm = flashmm.wrap(model, "prompt_lookup")
    ids, attention = ragged_batch((40, 5, 12))
    session, logits, _ = open_session(sm.target, ids, attention, False, {})
    state = session.state
    assert state.num_slots == 40 and state.valid.sum(1).tolist() == [40, 5, 12]
    for row in state.valid:
        first = int(row.int().argmax())
        assert bool(row[first:].all())  # one run to the end
    session.select([1, 2])
    assert state.num_slots == 12 and state.valid.sum(1).tolist() == [5, 12]
    assert state.cache.layers[0].keys.shape[2] == 12
    reference = model(input_ids=ids[1:, -12:], attention_mask=attention[1:, -12:]).logits[:, -1]
    torch.testing.assert_close(logits[1:], reference, rtol=1e-4, atol=1e-4)
