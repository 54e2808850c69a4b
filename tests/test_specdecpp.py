"""SpecDec++: the stop rule against a hand computation, the labels and hidden states against an
independent forward, the head's training and folder, and greedy exactness through flashmm.generate;
the same for EAGLE-3 trees scored by a rank-acceptance head (brute-force rank paths, folder loading)."""
import math
from pathlib import Path

import pytest
import torch

import flashmm
from flashmm.config import SamplingParams
from flashmm.drafters import SpecDecPP, load
from flashmm.drafters import Eagle3Drafter
from flashmm.drafters.base import SequenceStart
from flashmm.drafters.eagle3 import save_head
from flashmm.drafters.nets.specdecpp_net import AcceptanceHead, RankAcceptanceHead
from flashmm.drafters.specdecpp import save_specdecpp
from flashmm.drafters.fastdraft import save_reduced_lm
from flashmm.train import acceptance as A
from flashmm.train import eagle3 as E

from test_eagle3 import brute_expand, features_of, greedy_examples, head_for
from test_fastdraft import reduced
from text_models import VOCAB, chat_prompt, prompt, tiny_lm


def constant_head(hidden_size: int, p_accept: float) -> AcceptanceHead:
    """A head predicting p_accept everywhere."""
    head = AcceptanceHead(hidden_size, width=8)
    with torch.no_grad():
        last = head.net[-1]
        last.weight.zero_()
        last.bias.fill_(math.log(p_accept / (1 - p_accept)))
    return head


@pytest.mark.parametrize("p_accept, threshold, expected", [
    (0.8, 0.5, 3),    # 1 - 0.8^j: 0.20, 0.36, 0.488 <= 0.5, then 0.59 > 0.5
    (0.9, 0.5, 6),    # 1 - 0.9^j: ... 0.469 (j=6) <= 0.5, 0.522 (j=7) > 0.5
    (0.3, 0.5, 0),    # the first token already has P(reject) = 0.7
    (0.99, 0.5, 8),   # never stops before the cap
])
def test_stop_rule_matches_product_of_acceptances(p_accept, threshold, expected):
    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)
    drafter = SpecDecPP(draft, constant_head(draft.config.hidden_size, p_accept), threshold=threshold,
                        max_draft_tokens=8)
    drafter.begin(None)
    proposal = drafter.propose(prompt(6), 16, SamplingParams(), None)
    assert proposal.num_draft_tokens == expected
    assert proposal.tree.max_depth == expected  # a chain


def test_priced_chain_stops_where_tokens_per_cost_peak():
    """With a measured cost the head's chain ends where expected tokens per unit of cost peak: with
    acceptance 0.9 per token and verify cost 1 + 0.5 k, (1 + sum 0.9^i) / (1 + 0.5 k) is largest at
    k = 3 (brute force below), where the threshold alone would draft the cap of 8."""
    from flashmm.tree.cost import VerifyCost

    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)
    drafter = SpecDecPP(draft, constant_head(draft.config.hidden_size, 0.9), threshold=0.99, max_draft_tokens=8)
    drafter.length.verify_cost = VerifyCost(tuple(range(1, 10)), tuple(1 + 0.5 * (n - 1) for n in range(1, 10)))
    drafter.begin(None)
    drafter.length.accepted = 20.0                       # the running acceptance says drafting pays
    rates = [(1 + sum(0.9 ** i for i in range(1, k + 1))) / (1 + 0.5 * k) for k in range(9)]
    best = max(range(9), key=rates.__getitem__)
    assert drafter.propose(prompt(6), 16, SamplingParams(), None).num_draft_tokens == best == 3
    drafter.adaptive = False                             # unpriced: the threshold alone
    assert drafter.propose(prompt(6), 16, SamplingParams(), None).num_draft_tokens == 8
    drafter.adaptive, drafter.length.accepted = True, 0.0
    drafter.length.rejected = 20.0                       # drafting does not pay: no draft forward at all
    assert drafter.propose(prompt(6), 16, SamplingParams(), None).num_draft_tokens == 0


def test_specdecpp_greedy_is_exact_and_reads_its_head():
    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)
    ids = prompt(8, seed=2)
    want = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    head = AcceptanceHead(draft.config.hidden_size, width=16)
    for threshold in (0.3, 0.9):
        sm = flashmm.wrap(target, SpecDecPP(draft, head, threshold=threshold, max_draft_tokens=6))
        assert torch.equal(sm.generate(ids, max_new_tokens=30, eos_token_id=[]), want)
    # the hidden state the head reads is the draft's final-normed state at the chain's tip
    drafter = SpecDecPP(draft, head, threshold=0.9)
    drafter.begin(None)
    seen = []
    original = drafter.head.forward
    drafter.head.forward = lambda h, s: (seen.append(h.clone()), original(h, s))[1]
    drafter.propose(ids, 1, SamplingParams(), None)
    reference = draft(ids, output_hidden_states=True).hidden_states[-1][0, -1]
    assert torch.allclose(seen[0], reference, atol=1e-5)


def test_labels_and_features_match_an_independent_forward():
    target = tiny_lm("llama", seed=0)
    draft = reduced(target, list(range(3, 67)))
    ids = prompt(20, seed=4)[0].tolist()
    examples = A.acceptance_examples(draft, [(ids, 12)], log=lambda m: None)
    logits = draft(input_ids=torch.tensor([ids]), logits_to_keep=0).logits[0]  # over the full vocabulary
    want = (logits.argmax(-1)[11:-1] == torch.tensor(ids[12:]))
    assert torch.equal(examples["label"], want) and len(want) == 8
    probs = logits[11:-1].softmax(-1)
    assert torch.allclose(examples["scalars"][:, 0], probs.max(-1).values, atol=1e-5)
    states = draft.lm(input_ids=draft.target_to_draft[torch.tensor([ids])], output_hidden_states=True).hidden_states
    assert torch.allclose(examples["hidden"].float(), states[-1][0, 11:-1], atol=1e-2)  # stored fp16


def test_auc_matches_pairwise_count():
    g = torch.Generator().manual_seed(0)
    score = torch.randint(0, 5, (40,), generator=g).float()  # with ties
    label = torch.rand(40, generator=g) > 0.5
    pos, neg = score[label], score[~label]
    pairs = (pos[:, None] > neg[None]).double() + 0.5 * (pos[:, None] == neg[None]).double()
    assert math.isclose(A.auc(score, label), float(pairs.mean()), rel_tol=1e-9)


def test_head_learns_a_learnable_rule_and_resumes(tmp_path):
    g = torch.Generator().manual_seed(0)
    n, d = 4000, 8
    hidden = torch.randn(n, d, generator=g)
    top1 = torch.rand(n, generator=g)
    examples = {"hidden": hidden.half(), "scalars": torch.stack([top1, torch.zeros(n)], -1),
                "label": (hidden[:, 0] + 2 * top1 - 1 + 0.3 * torch.randn(n, generator=g)) > 0,
                "sequence": torch.zeros(n, dtype=torch.long)}
    head = AcceptanceHead(d, width=16)
    before = A.head_metrics(head, examples)
    summary = A.train_head(head, examples, work_dir=tmp_path, epochs=3, lr=1e-2, batch_size=256, log=lambda m: None)
    after = A.head_metrics(head, examples)
    assert after["log_loss"] < 0.6 * after["log_loss_base_rate"] and after["auc"] > 0.9 > before["auc"]
    again = AcceptanceHead(d, width=16)
    assert A.train_head(again, examples, work_dir=tmp_path, epochs=3, log=lambda m: None)["losses"] == summary["losses"]
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))


def test_folder_round_trip_decodes_exactly(tmp_path):
    target = tiny_lm("llama", seed=0)
    draft = reduced(target, list(range(3, 67)))
    info = {"method": "fastdraft", "target": {"name": "tiny", "vocab_size": VOCAB}}
    save_reduced_lm(tmp_path / "fastdraft", draft, info)
    head = AcceptanceHead(draft.config.hidden_size, width=16)
    save_specdecpp(tmp_path / "specdecpp", head, tmp_path / "fastdraft",
                   {"method": "specdecpp", "target": info["target"], "threshold": 0.6, "max_draft_tokens": 5})
    loaded = load(tmp_path / "specdecpp")
    assert isinstance(loaded, SpecDecPP) and loaded.threshold == 0.6 and loaded.max_draft_tokens == 5
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.head.state_dict().values()))
    ids = prompt(8, seed=5)
    sm = flashmm.wrap(target, str(tmp_path / "specdecpp"))
    assert torch.equal(sm.generate(ids, max_new_tokens=20, eos_token_id=[]),
                       target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))
    (tmp_path / "fastdraft" / "drafter.json").unlink()
    with pytest.raises(FileNotFoundError, match="drafter.json"):
        load(tmp_path / "specdecpp")


# ---------------------------------------------------------------- SpecDec++ for EAGLE-3 trees (RankAcceptanceHead)

def constant_rank_head(hidden_size: int, rank_probs: list[float], ranks: int = 4) -> RankAcceptanceHead:
    """A rank head predicting P(rank r) = rank_probs[r] everywhere (the rest on "none of them")."""
    head = RankAcceptanceHead(hidden_size, ranks=ranks, max_depth=8, width=8)
    probs = list(rank_probs) + [0.0] * (ranks - len(rank_probs))
    probs.append(1.0 - sum(probs))
    with torch.no_grad():
        head.net[-1].weight.zero_()
        head.net[-1].bias.copy_(torch.tensor(probs).clamp_min(1e-12).log())
    return head.eval()


def eagle3_setup(tree: str, depth: int, top_k: int, acceptance, threshold: float):
    """A tiny EAGLE-3 head (float64) synced after a prompt, with the brute-force path runner of test_eagle3."""
    target = tiny_lm("llama", seed=0)
    net = head_for(target, list(range(0, VOCAB, 2)), seed=5).double()
    embed = E.FrozenEmbedding(target.get_input_embeddings().weight.detach().double())
    ids = prompt(10, seed=6)
    feats = features_of(target, ids).double()
    drafter = Eagle3Drafter(net, tree=tree, depth=depth, top_k=top_k, adaptive=False, acceptance=acceptance,
                            threshold=threshold)
    drafter._embed = embed
    drafter.begin(SequenceStart(input_ids=ids[:, :9], hidden_states=feats[:, :9]))
    drafter._sync(ids)
    return drafter, ids, brute_expand(net, embed, ids, feats)


@pytest.mark.parametrize("p_accept, threshold, expected", [
    (0.8, 0.5, 3),    # path acceptance 0.8^j: 0.8, 0.64, 0.512 >= 0.5, then 0.41 < 0.5
    (0.9, 0.5, 6),    # 0.9^6 = 0.531 >= 0.5, 0.9^7 = 0.478
    (0.3, 0.5, 0),    # the first token is already below: nothing drafted
    (0.99, 0.5, 8),   # never below before the depth cap
])
def test_eagle3_chain_stops_by_specdecpp_rule(p_accept, threshold, expected):
    """tree="chain" + a rank head: SpecDec++'s stop (P(at least one rejection) > threshold) exactly,
    the same counts as the draft-LM test above; each head pass saved is a level not expanded."""
    drafter, ids, _ = eagle3_setup("chain", 8, 1, None, threshold)
    drafter.acceptance = constant_rank_head(drafter.net.cfg.hidden_size, [p_accept])
    grown = drafter.grow(ids, max_tokens=16, specdec=True)
    assert len(grown.rows) == expected and grown.levels == min(expected, 7)
    assert all(abs(s - (j + 1) * math.log(p_accept)) < 1e-6 for j, s in enumerate(grown.scores))


def test_eagle3_tree_keeps_every_rank_path_above_the_floor_brute_force():
    """A dynamic tree scored by a rank head keeps exactly the rank paths whose predicted acceptance
    (product of rank probabilities) is >= 1 - threshold — enumerated by brute force — and each kept
    node is its parent's r-th most likely child under the head run from scratch on its own path."""
    import itertools  # noqa: PLC0415

    rank_probs, threshold, depth, top_k = [0.6, 0.3], 0.8, 4, 2
    drafter, ids, (expand, run) = eagle3_setup("dynamic", depth, top_k, None, threshold)
    drafter.acceptance = constant_rank_head(drafter.net.cfg.hidden_size, rank_probs)
    grown = drafter.grow(ids, max_tokens=30, specdec=True)
    want = {path for d in range(1, depth + 1) for path in itertools.product(range(top_k), repeat=d)
            if math.prod(rank_probs[r] for r in path) >= 1 - threshold}
    assert want == {(0,), (1,), (0, 0), (0, 0, 0)}        # the hand count: 0.6, 0.3, 0.36, 0.216
    paths = [()]
    for parent, row in zip(grown.parents, grown.rows):
        logits = drafter.net.logits(run(_nodes_of(grown, drafter), parent - 1) if parent else run([], -1))
        rank = int((logits > logits[row]).sum())
        paths.append(paths[parent] + (rank,))
    assert set(paths[1:]) == want and len(paths) - 1 == len(want)
    assert grown.levels == 3                              # depth 4's candidates all fall below: no 4th pass


def _nodes_of(grown, drafter):
    from flashmm.tree.dynamic import Node  # noqa: PLC0415

    depth = [0]
    for p in grown.parents:
        depth.append(depth[p] + 1)
    return [Node(p - 1, r, s, depth[i + 1]) for i, (p, r, s) in enumerate(zip(grown.parents, grown.rows, grown.scores))]


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_eagle3_with_rank_head_is_token_identical(tree, arch):
    target = tiny_lm(arch, seed=0)
    net = head_for(target, list(range(3, VOCAB)), seed=1)
    torch.manual_seed(2)
    head = RankAcceptanceHead(net.cfg.hidden_size, ranks=4, width=16)   # random: arbitrary stops
    for threshold in (0.3, 0.9):
        sm = flashmm.wrap(target, Eagle3Drafter(net, tree=tree, depth=4, top_k=3, acceptance=head,
                                                threshold=threshold))
        for seed in (0, 1):
            ids = prompt(9, seed=seed)
            assert torch.equal(sm.generate(ids, max_new_tokens=20, eos_token_id=[]),
                               target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))


def test_rank_head_folder_loads_onto_its_eagle3_head_and_refuses_mismatches(tmp_path):
    target = tiny_lm("llama", seed=0)
    net = head_for(target, list(range(3, VOCAB)), seed=1)
    info = {"method": "eagle3", "target": {"name": "tiny", "vocab_size": VOCAB}}
    save_head(tmp_path / "eagle3", net, info, dict(tree="dynamic", depth=4, top_k=3))
    head = RankAcceptanceHead(net.cfg.hidden_size, ranks=4, width=16)
    save_specdecpp(tmp_path / "specdecpp", head, tmp_path / "eagle3",
                   {"method": "specdecpp", "target": info["target"], "threshold": 0.8})
    loaded = load(tmp_path / "specdecpp")
    assert isinstance(loaded, Eagle3Drafter) and loaded.threshold == 0.8 and loaded.tree == "dynamic"
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.acceptance.state_dict().values()))
    ids = prompt(8, seed=5)
    sm = flashmm.wrap(target, str(tmp_path / "specdecpp"))
    assert torch.equal(sm.generate(ids, max_new_tokens=20, eos_token_id=[]),
                       target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))
    with pytest.raises(ValueError, match="sequoia"):
        load(tmp_path / "specdecpp", tree="sequoia", accept=[0.5])
    with pytest.raises(ValueError, match="ranks"):
        load(tmp_path / "specdecpp", top_k=5)
    draft = reduced(target, list(range(3, 67)))
    save_reduced_lm(tmp_path / "fastdraft", draft, {"method": "fastdraft", "target": info["target"]})
    save_specdecpp(tmp_path / "wrong", head, tmp_path / "fastdraft", {"method": "specdecpp", "target": info["target"]})
    with pytest.raises(ValueError, match="EAGLE-3"):
        load(tmp_path / "wrong")


def test_rank_examples_agree_with_positional_acceptance():
    """The labels' rank histogram is Sequoia's positional acceptance vector of the same head on the same
    text (flashmm.train.eagle3.positional_acceptance: both read drafted_ranks, whose states
    test_eagle3 checks against drafting), and every (position, depth) pair gets one label."""
    target = tiny_lm("llama", seed=0)
    net = head_for(target, list(range(0, VOCAB, 2)), seed=3)
    embed = E.FrozenEmbedding(target.get_input_embeddings().weight.detach())
    examples = greedy_examples(target, 3, 14, 4)
    data = A.rank_examples(net, embed, examples, steps=3, ranks=4, log=lambda m: None)
    accept, pairs = E.positional_acceptance(net, embed, examples, 3, ranks=4)
    assert len(data["label"]) == pairs and set(data["depth"].tolist()) == {0, 1, 2}
    hist = torch.bincount(data["label"], minlength=5)[:4].double() / pairs
    assert torch.allclose(hist, torch.tensor(accept, dtype=torch.float64), atol=1e-9)
    head = RankAcceptanceHead(net.cfg.hidden_size, ranks=4, width=16)
    metrics = A.rank_metrics(head, data)
    assert sum(m["examples"] for m in metrics.values()) == pairs


SHIPPED_EAGLE3 = Path(__file__).resolve().parents[1] / "assets/text_drafters/smollm2/specdecpp_eagle3"


def test_shipped_eagle3_acceptance_head_is_exact_on_smollm2(smollm2):
    if not (SHIPPED_EAGLE3 / "drafter.json").exists():
        pytest.skip("specdecpp_eagle3 is not built (the python -m flashmm.train specdecpp command in docs/methods.md)")
    model, tokenizer = smollm2
    drafter = load(SHIPPED_EAGLE3, adaptive=False)   # draft every step: exactness of what the head lets through
    assert isinstance(drafter, Eagle3Drafter) and isinstance(drafter.acceptance, RankAcceptanceHead)
    ids = chat_prompt(tokenizer, "Name three rivers in Europe.")
    sm = flashmm.wrap(model, drafter)
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False),
                       model.generate(ids, max_new_tokens=24, do_sample=False))
    assert sm.last_stats.tau > 1.2
