"""DFlash: the block drafter against speculators' own DFlashDraftModel, and exact decoding with it.

tests/fixtures/speculators/dflash holds a tiny random DFlash checkpoint saved by speculators 0.9.0 and the
logits its training forward computed (tools/fixtures/speculators_fixtures.py), with the anchors that forward
picked. Rebuilding each anchor's block (the anchor token, then mask tokens, at the anchor's position onward,
over the context of the positions before it) flashmm's network must give the same logits. Then greedy
decoding of the fixture's target with the drafter equals the target's own generate, and a sampled run has
the target's distribution (χ², the lossy typical verifier failing the same test).
"""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import flashmm
from flashmm.drafters import DrafterFileError
from flashmm.drafters.dflash import DFlash

FIXTURES = Path(__file__).parent / "fixtures" / "speculators"


@pytest.fixture(scope="module")
def target():
    return LlamaForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.float32).eval()


def test_block_logits_equal_speculators(target):
    drafter = DFlash.from_speculators(FIXTURES / "dflash")
    ref = load_file(FIXTURES / "dflash" / "reference_logits.safetensors")
    embed = target.get_input_embeddings()
    net, size = drafter.net, drafter.net.config.block_size
    ours = []
    with torch.no_grad():
        for anchor in ref["anchor_positions"][0].tolist():
            positions = ref["position_ids"][0]
            context = net.context(ref["hidden_states"][0, :anchor], positions[:anchor])
            block = torch.full((size,), net.config.mask_token_id)
            block[0] = ref["input_ids"][0, anchor]
            ours.append(net.block_logits(embed(block), positions[anchor] + torch.arange(size), context))
    torch.testing.assert_close(torch.cat(ours), ref["logits"][0], atol=1e-4, rtol=1e-4)


def test_loads_by_folder_and_decodes_exactly(target):
    drafter = flashmm.drafters.load(FIXTURES / "dflash")
    assert isinstance(drafter, DFlash) and drafter.max_draft_tokens == 3
    for seed in (0, 1):
        prompt = torch.randint(3, 120, (1, 10), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
        sm = flashmm.wrap(target, FIXTURES / "dflash")
        assert torch.equal(sm.generate(prompt, max_new_tokens=24, do_sample=False), expected)
    batch = torch.randint(3, 120, (2, 8), generator=torch.Generator().manual_seed(2))
    assert torch.equal(sm.generate(batch, max_new_tokens=12, do_sample=False),
                       target.generate(batch, max_new_tokens=12, do_sample=False))


def test_drafts_what_the_block_predicts(target):
    """A step's draft is the chain of the block's argmaxes, mapped through d2t."""
    drafter = DFlash.from_speculators(FIXTURES / "dflash", max_draft_tokens=2, adaptive=False)
    sm = flashmm.wrap(target, drafter)
    prompt = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i] for i in drafter.feature_layers], -1)[0]
    from flashmm.drafters.base import SequenceStart
    drafter.begin(SequenceStart(input_ids=prompt, hidden_states=features[None]))
    committed = torch.cat([prompt, torch.tensor([[77]])], dim=1)
    draft = drafter.propose(committed, 8, None, None)
    net = drafter.net
    with torch.no_grad():
        context = net.context(features, torch.arange(9))
        block = torch.tensor([77, *[net.config.mask_token_id] * 3])
        logits = net.block_logits(sm.target.input_embeddings()(block), torch.arange(9, 13), context)
    assert draft.tokens[0].tolist() == [77, *net.draft_to_target[logits[1:3].argmax(-1)].tolist()]


def test_an_adaptive_chain_keeps_its_best_paying_prefix_and_pauses_when_nothing_pays(target):
    """adaptive (the default): the chain is cut where (1 + the calibrated cumulative top-1 probabilities kept)
    per unit of verify time is highest, found here by enumerating every length; a free verify keeps the whole
    chain, and when nothing repays the block forward the step is a plain one and drafting pauses."""
    from flashmm.drafters.base import SequenceStart
    from flashmm.tree.cost import VerifyCost

    drafter = DFlash.from_speculators(FIXTURES / "dflash")
    sm = flashmm.wrap(target, drafter)
    prompt = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in drafter.feature_layers], -1)[0]
        net = drafter.net
        block = torch.tensor([77, *[net.config.mask_token_id] * 3])
        logits = net.block_logits(sm.target.input_embeddings()(block), torch.arange(9, 13),
                                  net.context(features, torch.arange(9)))
    probs = logits[1:].double().softmax(-1)
    reach = probs.max(-1).values.cumprod(0).tolist()
    chain = [77, *net.draft_to_target[probs.argmax(-1)].tolist()]
    committed = torch.cat([prompt, torch.tensor([[77]])], dim=1)

    def propose(step_seconds, evidence):
        drafter.begin(SequenceStart(input_ids=prompt, hidden_states=features[None]))
        drafter.length.verify_cost = VerifyCost((1, 2, 3, 4), step_seconds)
        drafter.evidence, drafter._backoff, drafter._pause, drafter._pass_cost = list(evidence), 0, 0, 0.0
        return drafter.propose(committed, 8, None, None).tokens[0].tolist()

    assert propose((1.0, 1.0, 1.0, 1.0), (0.0, 0.0)) == chain                 # verifying more costs nothing
    calibration = 0.5 / reach[1]                             # (e0 + 2) / (e1 + 2): the second token's value is 0.5
    values = [min(1.0, calibration * r) for r in reach]
    seconds = (1.0, 1.0 + 0.6 * values[0], 1.0 + 0.6 * values[0] + 0.9 * values[1], 9.0)
    rates = [(1 + sum(values[:n])) / (seconds[n] / seconds[0]) for n in range(4)]   # n drafted: n + 1 nodes
    best = max(range(4), key=lambda n: (rates[n], -n))
    assert 0 < best < 3                                      # (1 here: the second token does not repay its 0.9)
    assert propose(seconds, (2.0 * calibration - 2.0, 0.0) if calibration >= 1 else (0.0, 2.0 / calibration - 2.0)) \
        == chain[: best + 1]
    assert propose((1.0, 5.0, 5.0, 5.0), (0.0, 1000.0)) == [77] and drafter._pause >= 1
    pause = drafter._pause
    assert drafter.propose(committed, 8, None, None).tokens.shape == (1, 1) and drafter._pause == pause - 1


def test_refusals(tmp_path, target):
    small = LlamaForCausalLM(type(target.config)(**{**target.config.to_dict(), "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="reads target layers"):
        flashmm.wrap(small, FIXTURES / "dflash")
    with pytest.raises(ValueError, match="max_draft_tokens must be 1 .. 3"):
        DFlash.from_speculators(FIXTURES / "dflash", max_draft_tokens=4)
    (tmp_path / "config.json").write_text('{"speculators_model_type": "dflash", "transformer_layer_config": {}}')
    with pytest.raises(DrafterFileError, match="needs"):
        DFlash.from_speculators(tmp_path)


SAMPLING = dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95)


def test_sampling_distribution():
    """Sampled with a random DFlash drafter on an 8-token target: the first two tokens' histogram matches the
    exact joint (χ²); the lossy typical verifier fails the same test. Each drafted token is the argmax of its
    block position (a point mass: q = None), so the verifier's residual rule keeps the target's distribution."""
    from flashmm.drafters.nets.dflash_net import DFlashConfig, DFlashNet
    from stats_utils import chi_square_pvalue, two_token_histogram, two_token_joint
    from text_models import tiny_lm

    vocab = 8
    target = tiny_lm("llama", seed=1, vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.15)
    torch.manual_seed(0)
    config = DFlashConfig(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          intermediate_size=64, feature_layers=(1, 2), draft_vocab_size=vocab, block_size=3,
                          mask_token_id=vocab - 1, rms_norm_eps=1e-6, rope_theta=10000.0)
    prompt = torch.tensor([[3, 5, 3, 5, 3]])
    joint = two_token_joint(target, prompt, SAMPLING)
    exact = flashmm.wrap(target, DFlash(DFlashNet(config), adaptive=False))   # drafting every step: the test's power
    assert chi_square_pvalue(two_token_histogram(exact, prompt, SAMPLING, 300, vocab), joint) > 1e-3
    biased = flashmm.wrap(target, DFlash(DFlashNet(config), adaptive=False), verifier="typical_lossy", typical_epsilon=0.05,
                          typical_delta=0.05)
    assert chi_square_pvalue(two_token_histogram(biased, prompt, SAMPLING, 300, vocab), joint) < 1e-3


def test_training_forward_equals_speculators(target):
    """All of the fixture's blocks in one masked forward (what training runs) give speculators' logits."""
    from flashmm.drafters.nets.dflash_net import anchored_logits

    net = DFlash.from_speculators(FIXTURES / "dflash").net
    ref = load_file(FIXTURES / "dflash" / "reference_logits.safetensors")
    with torch.no_grad():
        logits = anchored_logits(net, target.get_input_embeddings(), ref["hidden_states"][0], ref["input_ids"][0],
                                 ref["anchor_positions"][0], ref["position_ids"][0])
    torch.testing.assert_close(logits.flatten(0, 1), ref["logits"][0], atol=1e-4, rtol=1e-4)


def test_training_learns_and_the_folder_decodes_exactly(tmp_path):
    """A few hundred steps on a tiny target's own greedy continuations raise block accuracy above chance;
    the saved folder loads by path, decodes token-identically to generate, and training resumes."""
    from flashmm.train.dflash import DFlashTrainOptions, held_out_accept, new_net, save_dflash, train
    from flashmm.train.eagle3 import Example
    from text_models import tiny_lm

    target = tiny_lm("llama", seed=0)
    examples = []
    for seed in range(6):
        prompt = torch.randint(3, 120, (1, 6), generator=torch.Generator().manual_seed(seed))
        ids = target.generate(prompt, max_new_tokens=40, do_sample=False)[0]
        with torch.no_grad():
            out = target(ids[None], output_hidden_states=True)
        features = torch.cat([out.hidden_states[i][0] for i in (1, 2)], -1)
        top = out.logits[0].topk(4, -1)
        examples.append(Example(ids, features, top.indices, top.values, out.logits[0].logsumexp(-1), 6))
    torch.manual_seed(0)
    net = new_net(target, (1, 2), block_size=4, mask_token_id=127)
    opts = DFlashTrainOptions(steps=150, anchors=8, lr=3e-3, warmup=10, checkpoint_every=75)
    history = train(net, target.get_input_embeddings(), examples, opts, tmp_path / "work")
    assert history[-1]["accuracy"][0] > 0.5 and history[-1]["loss"] < history[0]["loss"]
    accept = history[-1]["accept"]
    assert len(accept) == 3 and all(len(row) == 8 for row in accept)
    held = held_out_accept(net, target.get_input_embeddings(), examples, max_anchors=8)
    tau, blocks = replayed_chain_tau(net, target.get_input_embeddings(), examples, max_anchors=8)
    assert held["chain_tau"] == pytest.approx(tau, abs=1e-3) and held["counted"][0] == blocks and tau > 1.5
    folder = save_dflash(tmp_path / "dflash", net, {"method": "dflash", "target": {"name": "tiny"}, "accept": accept})
    prompt = torch.randint(3, 120, (1, 6), generator=torch.Generator().manual_seed(1))
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(flashmm.wrap(target, folder).generate(prompt, max_new_tokens=30, do_sample=False), expected)
    sm = flashmm.wrap(target, flashmm.drafters.load(folder, adaptive=False))  # every step drafts, paying or not
    assert torch.equal(sm.generate(prompt, max_new_tokens=30, do_sample=False), expected)
    assert sm.last_stats.tau > 1.5  # it learned the target's continuations of this prompt
    tree = flashmm.wrap(target, flashmm.drafters.load(folder, tree=True, max_draft_tokens=6))
    assert torch.equal(tree.generate(prompt, max_new_tokens=30, do_sample=False), expected)
    assert tree.last_stats.tau >= sm.last_stats.tau - 0.5
    again = train(new_net(target, (1, 2), block_size=4, mask_token_id=127), target.get_input_embeddings(),
                  examples, opts, tmp_path / "work")
    assert again == history  # resumed at the end: nothing retrained



def replayed_chain_tau(net, embed, examples, max_anchors: int) -> tuple[float, int]:
    """(1 + mean accepted, blocks): each anchor's greedy chain from the block, accepted while it equals the
    target's own next tokens (the anchors held_out_accept takes)."""
    from flashmm.drafters.nets.dflash_net import anchored_logits

    size, accepted = net.config.block_size, []
    for example in examples:
        first, last = max(example.prompt_len - 1, 1), len(example.ids) - size
        anchors = torch.linspace(first, last, min(max_anchors, last - first + 1)).round().long().unique()
        with torch.no_grad():
            logits = anchored_logits(net, embed, example.features.float(), example.ids, anchors)[:, 1:]
        for a, row in zip(anchors.tolist(), net.draft_to_target[logits.argmax(-1)].tolist()):
            wanted = example.topk_ids[a:a + size - 1, 0].tolist()
            run = 0
            while run < size - 1 and row[run] == wanted[run]:
                run += 1
            accepted.append(run)
    return 1 + sum(accepted) / len(accepted), len(accepted)
