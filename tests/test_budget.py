"""Hardware-aware budget: the verify-cost measurement (cached on disk per model / device / dtype),
the draft length it picks (brute force over k), and the Sequoia tree size it picks."""
from __future__ import annotations

import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel
from flashmm.drafters.length import AdaptiveDraftLength, VerifyCost, best_tree_budget, measure_verify_cost
from flashmm.shapes import sequoia_tree

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


def test_tree_budget_by_enumeration():
    accept = [0.6, 0.2, 0.1]
    cheap = VerifyCost((1, 64), (1.0, 1.0 + 63 * 0.001))
    steep = VerifyCost((1, 2, 64), (1.0, 3.0, 200.0))
    n, tree, rate = best_tree_budget(accept, cheap, max_nodes=12)
    assert n == 12 and tree.num_nodes == 12              # verification almost free: use every node
    assert best_tree_budget(accept, steep, max_nodes=12)[0] == 1   # drafting never pays
    middle = VerifyCost((1, 4, 8, 16), (1.0, 1.3, 2.0, 4.0))
    n, tree, rate = best_tree_budget(accept, middle, max_nodes=12)
    rates = {m: (1 + sequoia_tree(accept, m, 8)[0]) / middle.relative(m) for m in range(1, 13)}
    assert n == max(rates, key=rates.get) and rate == pytest.approx(rates[n])


def test_auto_budget_measures_on_bind_and_stays_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMM_CACHE_DIR", str(tmp_path))
    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=0)
    drafter = DraftModel(draft, max_draft_tokens=4)
    sm = flashmm.wrap(target, drafter)
    assert drafter.cost_source == "measured" and drafter.length.verify_cost is not None
    assert list(tmp_path.glob("verify_cost_*.json"))
    ids = prompt(10, seed=2)
    assert torch.equal(sm.generate(ids, do_sample=False, max_new_tokens=12),
                       target.generate(ids, do_sample=False, max_new_tokens=12))
    kept = DraftModel(draft, budget="constants")
    flashmm.wrap(target, kept)
    assert kept.cost_source == "constants" and kept.length.verify_cost is None


def test_onednn_cost_has_its_own_entry_and_routes_the_linears(tmp_path):
    """The onednn measurement times oneDNN's op (the one a text target's tree forwards use),
    and is cached apart from the torch one."""
    from flashmm.onednn import onednn_available

    if not onednn_available():
        pytest.skip("torch without oneDNN")
    import flashmm.onednn as onednn

    model = tiny_lm("llama", seed=0)
    calls = []
    real = onednn._onednn_linear
    measure_verify_cost(model, grid=(1, 2), prefix_len=8, repeats=1, directory=tmp_path, linear="torch")
    assert not calls
    onednn._onednn_linear = lambda layer, x: calls.append(1) or real(layer, x)
    try:
        measure_verify_cost(model, grid=(1, 2), prefix_len=8, repeats=1, directory=tmp_path, linear="onednn")
    finally:
        onednn._onednn_linear = real
    assert calls and len(list(tmp_path.glob("verify_cost_*.json"))) == 2
    assert all("forward" not in layer.__dict__ for layer in model.modules())  # routing undone


def test_cost_never_falls_with_more_nodes():
    """A measured dip (noise, or MKL's 2-row quirk) is not planned on: t(n) >= t(m) for n > m."""
    cost = VerifyCost((1, 2, 4, 8), (1.0, 1.6, 1.4, 2.0))
    assert cost.relative(2) == 1.6 and cost.relative(4) == 1.6 and cost.relative(3) == 1.6
    assert cost.relative(8) == 2.0 and cost.relative(6) == pytest.approx(1.8)


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
