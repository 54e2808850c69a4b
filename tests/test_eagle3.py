"""EAGLE-3 heads and EAGLE-2 dynamic trees: multi-layer features through the engines, training-time
test equal to what drafting computes, the grown tree equal to a brute-force reference that runs the
head on every node's path alone, greedy identity with model.generate, sampled output with the
target's distribution (a biased twin must fail), and the shipped SmolLM2 head."""
import math
from pathlib import Path

import pytest
import torch

import flashmm
from flashmm.drafters import Eagle3Drafter, load
from flashmm.drafters.base import Drafter, SequenceStart, root_only
from flashmm.drafters.nets.eagle3_net import Eagle3Config, Eagle3Net
from flashmm.tree.shapes import sequoia_tree
from flashmm.train import eagle3 as E
from flashmm.train import eagle3_batched as B
from flashmm.tree.draft import Draft
from flashmm.tree.dynamic import grow

from stats_utils import chi_square_pvalue
from test_sampling_exactness import PROMPT, SAMPLING, exact_joint, histogram, models  # noqa: F401 (fixture)
from text_models import VOCAB, chat_prompt, prompt, tiny_lm

LAYERS = (2, 1, 0)


def head_for(target, rows: list[int], seed: int = 0) -> Eagle3Net:
    torch.manual_seed(seed)
    net = Eagle3Net(Eagle3Config.for_target(target.config, len(rows), LAYERS))
    net.set_vocab(torch.tensor(rows))
    return net.eval()


def features_of(target, ids: torch.Tensor, layers=LAYERS) -> torch.Tensor:
    """Reference: the target's output_hidden_states at ``layers``, concatenated [1, T, n * d]."""
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in layers], dim=-1)


# ---------------------------------------------------------------- multi-layer features in the engines

SEEN: list = []   # (kind, committed or prompt ids, features) from every Spy, forks included


class Spy(Drafter):
    """Drafts nothing; records the features the engine hands over."""

    needs_hidden_states = True
    feature_layers = (0, 2)

    def begin(self, start):
        SEEN.append(("start", start.input_ids.clone(), start.hidden_states))

    def propose(self, committed, max_tokens, sampling, generator):
        return root_only(committed)

    def observe(self, step):
        SEEN.append(("step", step.committed.clone(), step.hidden_states))


@pytest.mark.parametrize("rows", [1, 2])
def test_feature_layers_reach_the_drafter(rows):
    """Single-row and batched engines hand a drafter the concatenated output_hidden_states it names."""
    target = tiny_lm("llama", seed=0)
    ids = torch.cat([prompt(7, seed=1 + b) for b in range(rows)])
    SEEN.clear()
    out = flashmm.wrap(target, Spy()).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                               eos_token_id=[])
    assert out.shape == (rows, 11) and len(SEEN) == rows * 3   # begin + 2 observes (none after the last step)
    for kind, tokens, hidden in SEEN:
        row = next(b for b in range(rows) if torch.equal(out[b, : tokens.shape[1]], tokens[0]))
        full = features_of(target, out[row: row + 1], layers=(0, 2))                  # [1, 11, 2d]
        if kind == "start":
            assert torch.allclose(hidden, full[:, :7], atol=1e-4)
        else:   # a root-only step: the root's features (the root is the next-to-last committed token)
            assert torch.allclose(hidden[0, 0], full[0, tokens.shape[1] - 2], atol=1e-4)


# ---------------------------------------------------------------- training-time test = drafting

def test_ttt_outputs_equal_the_drafted_chain():
    """Step j's output at unit t is what drafting computes for the depth-(j+1) unit after the
    committed prefix x_0 .. x_{t+1}, when the drafted tokens are the sequence's own."""
    target = tiny_lm("llama", seed=0)
    net = head_for(target, list(range(VOCAB)), seed=3).double()
    ids = prompt(12, seed=4)[0]
    feats = features_of(target, ids[None])[0].double()
    embed = E.FrozenEmbedding(target.get_input_embeddings().weight.detach().double())
    ex = E.Example(ids, feats, torch.zeros(12, 1, dtype=torch.long), torch.zeros(12, 1), torch.zeros(12), 4)
    first, outputs = E.ttt_outputs(net, embed, ex, steps=3)
    drafter = Eagle3Drafter(net, tree="chain", depth=3, adaptive=False)
    drafter._embed = embed
    for t in (first, 6, 8):
        # reference: a fresh drafter on x_0 .. x_{t+1} (features 0 .. t), chain tokens forced to the truth
        drafter.begin(SequenceStart(input_ids=ids[None, : t + 1], hidden_states=feats[None, : t + 1]))
        drafter._sync(ids[None, : t + 2])
        out, past = drafter._root_out, drafter._past
        assert torch.allclose(out, outputs[0][t - first], atol=1e-9)
        for step in (1, 2):
            emb = embed(ids[t + 1 + step: t + 2 + step])[None]
            out_all, past = net(emb, out[None, None], torch.tensor([[t + step]]),
                                torch.ones(1, 1, past[0].shape[2] + 1, dtype=torch.bool), past)
            out = out_all[0, 0]
            assert torch.allclose(out, outputs[step][t - first], atol=1e-9), (t, step)


def greedy_examples(target, count: int, max_new_tokens: int, top_k: int) -> list:
    """Training examples of the target's own greedy answers to ``count`` 6-token prompts (seeds 0..)."""
    examples = []
    for seed in range(count):
        ids = target.generate(prompt(6, seed=seed), max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=None)[0]
        with torch.no_grad():
            logits = target(ids[None]).logits[0]
        values, top = logits.topk(top_k, dim=-1)
        examples.append(E.Example(ids, features_of(target, ids[None])[0], top, values, logits.logsumexp(-1), 6))
    return examples


def test_training_lowers_the_loss():
    target = tiny_lm("llama", seed=0)
    net = head_for(target, list(range(VOCAB)), seed=0)
    embed = E.FrozenEmbedding(target.get_input_embeddings().weight.detach())
    examples = greedy_examples(target, 6, 18, 8)
    rows = E.target_rows(net)
    for style in ("plain", "hass", "griffin"):
        opts = E.TrainOptions(style=style, ttt_steps=3, steps=60, lr=3e-3, warmup=5, checkpoint_every=1000)
        trial = head_for(target, list(range(VOCAB)), seed=0)
        before = sum(float(E.sequence_loss(trial, embed, ex, rows, opts)[0]) for ex in examples)
        E.train(trial, embed, examples, opts, work_dir=_tmp(style), log=lambda m: None)
        after = sum(float(E.sequence_loss(trial, embed, ex, rows, opts)[0]) for ex in examples)
        assert after < 0.6 * before, (style, before, after)
    # the last trained head drafts the target's own continuation
    drafter = Eagle3Drafter(trial, tree="dynamic", depth=4, top_k=3, adaptive=False)
    ids = prompt(6, seed=1)
    sm = flashmm.wrap(target, drafter)
    assert torch.equal(sm.generate(ids, max_new_tokens=18, eos_token_id=[]),
                       target.generate(ids, max_new_tokens=18, do_sample=False, eos_token_id=None))
    assert sm.last_stats.tau > 1.5


def _tmp(name):
    import tempfile  # noqa: PLC0415

    return Path(tempfile.mkdtemp(prefix=f"eagle3_{name}_"))


# ---------------------------------------------------------------- EAGLE-2 trees against brute force

def brute_expand(net, embed, committed: torch.Tensor, feats: torch.Tensor):
    """expand() that runs the head from scratch, causally, on the committed units and then the
    node's own path (no cache, no tree mask)."""
    n = committed.shape[1] - 1

    def path_units(nodes, index):
        chain = []
        while index >= 0:
            chain.append(index)
            index = nodes[index].parent
        return chain[::-1]

    def run(nodes, index):
        path = path_units(nodes, index) if index >= 0 else []
        ctx = embed(committed[0, 1:])                                                  # units 0 .. n-1
        hidden = net.fuse(feats[0, :n])
        tokens = [int(net.draft_to_target[nodes[i].row]) for i in path]
        embeds = torch.cat([ctx, embed(torch.tensor(tokens, dtype=torch.long))]) if tokens else ctx
        # sequential: drafted units read the previous unit's output
        count = n + len(tokens)
        mask = torch.tril(torch.ones(count, count, dtype=torch.bool))
        out_ctx, _ = net(ctx[None], hidden[None], torch.arange(n)[None], mask[None, :n, :n])
        outs = out_ctx[0]
        for j in range(len(tokens)):
            full_hidden = torch.cat([hidden, outs[n - 1:]])                          # fused or own outputs
            out, _ = net(embeds[None, : n + j + 1], full_hidden[None, : n + j + 1],
                         torch.arange(n + j + 1)[None], mask[None, : n + j + 1, : n + j + 1])
            outs = torch.cat([out_ctx[0], out[0, n:]])
        return outs[-1]

    def expand(chosen, nodes):
        return torch.stack([net.logits(run(nodes, i)).log_softmax(-1) for i in chosen])

    return expand, run


def test_dynamic_tree_equals_brute_force_per_node_paths():
    target = tiny_lm("llama", seed=0)
    net = head_for(target, list(range(0, VOCAB, 2)), seed=5).double()
    with torch.no_grad():
        net.lm_head.weight.mul_(4.0)
    embed = E.FrozenEmbedding(target.get_input_embeddings().weight.detach().double())
    ids = prompt(10, seed=6)
    feats = features_of(target, ids).double()
    drafter = Eagle3Drafter(net, tree="dynamic", depth=4, top_k=3, adaptive=False)
    drafter._embed = embed
    drafter.begin(SequenceStart(input_ids=ids[:, :9], hidden_states=feats[:, :9]))
    drafter._sync(ids)
    mine = drafter.grow(ids, max_tokens=12)
    expand, run = brute_expand(net, embed, ids, feats)
    root = net.logits(run([], -1)).log_softmax(-1)
    assert torch.allclose(root, net.logits(drafter._root_out).log_softmax(-1), atol=1e-9)
    ref = grow(root, expand, top_k=3, depth=4, max_tokens=12)
    assert mine.parents == ref.parents and mine.rows == ref.rows
    assert max(abs(a - b) for a, b in zip(mine.scores, ref.scores)) < 1e-9
    assert len(mine.rows) == 12 and max(_depths(mine.parents)) >= 3       # a real tree, several levels deep
    # siblings are distinct (deterministic children) and every kept node's parent is kept
    pairs = list(zip(mine.parents, mine.rows))
    assert len(set(pairs)) == len(pairs) and all(p <= i for i, p in enumerate(mine.parents))


def test_sequoia_tree_equals_brute_force_ranks():
    """tree="sequoia": node (r1..rd) is the r_d-th most likely child, under the head run from
    scratch on that node's own path; the shape is Sequoia's programme for the vector."""
    target = tiny_lm("llama", seed=0)
    net = head_for(target, list(range(0, VOCAB, 2)), seed=5).double()
    embed = E.FrozenEmbedding(target.get_input_embeddings().weight.detach().double())
    ids = prompt(10, seed=6)
    feats = features_of(target, ids).double()
    accept = [0.5, 0.2, 0.1]
    drafter = Eagle3Drafter(net, tree="sequoia", depth=3, adaptive=False, accept=accept)
    drafter._embed = embed
    drafter.begin(SequenceStart(input_ids=ids[:, :9], hidden_states=feats[:, :9]))
    drafter._sync(ids)
    mine = drafter.grow(ids, max_tokens=7)
    paths = drafter.sequoia_paths(7)
    assert sorted(paths) == sorted(sequoia_tree(accept, 8, 3)[1].rank_paths())
    expand, run = brute_expand(net, embed, ids, feats)
    root = net.logits(run([], -1)).log_softmax(-1)
    order = sorted(paths, key=lambda p: (len(p), p))
    for i, path in enumerate(order):
        parent = mine.parents[i]
        logp = root if parent == 0 else expand([parent - 1], _nodes(mine))[0]
        assert mine.rows[i] == int(logp.argsort(descending=True)[path[-1]])
        assert parent == (0 if len(path) == 1 else order.index(path[:-1]) + 1)


def _nodes(grown):
    from flashmm.tree.dynamic import Node  # noqa: PLC0415

    depth = _depths(grown.parents)
    return [Node(p - 1, r, s, depth[i + 1]) for i, (p, r, s) in enumerate(zip(grown.parents, grown.rows, grown.scores))]



def test_sequoia_needs_a_vector():
    net = head_for(tiny_lm("llama", seed=0), list(range(3, VOCAB)), seed=1)
    for bad in (None, [], [0.7, 0.6], [-0.1]):
        with pytest.raises(ValueError, match="accept"):
            Eagle3Drafter(net, tree="sequoia", accept=bad)

def _depths(parents):
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth


@pytest.mark.parametrize("tree", ["chain", "dynamic", "sequoia"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_is_token_identical(tree, arch):
    target = tiny_lm(arch, seed=0)
    net = head_for(target, list(range(3, VOCAB)), seed=1)
    accept = [0.4, 0.2, 0.1] if tree == "sequoia" else None
    sm = flashmm.wrap(target, Eagle3Drafter(net, tree=tree, depth=3, top_k=3, adaptive=False, accept=accept))
    for seed in (0, 1):
        ids = prompt(9, seed=seed)
        assert torch.equal(sm.generate(ids, max_new_tokens=20, eos_token_id=[]),
                           target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))


def test_pricing_keeps_the_best_paying_prefix_and_stays_exact():
    """adaptive: the verified tree is the grown tree's best nodes by score (parents included, tree
    order kept); a head that never pays pauses drafting; greedy output stays generate's."""
    target = tiny_lm("llama", seed=0)
    net = head_for(target, list(range(3, VOCAB)), seed=1)
    drafter = Eagle3Drafter(net, tree="dynamic", depth=3, top_k=3)
    drafter.pricing = "constants"  # the constants' prices, not this machine's timing of a tiny model
    sm = flashmm.wrap(target, drafter)
    ids = prompt(9, seed=2)
    assert torch.equal(sm.generate(ids, max_new_tokens=20, eos_token_id=[]),
                       target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))
    from flashmm.tree.dynamic import GrownTree
    grown = GrownTree(parents=[0, 0, 1, 2, 3], rows=[5, 6, 7, 8, 9], scores=[-0.1, -0.2, -0.3, -3.0, -0.4],
                      expanded=3)
    token = net.draft_to_target[torch.arange(10)].tolist()          # of each head row
    parent_token = {token[r]: (token[grown.rows[p - 1]] if p else None) for r, p in zip(grown.rows, grown.parents)}
    score = {token[r]: s for r, s in zip(grown.rows, grown.scores)}
    drafter.evidence, drafter._backoff = [0.0, 0.0], 0
    draft = drafter._draft(ids, grown, [], 0, max_tokens=8)
    kept, parents = draft.tokens[0].tolist(), draft.tree.parents.tolist()
    assert sorted((score[t] for t in kept[1:]), reverse=True) == sorted(grown.scores, reverse=True)[:len(kept) - 1]
    assert token[8] not in kept                                     # the -3.0 node is not worth it
    assert all(p < i for i, p in enumerate(parents) if i)            # parents before children
    assert [kept[p] if p else None for p in parents[1:]] == [parent_token[t] for t in kept[1:]]
    drafter.evidence = [0.0, 1000.0]  # nothing ever accepted of a thousand predicted: no draft, and a pause
    assert drafter._draft(ids, grown, [], 0, max_tokens=8).tokens.shape == (1, 1) and drafter._pause >= 1


def test_a_rows_head_passes_are_priced_at_its_share_of_a_batched_step():
    """In a batch every row's head passes still run on their own while the row's share of the verify step
    shrinks: repriced for the batch, a pass costs t1 alone / t1 share times as many of the new unit, so a
    tree that repaid its passes alone pauses in a batch of rows whose share is a quarter of that step."""
    from flashmm.tree.cost import VerifyCost
    from flashmm.tree.dynamic import GrownTree

    target = tiny_lm("llama", seed=0)
    drafter = Eagle3Drafter(head_for(target, list(range(3, VOCAB)), seed=1), tree="dynamic", depth=3, top_k=3)
    drafter.pricing = "constants"
    flashmm.wrap(target, drafter)
    drafter.length.verify_cost = VerifyCost((1, 2, 4, 8), (0.04, 0.042, 0.044, 0.05))
    drafter._pass_cost = 0.3                    # a pass reads 0.3 of the target's weights
    grown = GrownTree(parents=[0, 0, 1, 2], rows=[5, 6, 7, 8], scores=[-0.1, -0.2, -0.3, -0.4], expanded=3,
                      levels=3)
    ids = prompt(9, seed=2)

    def pauses() -> bool:
        drafter.evidence, drafter._backoff, drafter._pause = [0.0, 0.0], 0, 0
        drafter._draft(ids, grown, [], 0, max_tokens=8)
        return drafter._pause > 0

    alone = drafter._worth_growing(4)["level_mass"]
    assert not pauses()      # (1 + 3.1 expected) / (~1.1 verify + 4 passes * 0.3) > 1
    drafter.reprice(VerifyCost((1, 2, 4, 8), (0.01, 0.0105, 0.011, 0.0125)))   # a row's share: t1 / 4
    assert drafter.length.lone_forward == pytest.approx(4.0)
    assert drafter._worth_growing(4)["level_mass"] == pytest.approx(4 * alone)
    assert pauses()          # (1 + 3.1) / (~1.1 + 4 passes * 1.2) < 1


# ---------------------------------------------------------------- sampling

class ClaimsSampled(Eagle3Drafter):
    """Biased twin: drafts the same deterministic top-k trees but claims its children were drawn
    i.i.d. from its softmax (q_probs), so the verifier corrects for a distribution it never used."""

    def propose(self, committed, max_tokens, sampling, generator):
        draft = super().propose(committed, max_tokens, sampling, generator)
        q = torch.zeros(1, draft.tree.num_nodes, self.net.cfg.vocab_size)
        q[..., self.net.draft_to_target] = 1.0 / self.net.cfg.draft_vocab_size
        q[..., self.net.draft_to_target[0]] += 0.5
        return Draft(tokens=draft.tokens, tree=draft.tree, q_probs=q / q.sum(-1, keepdim=True))


def test_sampling_keeps_the_target_distribution_and_a_biased_twin_fails(models):  # noqa: F811 (fixture)
    target, _ = models
    net = head_for(target, [0, 2, 3, 5, 6], seed=4)
    with torch.no_grad():
        net.lm_head.weight.mul_(20.0)           # confident and often wrong: rejections matter
    sm = flashmm.wrap(target, Eagle3Drafter(net, tree="dynamic", depth=2, top_k=2, adaptive=False))
    p = chi_square_pvalue(histogram(sm), exact_joint(target))
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    # drafting every step (adaptive=False): a length priced by a loaded machine might never draft
    biased = flashmm.wrap(target, ClaimsSampled(net, tree="dynamic", depth=2, top_k=2, adaptive=False))
    counts = torch.zeros(8, 8)                  # 300 trials suffice to expose the bias
    g = torch.Generator().manual_seed(99)
    for _ in range(300):
        a, b = biased.generate(PROMPT, max_new_tokens=2, generator=g, **SAMPLING)[0, -2:].tolist()
        counts[a, b] += 1
    assert chi_square_pvalue(counts, exact_joint(target)) < 1e-3


# ---------------------------------------------------------------- the shipped head

SHIPPED = Path(__file__).resolve().parents[1] / "assets/text_drafters/smollm2/eagle3"


def test_shipped_head_is_exact_on_smollm2(smollm2):
    if not (SHIPPED / "drafter.json").exists():
        pytest.skip("eagle3 is not built (its drafter.json's python -m flashmm.train eagle3 command)")
    model, tokenizer = smollm2
    drafter = load(SHIPPED, adaptive=False)  # draft every step: exactness of the drafts themselves
    assert isinstance(drafter, Eagle3Drafter) and drafter.info["method"] == "eagle3"
    ids = chat_prompt(tokenizer, "List three primary colours.")
    sm = flashmm.wrap(model, drafter)
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False),
                       model.generate(ids, max_new_tokens=24, do_sample=False))
    assert sm.last_stats.tau > 1.3          # trained: it drafts what SmolLM2 writes


def test_fine_tuning_starts_from_the_shipped_head_with_the_targets_exact_rows(smollm2):
    """tools/drafters/build_eagle3 --init (flashmm.train.eagle3_cache.start_from): the saved head's trained weights, its LM head and final norm reset to
    the target's own fp32 rows (the saved ones are fp16-rounded) and frozen, as for a new head."""
    if not (SHIPPED / "drafter.json").exists():
        pytest.skip("eagle3 is not built (its drafter.json's python -m flashmm.train eagle3 command)")
    from flashmm.train.eagle3_cache import start_from  # noqa: PLC0415

    model, _ = smollm2
    net, saved = start_from(SHIPPED, model), load(SHIPPED).net
    assert torch.equal(net.lm_head.weight, model.get_output_embeddings().weight[net.draft_to_target].float())
    assert torch.equal(net.norm.weight, model.get_decoder().norm.weight.float())
    assert not net.lm_head.weight.requires_grad and not net.norm.weight.requires_grad
    assert net.fc.weight.requires_grad and torch.equal(net.fc.weight, saved.fc.weight.float())
    assert torch.equal(net.draft_to_target, saved.draft_to_target)


# ---------------------------------------------------------------- FLASH's K = 1 head grows the same trees

def test_flash_k1_eagle2_tree_equals_brute_force_and_is_exact():
    from flashmm.drafters import FlashDrafter  # noqa: PLC0415
    from flashmm.drafters.nets.flash_modules import head_logits  # noqa: PLC0415

    target = tiny_lm("llama", seed=0)
    drafter = FlashDrafter.from_target(target, tokens_per_step=1, seed=3, tree="eagle2", depth=3, top_k=3)
    sm = flashmm.wrap(target, drafter)
    ids = prompt(9, seed=2)
    assert torch.equal(sm.generate(ids, max_new_tokens=16, eos_token_id=[]),
                       target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None))
    # one step's tree, in float64, against the head run from scratch on each node's path (plain causal units)
    from flashmm.config import SamplingParams  # noqa: PLC0415
    from flashmm.targets import CausalLMTarget  # noqa: PLC0415

    target64 = target.double()
    drafter = FlashDrafter(drafter.net.double(), tree="eagle2", depth=3, top_k=3)
    drafter.bind(CausalLMTarget(target64))
    net, head, embed = drafter.net, drafter._head, drafter._embed
    committed = prompt(12, seed=5)
    n = committed.shape[1] - 1
    with torch.no_grad():
        hs = target64(committed, output_hidden_states=True).hidden_states[-1]               # [1, T, d]
        drafter.begin(SequenceStart(input_ids=committed[:, :n], hidden_states=hs[:, :n]))
        draft = drafter.propose(committed, 14, SamplingParams(), None)
        base = net.text_units(embed(committed[0, 1:]), hs[0, :n])                          # units 0 .. n-1

        def run(nodes, index):
            path = []
            while index >= 0:
                path.append(index)
                index = nodes[index].parent
            units = base
            out = net(units[None], torch.arange(n), None)[0][0, -1, 0]                     # f̂_n
            for i in reversed(path):
                units = torch.cat([units, net.text_units(embed(torch.tensor([nodes[i].row])), out[None])])
                out = net(units[None], torch.arange(units.shape[0]), None)[0][0, -1, 0]
            return head_logits(head, out, None).log_softmax(-1)

        ref = grow(run([], -1), lambda chosen, nodes: torch.stack([run(nodes, i) for i in chosen]),
                   top_k=3, depth=3, max_tokens=14)
    assert draft.tree.parents.tolist() == [-1] + ref.parents
    assert draft.tokens[0, 1:].tolist() == ref.rows and max(_depths(ref.parents)) == 3


def test_growth_stops_at_a_depth_whose_nodes_hold_too_little_probability():
    """level_mass: growth stops before expanding a depth whose chosen nodes hold less cumulative
    probability than it; the tree equals the one grown to the depth before (reference: no limit)."""
    vocab = 12

    def expand(chosen, nodes):
        masses.append(sum(math.exp(nodes[i].score) for i in chosen))
        logits = [torch.arange(vocab, dtype=torch.float).roll(nodes[i].row) * 0.7 for i in chosen]
        return torch.stack(logits).log_softmax(-1)

    root = (torch.arange(vocab, dtype=torch.float) * 0.9).log_softmax(-1)
    masses: list[float] = []
    grow(root, expand, top_k=3, depth=6, max_tokens=40)
    unlimited = list(masses)  # the chosen nodes' mass before expanding levels 2 .. 6
    assert len(unlimited) == 5 and all(a > b for a, b in zip(unlimited, unlimited[1:]))
    masses.clear()
    limited = grow(root, expand, top_k=3, depth=6, max_tokens=40, level_mass=(unlimited[2] + unlimited[3]) / 2)
    assert len(masses) == 3  # levels 2, 3, 4 expanded; level 5's nodes hold too little
    masses.clear()
    reference = grow(root, expand, top_k=3, depth=4, max_tokens=40)
    assert (limited.parents, limited.rows, limited.scores, limited.levels) == \
        (reference.parents, reference.rows, reference.scores, reference.levels)


def test_padded_batches_train_as_their_sequences_do():
    """padded_loss on one sequence is sequence_loss (labels: the next greedy token = the target's
    argmax); on a ragged batch its summed loss is the sum of its rows' (padding reaches no counted
    unit); PaddedExamples.from_target holds the target's own features at the layers."""
    target = tiny_lm("llama", seed=0)
    net = head_for(target, list(range(VOCAB)), seed=5).double()
    embed = E.FrozenEmbedding(target.get_input_embeddings().weight.detach().double())
    rows = E.target_rows(net)
    examples = [E.Example(ex.ids, ex.features.double(), ex.topk_ids, ex.topk_logits, ex.logsumexp, ex.prompt_len)
                for ex in greedy_examples(target, 3, 10, 4)]
    examples[1] = E.Example(examples[1].ids[:13], examples[1].features[:13], examples[1].topk_ids[:13],
                            examples[1].topk_logits[:13], examples[1].logsumexp[:13], 6)
    store = B.PaddedExamples.from_target(target.double(), [(ex.ids.tolist(), ex.prompt_len) for ex in examples],
                                         LAYERS, batch_tokens=20)
    target.float()
    for i, ex in enumerate(examples):
        assert torch.allclose(store.feats[store.offsets[i]:store.offsets[i + 1]].double(), ex.features, atol=1e-2)
    for style in ("plain", "griffin"):
        opts = E.TrainOptions(style=style, ttt_steps=3)
        summed, counted = 0.0, {}
        for i, ex in enumerate(examples):
            one = (ex.ids[None], ex.features[None], torch.tensor([len(ex.ids)]), torch.tensor([ex.prompt_len]))
            loss, counts = B.padded_loss(net, embed, *one, rows, opts)
            ref_loss, ref_counts = E.sequence_loss(net, embed, ex, rows, opts)
            assert torch.allclose(loss, ref_loss, atol=1e-10) and counts == ref_counts, (style, i)
            summed += float(B.padded_loss(net, embed, *one, rows, opts, reduce="sum")[0])
            for step, (right, total) in counts.items():
                counted[step] = [counted.get(step, [0, 0])[0] + right, counted.get(step, [0, 0])[1] + total]
        ids, _, lengths, prompt_lens = store.batch([0, 1, 2])
        feats = torch.zeros(3, ids.shape[1], examples[0].features.shape[1], dtype=torch.float64)
        for i, ex in enumerate(examples):
            feats[i, :len(ex.ids)] = ex.features
        loss, counts = B.padded_loss(net, embed, ids, feats, lengths, prompt_lens, rows, opts, reduce="sum")
        assert math.isclose(float(loss), summed, rel_tol=1e-6) and counts == counted, style  # fp32 logits
    with pytest.raises(ValueError, match="HASS"):
        B.padded_loss(net, embed, *store.batch([0]), rows, E.TrainOptions(style="hass"))


def test_training_on_padded_batches_lowers_the_loss():
    target = tiny_lm("llama", seed=0)
    net = head_for(target, list(range(VOCAB)), seed=0)
    embed = E.FrozenEmbedding(target.get_input_embeddings().weight.detach())
    examples = greedy_examples(target, 6, 18, 8)
    store = B.PaddedExamples.from_target(target, [(ex.ids.tolist(), ex.prompt_len) for ex in examples], LAYERS,
                                         members=[0, 1, 2, 3, 4])
    assert sorted(i for b in store.batches(2, seed=0) for i in b) == [0, 1, 2, 3, 4]
    rows = E.target_rows(net)
    opts = E.TrainOptions(ttt_steps=3, steps=40, lr=3e-3, warmup=5, batch=2, checkpoint_every=1000)
    before = sum(float(E.sequence_loss(net, embed, store.example(i), rows, opts)[0]) for i in range(5))
    E.train(net, embed, store, opts, work_dir=_tmp("padded"), log=lambda m: None)
    after = sum(float(E.sequence_loss(net, embed, store.example(i), rows, opts)[0]) for i in range(5))
    assert after < 0.6 * before, (before, after)
