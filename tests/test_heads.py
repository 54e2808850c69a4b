"""Medusa, Hydra and MTP heads: exact decoding (greedy and sampled), the MTP drafter against a
teacher-forced forward, training on cached corpus features, the offline replay of τ against the
engine, and the shipped SmolLM2 heads."""
import itertools
import math
from pathlib import Path

import pytest
import torch

import flashmm
from flashmm.drafters import Hydra, Medusa, MTP, load
from flashmm.drafters.base import SequenceStart
from flashmm.drafters.head_base import save_heads, static_tree
from flashmm.drafters.suffix import LookupBranch
from flashmm.drafters.nets.hydra_net import HydraHeads
from flashmm.drafters.nets.medusa_net import MedusaHeads
from flashmm.drafters.nets.mtp_net import MTPModules
from flashmm.sampling import SamplingParams
from flashmm.tree.shapes import expected_accepted
from flashmm.train import head_replay as R
from flashmm.train import heads as H
from flashmm.train.corpus import features

from stats_utils import chi_square_pvalue
from test_eagle3_branches import LOOKUP_PROMPT
from test_sampling_exactness import exact_joint, histogram, models  # noqa: F401 (fixture)
from text_models import chat_prompt, prompt, tiny_lm

ANSWER = 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny target, its greedy answers to 20 random prompts and their cached features (final-normed layer)."""
    target = tiny_lm("llama", seed=3)
    sequences = []
    for seed in range(20):
        ids = prompt(8, seed=100 + seed)
        out = target.generate(ids, max_new_tokens=ANSWER, do_sample=False, eos_token_id=None)
        sequences.append((out[0].tolist(), 8))
    feats = features(target, sequences, layers=(target.config.num_hidden_layers,), top_k=8,
                     cache_dir=tmp_path_factory.mktemp("features"), shard_size=8)
    data = H.load_head_data(feats, list(range(16)), 0)
    held = H.load_head_data(feats, list(range(16, 20)), 0)
    return target, data, held


def tools(target):
    lm = target.get_output_embeddings().weight.detach()
    return lm, target.get_input_embeddings().weight.detach(), H.Vocab(None, lm.shape[0])


def mtp_modules(target, depth=3):
    return H.build_heads("mtp", target.config, depth, 96)


@pytest.fixture(scope="module")
def trained(corpus):
    """Each family trained briefly; also its held-out loss before and after."""
    target, data, held = corpus
    lm, embeds, vocab = tools(target)
    out = {}
    for method, steps, batch, lr in (("medusa", 80, 64, 1e-2), ("hydra", 80, 64, 1e-2), ("mtp", 30, 4, 3e-3)):
        torch.manual_seed(0)
        heads = H.build_heads(method, target.config, 3, 96) if method == "mtp" else H.build_heads(method, target.config, 3)

        def held_loss():
            with torch.no_grad():
                if method == "mtp":
                    return float(H.mtp_loss(heads, held, list(range(held.num_sequences)), lm, embeds, vocab, "reduced", "ce")[0])
                return float(H.batch_loss(heads, held, held.positions(3), lm, embeds, vocab, "reduced", "ce")[0])

        before = held_loss()
        H.train_heads(heads, data, lm, embeds, vocab, steps=steps, batch=batch, lr=lr, loss_vocab="reduced",
                      log=lambda m: None)
        out[method] = (heads, before, held_loss(), H.head_accuracy(heads, held, lm, embeds, vocab, ranks=4))
    return out


DRAFTERS = {
    "medusa_chain": lambda t: Medusa(t["medusa"][0], adaptive=False, accuracy=t["medusa"][3]),
    "medusa_tree": lambda t: Medusa(t["medusa"][0], adaptive=False, accuracy=t["medusa"][3], tree="static", max_draft_tokens=10),
    "hydra_chain": lambda t: Hydra(t["hydra"][0], adaptive=False, accuracy=t["hydra"][3]),
    "hydra_tree": lambda t: Hydra(t["hydra"][0], adaptive=False, accuracy=t["hydra"][3], tree="static", max_draft_tokens=10),
    "mtp_chain": lambda t: MTP(t["mtp"][0], adaptive=False),
}


def test_training_lowers_held_out_loss(trained):
    for method, (_, before, after, accuracy) in trained.items():
        assert after < before - 0.3, f"{method}: held-out loss {before:.2f} -> {after:.2f}"
        assert accuracy[0][0] > 0.1, f"{method}: head 1 top-1 accuracy {accuracy[0][0]:.2f} (chance: 1/128)"


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_greedy_identical_to_generate_and_replay_matches_engine(corpus, trained, kind):
    target, data, _ = corpus
    for s in range(2):
        ids = data.ids[int(data.starts[s]):int(data.starts[s]) + 8][None]
        sm = flashmm.wrap(target, DRAFTERS[kind](trained), draft_precision="fp32")  # (the replay drafts in fp32)
        out = sm.generate(ids, max_new_tokens=30, eos_token_id=[])
        assert torch.equal(out, target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None))
        # the offline replay (no target forward) reproduces the engine's steps exactly
        one = H.HeadData(**{k: getattr(data, k) for k in ("hidden", "ids", "topk_ids", "topk_logits", "lse")},
                         starts=data.starts, prompt_lens=data.prompt_lens)
        one.starts, one.prompt_lens = data.starts[s:s + 2], data.prompt_lens[s:s + 1]
        replay = DRAFTERS[kind](trained)
        replay.bind(R.ModelFacts(target))
        got = R.replay_tau(replay, one, max_new_tokens=30)
        assert got["steps"] == sm.last_stats.verify_steps and got["tau"] == pytest.approx(sm.last_stats.tau)
    assert sm.last_stats.tau > 1.1  # trained heads get drafts accepted (the accepted paths are exercised)


def test_mtp_draft_equals_teacher_forced_forward(corpus, trained):
    """Module k's drafted token equals the argmax of a plain causal forward of modules 1..k over the
    committed text followed by the tokens drafted before it (DeepSeek's training computation)."""
    target, data, _ = corpus
    modules = trained["mtp"][0]
    drafter = MTP(modules, adaptive=False)
    drafter.bind(R.ModelFacts(target))
    lm, embeds, _ = tools(target)
    a = int(data.starts[0])
    ids, h = data.ids[a:a + 30], data.hidden[a:a + 30].float()
    drafter.begin(SequenceStart(input_ids=ids[None, :12], hidden_states=h[None, :12]))
    from flashmm.drafters.base import StepResult  # noqa: PLC0415

    drafter.observe(StepResult(committed=ids[None, :16], accepted_len=3, path=torch.tensor([[0, 1, 2, 3]]),
                               hidden_states=h[None, 12:15]))
    root = 15
    drafted = drafter.propose(ids[None, :root + 1], 8, SamplingParams(), None).tokens[0, 1:].tolist()
    text = ids[:root + 1].tolist() + drafted
    with torch.no_grad():
        prev = h[None, :root]                                                   # h^0 at positions 0..R-1
        for k in range(modules.num_heads):
            tokens = torch.tensor(text[k + 1:k + 1 + root])                      # x_{i+k+1}
            prev, _ = modules.run(k, prev, embeds[tokens][None])
            assert int((modules.output(k, prev[0, -1]) @ lm.T).argmax()) == drafted[k]


def test_static_tree_takes_the_best_rank_products():
    """The tree's nodes are the 6 rank paths with the largest accuracy products, found by enumeration."""
    accuracy = [[0.7, 0.2, 0.05], [0.5, 0.2, 0.1], [0.3, 0.25, 0.1]]

    def product(path):
        value = 1.0
        for k, r in enumerate(path):
            value *= accuracy[k][r]
        return value

    tree = static_tree(accuracy, 6)
    assert tree.num_nodes == 7
    paths = []
    for node in range(1, tree.num_nodes):
        path, v = [], node
        while v:
            path.append(int(tree.ranks[v]))
            v = int(tree.parents[v])
        paths.append(tuple(path[::-1]))
    every = [p for depth in (1, 2, 3) for p in itertools.product(range(3), repeat=depth)]
    best = sorted((product(p) for p in every), reverse=True)[:6]
    assert sorted((product(p) for p in paths), reverse=True) == pytest.approx(best)
    assert expected_accepted(paths, [1.0, 1.0, 1.0]) == 6  # each path counted once


def random_medusa(target, seed=0, scale=0.3):
    torch.manual_seed(seed)
    heads = MedusaHeads(target.config.hidden_size, 3)
    with torch.no_grad():
        heads.weight.normal_(0, scale)
    return heads


def test_pricing_drafts_only_what_pays(corpus):
    """planned_tree: heads whose accuracy table says they are never right draft nothing (a plain step,
    still exact); accurate heads draft their whole tree. expected_accepted is the sum of path products."""
    target, data, _ = corpus
    ids = data.ids[:8][None]
    reference = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    hopeless = Medusa(random_medusa(target), tree="static", max_draft_tokens=6, accuracy=[[0.01] * 4] * 3)
    hopeless.pricing = "constants"  # a tiny model's measured verify cost is flat: drafting would be free
    sm = flashmm.wrap(target, hopeless)
    assert torch.equal(sm.generate(ids, max_new_tokens=12, eos_token_id=[]), reference)
    assert sm.last_stats.drafted_tokens == 0
    sure = Medusa(random_medusa(target), tree="static", max_draft_tokens=6, accuracy=[[0.95, 0.6, 0.3, 0.1]] * 3)
    sure.pricing = "constants"
    flashmm.wrap(target, sure)
    tree = sure.planned_tree(6)
    assert tree.num_nodes == 7
    products = {(): 1.0}
    for i in range(1, tree.num_nodes):  # brute force over the tree's paths, parents first
        path = tuple(int(tree.ranks[j]) for j in reversed(tree_path(tree, i)))
        products[path] = products[path[:-1]] * sure.accuracy[len(path) - 1][path[-1]]
    assert sure.expected_accepted(tree) == pytest.approx(sum(products.values()) - 1.0)


def test_heads_are_priced_at_a_batch_rows_share(corpus):
    """In a batch a row's heads still run on their own while its share of the verify step shrinks: repriced
    for rows whose share is a quarter of a lone step, the heads' own cost is 4x as many of the new unit, and a
    tree that repaid it alone is not drafted."""
    from flashmm.tree.cost import VerifyCost

    target, _, _ = corpus
    sure = Medusa(random_medusa(target), tree="static", max_draft_tokens=6, accuracy=[[0.95, 0.6, 0.3, 0.1]] * 3)
    sure.pricing = "constants"
    flashmm.wrap(target, sure)
    sure.draft_cost = lambda tree: 2.0          # the heads cost two lone-row target steps, for any tree
    sure.length.verify_cost = VerifyCost((1, 2, 4, 8), (0.04, 0.04, 0.04, 0.04))
    full = sure.tree_for(6)
    assert (1 + sure.expected_accepted(full)) / (1 + 2.0) > 1 > (1 + sure.expected_accepted(full)) / (1 + 4 * 2.0)
    assert sure.planned_tree(6).num_nodes == 7
    sure.reprice(VerifyCost((1, 2, 4, 8), (0.01, 0.01, 0.01, 0.01)))
    assert sure.length.lone_forward == pytest.approx(4.0) and sure.planned_tree(6) is None


def tree_path(tree, node):
    """Nodes from ``node`` up to (not including) the root."""
    out = []
    while node:
        out.append(node)
        node = int(tree.parents[node])
    return out


def test_medusa_sampling_is_exact_and_typical_lossy_is_not(models):  # noqa: F811 (fixture)
    target, _ = models
    exact = flashmm.wrap(target, Medusa(random_medusa(target), tree="static", max_draft_tokens=4, adaptive=False))
    p = chi_square_pvalue(histogram(exact), exact_joint(target))
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    lossy = flashmm.wrap(target, Medusa(random_medusa(target), tree="static", max_draft_tokens=4, adaptive=False), verifier="typical_lossy",
                         typical_epsilon=0.05, typical_delta=0.05)
    assert "lossy" in lossy.spec.verifier
    p = chi_square_pvalue(histogram(lossy), exact_joint(target))
    assert p < 1e-3, "Medusa with typical acceptance should be distinguishable from the target"


def chain_counting(drafter):
    """drafter, counting in drafter.with_chain the drafts holding a node the lookup chain added."""
    drafter.with_chain, propose = 0, drafter.propose

    def counted(*args):
        draft = propose(*args)
        drafter.with_chain += drafter._head_nodes is not None and False in drafter._head_nodes[1:]
        return draft
    drafter.propose = counted
    return drafter


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
@pytest.mark.parametrize("kind", ["medusa_tree", "hydra_tree", "mtp_chain"])
def test_lookup_branch_stays_greedy_exact(corpus, trained, kind, lookup):
    """A prompt lookup / suffix chain merged into the heads' tree: greedy output is generate's, and
    the chains are drafted (repeated prompts give them matches) and read against the text."""
    target, data, _ = corpus
    drafter = chain_counting(DRAFTERS[kind](trained))
    drafter.branch = LookupBranch(lookup, 6)
    sm = flashmm.wrap(target, drafter)
    for seed in (0, 1):
        ids = prompt(6, seed=seed).repeat(1, 4)
        out = sm.generate(ids, max_new_tokens=24, eos_token_id=[])
        assert torch.equal(out, target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None))
    assert drafter.with_chain and drafter.branch.chains.evidence


def test_lookup_branch_alone_while_the_heads_do_not_pay(corpus):
    """Heads whose table says they are never right draft nothing; the chain still drafts when it pays."""
    target, data, _ = corpus
    hopeless = chain_counting(Medusa(random_medusa(target), tree="static", max_draft_tokens=6, accuracy=[[0.01] * 4] * 3,
                                     lookup="ngram", lookup_tokens=4))
    hopeless.pricing = "constants"
    sm = flashmm.wrap(target, hopeless)
    hopeless.branch.chains.evidence = {(b, d): [100.0, 100.0] for b in range(5) for d in range(1, 5)}  # chains match
    ids = prompt(6, seed=2).repeat(1, 4)
    out = sm.generate(ids, max_new_tokens=16, eos_token_id=[])
    assert torch.equal(out, target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None))
    assert hopeless.with_chain and sm.last_stats.drafted_tokens > 0
    assert hopeless._predicted == 0.0   # the heads themselves were not drafting


def test_medusa_with_lookup_samples_the_target_distribution(models):  # noqa: F811 (fixture)
    """Every root the target can sample follows a 3 earlier, so the chain drafts from the first step;
    the same drafts verified by typical acceptance (lossy) are caught by the same test."""
    target, _ = models
    joint = exact_joint(target, LOOKUP_PROMPT)
    drafter = chain_counting(Medusa(random_medusa(target), tree="static", max_draft_tokens=4, adaptive=False, lookup="ngram"))
    p = chi_square_pvalue(histogram(flashmm.wrap(target, drafter), LOOKUP_PROMPT), joint)
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    assert drafter.with_chain
    lossy = flashmm.wrap(target, Medusa(random_medusa(target), tree="static", max_draft_tokens=4, adaptive=False, lookup="ngram"),
                         verifier="typical_lossy", typical_epsilon=0.05, typical_delta=0.05)
    assert chi_square_pvalue(histogram(lossy, LOOKUP_PROMPT), joint) < 1e-3


def test_folder_round_trip(tmp_path, corpus, trained):
    target, data, _ = corpus
    for method, cls in (("medusa", Medusa), ("hydra", Hydra), ("mtp", MTP)):
        heads = trained[method][0]
        save_heads(tmp_path / method, cls.name, heads, heads.config(), torch.arange(0, 128, 2),
                   {"method": method, "target": {"vocab_size": 128}, "accuracy": trained[method][3],
                    "drafting": {"tree": "chain"} if method == "mtp" else {"tree": "static", "max_draft_tokens": 5}})
        drafter = load(tmp_path / method)
        assert isinstance(drafter, cls) and drafter.tree == ("chain" if method == "mtp" else "static")
        assert drafter.max_draft_tokens == (None if method == "mtp" else 5)
        ids = data.ids[:8][None]
        out = flashmm.wrap(target, drafter).generate(ids, max_new_tokens=20, eos_token_id=[])
        assert torch.equal(out, target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))
    with pytest.raises(ValueError, match="trained drafter"):
        flashmm.wrap(target, "medusa")


SHIPPED = Path(__file__).resolve().parents[1] / "assets/text_drafters/smollm2"


@pytest.mark.parametrize("method", ["medusa", "hydra", "mtp"])
def test_shipped_heads_are_exact_on_smollm2(request, method):
    if not (SHIPPED / method / "drafter.json").exists():
        pytest.skip(f"{method} is not built (python -m flashmm.train {method}: the command in its drafter.json)")
    model, tokenizer = request.getfixturevalue("smollm2")
    drafter = load(SHIPPED / method, adaptive=False)  # draft every step: exactness of the drafts themselves
    assert drafter.info["method"] == method and drafter.info["target"]["vocab_size"] == model.config.vocab_size
    ids = chat_prompt(tokenizer, "List three primary colours.")
    sm = flashmm.wrap(model, drafter)
    out = sm.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, model.generate(ids, max_new_tokens=24, do_sample=False))
    assert drafter.info["accuracy"][0][0] > 0.3  # trained: head 1's top-1 is often right on held-out answers


def test_distill_loss_is_soft_cross_entropy_over_the_candidates():
    """Hydra++'s objective: -sum_j p~_j log q_j, p~ the target's top-k renormalised over the
    candidates it shares with the vocabulary; checked against float64 by hand."""
    g = torch.Generator().manual_seed(0)
    lm = torch.randn(10, 4, generator=g)
    vocab = H.Vocab(torch.tensor([1, 3, 4, 6, 8, 9]), 10)                      # rows 0..5
    states = torch.randn(2, 4, generator=g)
    teacher_ids = torch.tensor([[3, 5, 8], [9, 1, 2]])                         # 5 and 2 are outside the vocab
    teacher_logp = torch.tensor([[-0.5, -1.0, -2.0], [-0.2, -2.5, -3.0]])
    cand = torch.tensor([0, 1, 4, 5])                                           # target ids 1, 3, 8, 9
    loss, n = H.head_loss(states, torch.tensor([3, 9]), teacher_ids, teacher_logp, lm[vocab.ids], vocab, cand,
                          "distill")
    want = 0.0
    for b, pairs in enumerate([[(3, -0.5), (8, -2.0)], [(9, -0.2), (1, -2.5)]]):
        logq = (states[b].double() @ lm[vocab.ids[cand]].double().T).log_softmax(-1)
        slot = {int(t): i for i, t in enumerate(vocab.ids[cand])}
        total = sum(math.exp(lp) for _, lp in pairs)
        want -= sum(math.exp(lp) / total * float(logq[slot[t]]) for t, lp in pairs)
    assert n == 2 and float(loss) == pytest.approx(want, rel=1e-5)
    ce, _ = H.head_loss(states, torch.tensor([3, 9]), teacher_ids, teacher_logp, lm[vocab.ids], vocab, cand, "ce")
    logq0 = (states.double() @ lm[vocab.ids[cand]].double().T).log_softmax(-1)
    assert float(ce) == pytest.approx(-float(logq0[0, 1] + logq0[1, 3]), rel=1e-5)


def test_left_padded_batch_identical_to_batched_generate(corpus, trained):
    target, _, _ = corpus
    ids = torch.cat([prompt(10, seed=1), prompt(10, seed=2)])
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    for kind in ("medusa_tree", "hydra_tree", "mtp_chain"):
        sm = flashmm.wrap(target, DRAFTERS[kind](trained))
        out = sm.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[], pad_token_id=0)
        assert torch.equal(out, ref), kind
