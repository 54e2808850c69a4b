"""The new drafting schemes and verifiers end to end through flashmm.wrap(...).generate.

* Greedy: every drafting scheme of DraftModel (chain, RSD-C, RSD-S, i.i.d. chains), each with
  its verifier's name, gives the target's own greedy generate, token for token (fp32); with
  do_sample=False every verifier name is greedy verification (checked in test_greedy_names).
* Sampling: the joint distribution of the first two sampled tokens (χ² against the float64
  enumeration of test_sampling_exactness) for each scheme with its exact verifier.
* A verifier that is not exact for the drafter's scheme is refused before the prefill.
"""
import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.tree.token_tree import TokenTree

from stats_utils import chi_square_pvalue
from test_sampling_exactness import PROMPT, SAMPLING, V, exact_joint, models  # noqa: F401 (fixture)
from text_models import prompt, tiny_lm

DRAFTINGS = {
    "chain": dict(drafting="sibling"),
    "rsd_c": dict(drafting="rsd_c", branching=(3, 2, 1)),
    "rsd_s": dict(drafting="rsd_s", beam_width=3),
    "chains": dict(drafting="chains", num_chains=3),
}


@pytest.fixture(scope="module")
def greedy_models():
    target = tiny_lm("llama", seed=0)
    draft = tiny_lm("llama", seed=0)
    with torch.no_grad():   # a draft close to the target but not equal: some drafts accepted, some not
        for w in draft.parameters():
            w.add_(0.02 * torch.randn(w.shape, generator=torch.Generator().manual_seed(w.numel())))
    return target, draft


@pytest.mark.parametrize("drafting, verifier", [
    ("chain", "block"), ("rsd_c", "rsd"), ("rsd_s", "traversal"), ("chains", "spectr"),
])
def test_greedy_token_identical(greedy_models, drafting, verifier):
    target, draft = greedy_models
    ids = prompt(12, seed=3)
    expected = target.generate(ids, do_sample=False, max_new_tokens=20)
    drafter = DraftModel(draft, max_draft_tokens=3, adaptive=False, **DRAFTINGS[drafting])
    sm = flashmm.wrap(target, drafter, verifier=verifier, max_draft_tokens=12)
    out = sm.generate(ids, do_sample=False, max_new_tokens=20)
    assert torch.equal(out, expected)
    assert sm.last_stats.accepted_tokens > 0            # drafts were accepted, not only corrected


E2E_TRIALS = 400   # a wiring check: the verifier-level tests (20000 rows each) are the thorough ones


def histogram(sm, trials: int) -> torch.Tensor:
    """Counts [V, V] of the first two sampled tokens (the second is the first speculative step)."""
    counts = torch.zeros(V, V)
    g = torch.Generator().manual_seed(4321)
    for _ in range(trials):
        a, b = sm.generate(PROMPT, max_new_tokens=2, generator=g, **SAMPLING)[0, -2:].tolist()
        counts[a, b] += 1
    return counts


@pytest.mark.parametrize("drafting, verifier", [("rsd_s", "rsd"), ("chains", "spectr")])
def test_sampling_lossless(models, drafting, verifier):  # noqa: F811 (fixture)
    target, draft = models
    drafter = DraftModel(draft, max_draft_tokens=2, adaptive=False, **DRAFTINGS[drafting])
    sm = flashmm.wrap(target, drafter, verifier=verifier, max_draft_tokens=8)
    counts = histogram(sm, E2E_TRIALS)
    assert sm.last_stats.verify_steps > 0
    p = chi_square_pvalue(counts, exact_joint(target))
    assert p > 1e-3, f"{drafting} + {verifier}: sampled output deviates from the target (p = {p:.2e})"


def test_greedy_names():
    from flashmm.verify import select_verifier, verify_greedy  # noqa: PLC0415
    tokens, tree = torch.tensor([[1, 2, 3]]), TokenTree.chain(2)
    logits = torch.randn(1, 3, 9, generator=torch.Generator().manual_seed(0))
    expected = verify_greedy(tokens, tree, logits)
    for name in ("rsd", "block", "traversal", "spectr"):
        got = select_verifier(name, do_sample=False, drafting_scheme="iid")(tokens, tree, logits, None, None, None, None)
        assert torch.equal(got.path, expected.path) and torch.equal(got.next_token, expected.next_token)


def test_auto_picks_the_exact_rule():
    from flashmm.verify import select_verifier  # noqa: PLC0415
    assert select_verifier("auto", True, drafting_scheme="without_replacement").__name__ == "_rsd"
    assert select_verifier("auto", True, drafting_scheme="iid").__name__ == "_auto_sampling"
    assert select_verifier("auto", True, drafting_scheme="iid_chains").__name__ == "_auto_sampling"


def test_drafts_have_the_declared_shape(greedy_models):
    target, draft = greedy_models
    committed = prompt(6, seed=1)
    sampling = flashmm.config.SamplingParams(True)
    gen = torch.Generator().manual_seed(0)
    rsd_c = DraftModel(draft, max_draft_tokens=12, **DRAFTINGS["rsd_c"])
    rsd_c.begin(None)
    d = rsd_c.propose(committed, 12, sampling, gen)
    assert [len(c) for c in d.tree.children][:4] == [3, 2, 2, 2] and d.tree.num_nodes == 1 + 3 + 6
    for v, kids in enumerate(d.tree.children):   # siblings distinct, q recorded at every parent
        assert len(set(d.tokens[0, kids].tolist())) == len(kids)
        if kids:
            assert abs(float(d.q_probs[0, v].sum()) - 1) < 1e-5
    chains = DraftModel(draft, max_draft_tokens=9, **DRAFTINGS["chains"])  # 3 chains x depth 3
    chains.begin(None)
    d = chains.propose(committed, 12, sampling, gen)
    assert len(d.tree.children[0]) == 3 and all(len(c) <= 1 for c in d.tree.children[1:])
    assert d.tree.max_depth == 3


def test_mismatched_scheme_refused_before_prefill(greedy_models):
    target, draft = greedy_models
    calls = []
    hook = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for drafter, verifier in [
            (DraftModel(draft, tree_width=2), "rsd"),                              # i.i.d. siblings
            (DraftModel(draft, **DRAFTINGS["rsd_c"]), "spectr"),                   # w/o replacement
            (DraftModel(draft, **DRAFTINGS["chains"]), "block"),                   # i.i.d. chains
            (DraftModel(draft, **DRAFTINGS["rsd_s"]), "tree"),                     # multi-round needs i.i.d.
            (PromptLookup(), "spectr"),                                            # deterministic
        ]:
            sm = flashmm.wrap(target, drafter, verifier=verifier)
            calls.clear()                       # wrap's own support check runs a forward
            with pytest.raises(ValueError, match="not exact for drafts"):
                sm.generate(prompt(5), do_sample=True, max_new_tokens=3)
        assert calls == []
    finally:
        hook.remove()
