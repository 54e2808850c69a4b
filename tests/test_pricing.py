"""Hardware-aware pricing: the verify-cost measurement (cached on disk per model / device / dtype),
the draft length it picks (brute force over k), and the Sequoia tree size it picks."""
from __future__ import annotations

import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel
from flashmm.targets.verify_cost import measure_verify_cost
from flashmm.tree.cost import PAUSE_CAP, AdaptiveDraftLength, VerifyCost, best_paying_sequoia_tree, next_pause
from flashmm.tree.shapes import sequoia_tree

from text_models import prompt, tiny_lm


def test_measured_once_then_read_from_disk(tmp_path):
    model = tiny_lm("llama", seed=0)
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        first = measure_verify_cost(model, grid=(1, 2, 4, 8), prefix_len=16, repeats=1, directory=tmp_path)
        measured = len(calls)
        again = measure_verify_cost(model, grid=(1, 2, 4, 8), prefix_len=16, repeats=1, directory=tmp_path)
    finally:
        hook.remove()
    assert measured == 1 + 4 * 2 and len(calls) == measured      # prefix + (warm-up + 1) per size; then none
    assert again == first and first.nodes == (1, 2, 4, 8) and min(first.seconds) > 0
    other = measure_verify_cost(model.to(torch.float64), grid=(1, 2, 4, 8), prefix_len=16, repeats=1,
                                directory=tmp_path)                 # another dtype: its own entry
    assert len(list(tmp_path.glob("verify_cost_*.json"))) == 2 and other.nodes == first.nodes


def test_a_sliding_window_model_is_timed_on_a_full_cache(tmp_path):
    """Gemma 3's own cache has sliding-window layers that count the tokens they have seen and
    cannot be cropped back to the prefix (the real Gemma-3-270M failed here): the measurement must
    use flashmm's full-length cache, as the targets do."""
    model = tiny_lm("gemma3", seed=0, sliding_window=512)
    cost = measure_verify_cost(model, grid=(1, 2, 4), prefix_len=32, repeats=2, directory=tmp_path)
    assert cost.nodes == (1, 2, 4) and min(cost.seconds) > 0


def test_cost_interpolates_and_extrapolates():
    cost = VerifyCost((1, 2, 4), (1.0, 1.5, 2.5))
    assert cost.relative(1) == 1.0 and cost.relative(3) == 2.0 and cost.relative(6) == 3.5
    with pytest.raises(ValueError):
        VerifyCost((2, 4), (1.0, 2.0))


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("seconds", [(1.0, 1.05, 1.1, 1.2, 1.4), (1.0, 1.6, 2.2, 3.5, 6.0), (1.0, 1.0, 1.0, 1.0, 1.0)])
def test_length_maximises_tokens_per_cost(alpha, seconds):
    cost = VerifyCost((1, 2, 4, 8, 16), seconds)
    length = AdaptiveDraftLength(verify_cost=cost, draft_token_cost=0.05)

    def rate(k):
        expected = sum(alpha ** i for i in range(k + 1))
        return expected / (1.0 if k == 0 else cost.relative(k + 1) + 0.05 * k)
    brute = max(range(13), key=lambda k: (rate(k), -k))
    assert length.choose(12, alpha) == brute


def test_best_paying_sequoia_tree_by_enumeration():
    accept = [0.6, 0.2, 0.1]
    cheap = VerifyCost((1, 64), (1.0, 1.0 + 63 * 0.001))
    steep = VerifyCost((1, 2, 64), (1.0, 3.0, 200.0))
    n, tree, rate = best_paying_sequoia_tree(accept, cheap, max_nodes=12)
    assert n == 12 and tree.num_nodes == 12              # verification almost free: use every node
    assert best_paying_sequoia_tree(accept, steep, max_nodes=12)[0] == 1   # drafting never pays
    middle = VerifyCost((1, 4, 8, 16), (1.0, 1.3, 2.0, 4.0))
    n, tree, rate = best_paying_sequoia_tree(accept, middle, max_nodes=12)
    rates = {m: (1 + sequoia_tree(accept, m, 8)[0]) / middle.relative(m) for m in range(1, 13)}
    assert n == max(rates, key=rates.get) and rate == pytest.approx(rates[n])


def test_measured_pricing_measures_on_bind_and_stays_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMM_CACHE_DIR", str(tmp_path))
    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=0)
    drafter = DraftModel(draft, max_draft_tokens=4)
    sm = flashmm.wrap(target, drafter)
    assert drafter.cost_source == "measured" and drafter.length.verify_cost is not None
    assert list(tmp_path.glob("verify_cost_*.json"))
    ids = prompt(10, seed=2)
    assert torch.equal(sm.generate(ids, do_sample=False, max_new_tokens=12),
                       target.generate(ids, do_sample=False, max_new_tokens=12))
    kept = DraftModel(draft, pricing="constants")
    flashmm.wrap(target, kept)
    assert kept.cost_source == "constants" and kept.length.verify_cost is None


def test_onednn_cost_has_its_own_entry_and_routes_the_linears(tmp_path):
    """The onednn measurement times oneDNN's op (the one a text target's tree forwards use),
    and is cached apart from the torch one."""
    from flashmm.targets.onednn import onednn_available

    if not onednn_available():
        pytest.skip("torch without oneDNN")
    import flashmm.targets.onednn as onednn

    model = tiny_lm("llama", seed=0)
    calls = []
    real = onednn._onednn_linear
    measure_verify_cost(model, grid=(1, 2), prefix_len=8, repeats=1, directory=tmp_path, linear="torch")
    assert not calls
    onednn._onednn_linear = lambda layer, weight, x: calls.append(1) or real(layer, weight, x)
    try:
        measure_verify_cost(model, grid=(1, 2), prefix_len=8, repeats=1, directory=tmp_path, linear="onednn")
    finally:
        onednn._onednn_linear = real
    assert calls and len(list(tmp_path.glob("verify_cost_*.json"))) == 2
    assert all("forward" not in layer.__dict__ for layer in model.modules())  # routing undone


def test_cost_follows_the_kernels_staircase_but_never_falls_below_one_token():
    """A larger size measured cheaper than a smaller one (a 2-row forward dearer than a 4-row one) is
    priced as measured, since a draft of n nodes runs exactly n rows; nothing costs less than the
    one-token forward."""
    cost = VerifyCost((1, 2, 4, 8), (1.0, 1.6, 1.2, 2.0))
    assert cost.relative(2) == 1.6 and cost.relative(4) == 1.2 and cost.relative(3) == pytest.approx(1.4)
    assert cost.relative(8) == 2.0 and cost.relative(6) == pytest.approx(1.6)
    assert VerifyCost((1, 2, 4), (1.0, 0.5, 2.0)).relative(2) == 1.0


@pytest.mark.parametrize("name", ["prompt_lookup", "token_recycling", "suffix", "lookahead"])
def test_every_adaptive_drafter_is_priced_by_the_target_at_bind(tmp_path, monkeypatch, name):
    monkeypatch.setenv("FLASHMM_CACHE_DIR", str(tmp_path))
    target = tiny_lm("llama", seed=0)
    sm = flashmm.wrap(target, name)
    assert sm.drafter.cost_source == "measured"
    expected = sm.target.verify_cost()
    lengths = (list(sm.drafter.lengths.values()) if name == "prompt_lookup" else [sm.drafter.sizer.cost])
    assert all(length.verify_cost == expected for length in lengths)
    ids = prompt(10, seed=2)
    assert torch.equal(sm.generate(ids, do_sample=False, max_new_tokens=12),
                       target.generate(ids, do_sample=False, max_new_tokens=12))


def test_a_batch_is_timed_with_every_row_and_priced_per_row(tmp_path, monkeypatch):
    """measure_verify_cost(batch=B) forwards B rows together and returns a row's share: a fake clock
    that advances 1 s per forward gives 1 / B seconds at every node count."""
    from flashmm.targets import verify_cost

    model = tiny_lm("llama", seed=0)
    shapes = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)
    clock = iter(range(10_000))
    monkeypatch.setattr(verify_cost.time, "perf_counter", lambda: float(next(clock)))
    try:
        cost = measure_verify_cost(model, grid=(1, 3), prefix_len=8, repeats=1, directory=tmp_path, batch=4)
    finally:
        hook.remove()
    assert shapes == [(4, 8), (4, 1), (4, 3), (4, 1), (4, 3)]     # the prefix, a warm-up round, a timed round
    assert cost.seconds == (0.25, 0.25)
    single = measure_verify_cost(model, grid=(1, 3), prefix_len=8, repeats=1, directory=tmp_path)
    assert single.seconds == (1.0, 1.0) and len(list(tmp_path.glob("verify_cost_*.json"))) == 2
    with pytest.raises(ValueError, match="batch"):
        measure_verify_cost(model, grid=(1,), directory=tmp_path, batch=0)


def test_reprice_keeps_the_drafts_own_cost_in_units_of_the_new_step():
    alone = VerifyCost((1, 2, 4), (0.04, 0.05, 0.06))
    batched = VerifyCost((1, 2, 4), (0.01, 0.02, 0.04))       # per row: a row's share of a batched step
    length = AdaptiveDraftLength(verify_cost=alone, draft_token_cost=0.25, draft_step_cost=0.5)
    length.reprice(batched)
    # a draft forward of 0.01 s was 0.25 of 0.04 s; it is 1.0 of a 0.01 s share
    assert length.draft_token_cost == pytest.approx(1.0) and length.draft_step_cost == pytest.approx(2.0)
    assert length.cost(1) == pytest.approx(2.0 + 1.0 + 2.0)
    assert length.lone_forward == pytest.approx(4.0)           # what a lone row's forward is in the new unit
    with pytest.raises(ValueError, match="constants"):
        AdaptiveDraftLength().reprice(batched)


def test_batch_bucket_is_the_next_power_of_two():
    from flashmm.tree.cost import batch_bucket

    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


def test_forks_in_a_batch_are_priced_at_the_batch_size(tmp_path, monkeypatch):
    """price_for_batch gives each measured fork the target's per-row cost at the batch's bucket; the
    drafter it was forked from and a drafter priced by constants keep theirs."""
    from flashmm.tree.cost import price_for_batch

    monkeypatch.setenv("FLASHMM_CACHE_DIR", str(tmp_path))
    sm = flashmm.wrap(tiny_lm("llama", seed=0), "prompt_lookup")
    constants = flashmm.wrap(tiny_lm("llama", seed=0), flashmm.drafters.PromptLookup()).drafter
    constants.pricing, constants.cost_source = "constants", "constants"
    for length in constants.cost_models():
        length.verify_cost = None
    forks = [sm.drafter.fork() for _ in range(3)] + [constants]
    price_for_batch(forks, sm.target, rows=3)
    batched, alone = sm.target.verify_cost(batch=4), sm.target.verify_cost()
    assert batched != alone
    assert all(length.verify_cost == batched for fork in forks[:3] for length in fork.cost_models())
    assert all(length.verify_cost == alone for length in sm.drafter.cost_models())
    assert all(length.verify_cost is None for length in constants.cost_models())


def test_flash_forks_size_their_trees_by_the_batch_cost(tmp_path, monkeypatch):
    from flashmm.drafters import FlashDrafter
    from flashmm.tree.cost import price_for_batch

    monkeypatch.setenv("FLASHMM_CACHE_DIR", str(tmp_path))
    model = tiny_lm("llama", seed=0)
    drafter = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=5, seed=0)
    drafter.pricing = "measured"
    sm = flashmm.wrap(model, drafter)
    assert sm.drafter.cost_source == "measured"
    fork = sm.drafter.fork()
    fork._sequoia[4] = [(0,)]                                   # a tree sized by the old cost
    price_for_batch([fork], sm.target, rows=2)
    assert fork.verify_cost == sm.target.verify_cost(batch=2) != sm.drafter.verify_cost and fork._sequoia == {}


def test_a_cost_no_node_pays_for_gives_no_sequoia_paths():
    """A steep measured cost (a loaded machine, a compute-bound batch) can make even one drafted
    node a loss: the Sequoia paths are then empty (a plain step), not an error."""
    from flashmm.tree.cost import sequoia_rank_paths

    steep = VerifyCost((1, 2, 4), (1.0, 50.0, 100.0))
    assert sequoia_rank_paths([0.6, 0.3, 0.1], max_tokens=4, depth=3, verify_cost=steep) == []
    assert len(sequoia_rank_paths([0.6, 0.3, 0.1], max_tokens=4, depth=3, verify_cost=None)) == 4


def test_a_size_timed_below_the_one_token_forward_reads_as_its_cost(tmp_path, monkeypatch):
    """Rounds over every size, the fastest round per size, never below the one-token forward: a fake
    clock on which the one-token forward is slow (3 s) in the first timed round and 2-token /
    4-token forwards take 1 s / 4 s gives (2, 2, 4) — the 2-token time cannot read below the
    one-token one."""
    from flashmm.targets import verify_cost

    model = tiny_lm("llama", seed=0)
    durations = iter([0] + [0, 0, 0] + [3, 1, 4] + [2, 1, 5])  # the prefix, a warm-up round, two timed rounds
    now = [0.0]

    def advance(*_):        # each forward takes the next duration on the fake clock
        now[0] += next(durations)
    model.register_forward_pre_hook(advance)
    monkeypatch.setattr(verify_cost.time, "perf_counter", lambda: now[0])
    cost = measure_verify_cost(model, grid=(1, 2, 4), prefix_len=8, repeats=2, directory=tmp_path)
    assert cost.seconds == (2.0, 2.0, 4.0)


# ------------------------------------------------------------------ the option once spelled `budget`
# Drafted tokens per step, greedy, 40 new tokens after prompt(10, seed=2) on tiny_lm("llama", seed=0): recorded
# from the same drafters spelled with the old option (budget="constants"; FLASH's budget="fixed") before it was
# renamed `pricing`. Constants and "none" read no clock, so these are the same on every machine.
OLD_BUDGET_DRAFTS = {
    # the draft is the target: every token accepted, the constants' length grows to the cap
    "draft_model_same": [3, 6, 6, 6, 6, 6],
    # another draft: rejected tokens make the constants' price stop drafting, with retries now and then
    "draft_model_other": [3, 2, 2, 1] + [0] * 11 + [1] + [0] * 12 + [1] + [0] * 10,
    "horizontal": [3, 4, 6, 9, 13],
    # the vertical cascade drafts what its DraftModel alone drafts (only its draft forwards differ)
    "vertical": [3, 2, 2, 1] + [0] * 11 + [1] + [0] * 12 + [1] + [0] * 10,
    # not priced: every step drafts its cap
    "flash": [6] * 39,
}


def _drafts_per_step(sm, ids, max_new_tokens=40) -> tuple[list[int], torch.Tensor]:
    sizes = []
    propose = sm.drafter.propose

    def counting(*args, **kwargs):
        draft = propose(*args, **kwargs)
        sizes.append(draft.tree.num_nodes - 1)
        return draft
    sm.drafter.propose = counting
    return sizes, sm.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("name", sorted(OLD_BUDGET_DRAFTS))
def test_pricing_drafts_what_the_old_budget_spelling_drafted(name):
    from flashmm.drafters import FlashDrafter, PromptLookup
    from flashmm.drafters.cascade import HorizontalCascade, VerticalCascade

    def constant_lookup():          # a lookup priced by the constants too: nothing here reads a clock
        lookup = PromptLookup()
        lookup.pricing = "constants"
        return lookup

    target = tiny_lm("llama", seed=0)
    make = {
        "draft_model_same": lambda: DraftModel(tiny_lm("llama", seed=0), max_draft_tokens=6, pricing="constants"),
        "draft_model_other": lambda: DraftModel(tiny_lm("llama", seed=1), max_draft_tokens=6, pricing="constants"),
        "horizontal": lambda: HorizontalCascade(DraftModel(tiny_lm("llama", seed=0), max_draft_tokens=3,
                                                           pricing="constants"), constant_lookup(), pricing="constants"),
        "vertical": lambda: VerticalCascade(DraftModel(tiny_lm("llama", seed=1), max_draft_tokens=6,
                                                       pricing="constants"), constant_lookup(), pricing="constants"),
        "flash": lambda: FlashDrafter.from_target(target, num_queries=4, tokens_per_step=5, seed=0,
                                                  max_draft_tokens=6, pricing="none"),
    }[name]
    sm = flashmm.wrap(target, make())
    ids = prompt(10, seed=2)
    sizes, out = _drafts_per_step(sm, ids)
    assert sizes == OLD_BUDGET_DRAFTS[name]
    assert sm.drafter.cost_source == ("none" if name == "flash" else "constants")
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=40))


def test_forks_share_immutable_tuples_and_copy_mutable_state():
    """fork shares a tuple of scalars (FLASH's draft vocabulary: thousands of ids, copied into every batch
    row it was deep-copied for) and still copies lists, and tuples that hold something mutable."""
    from flashmm.drafters import FlashDrafter

    model = tiny_lm("llama", seed=0)
    drafter = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=5, seed=0,
                                       draft_vocab=list(range(0, 64, 2)))
    drafter.notes, drafter.pairs = [1, 2], ([3], 4)
    fork = drafter.fork()
    assert fork.draft_vocab is drafter.draft_vocab == tuple(range(0, 64, 2))
    assert fork.notes == [1, 2] and fork.notes is not drafter.notes
    assert fork.pairs == ([3], 4) and fork.pairs[0] is not drafter.pairs[0]
    assert fork.net is drafter.net


def test_a_drafter_that_does_not_pay_pauses_twice_as_long_each_time_up_to_the_cap():
    """next_pause, the back-off every drafter with passes of its own shares (DFlash, EAGLE-1/-3 heads, FLASH)."""
    pauses, last = [], 0
    for _ in range(8):
        last = next_pause(last, paid=False)
        pauses.append(last)
    assert pauses == [1, 2, 4, 8, 16, 32, 32, 32] and PAUSE_CAP == 32
    assert next_pause(last, paid=True) == 0 and next_pause(0, paid=True) == 0
