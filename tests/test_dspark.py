"""DSpark: the block drafter with a Markov head and a confidence head, against speculators' own DSparkDraftModel.

tests/fixtures/speculators/dspark* hold tiny random DSpark checkpoints saved by speculators 0.9.0 (one per
Markov head type: vanilla, gated, rnn; dspark_rnn with DFlash's alignment) and what its training forward
computed: the backbone's logits, the Markov-corrected logits and the confidence logits, with the anchors it
picked (tools/fixtures/speculators_fixtures.py). Rebuilding each anchor's block, flashmm's network must give
the same numbers; the chain it drafts must be, slot by slot, the argmax of those corrected logits given the
tokens drafted before; greedy decoding equals the target's generate and sampling keeps its distribution.
"""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import flashmm
from flashmm.drafters import DrafterFileError, DSpark
from flashmm.drafters.base import SequenceStart
from flashmm.drafters.nets.dflash_net import DFlashConfig, DFlashNet, anchored_hidden
from flashmm.drafters.nets.dspark_net import DSparkConfig, DSparkNet
from flashmm.targets import CausalLMTarget

from text_models import tiny_lm

FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
FOLDERS = ("dspark", "dspark_gated", "dspark_rnn")


@pytest.fixture(scope="module")
def target():
    return LlamaForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.float32).eval()


def teacher_forced(drafter: DSpark, target, ref):
    """speculators' training forward rebuilt from flashmm's network: every recorded anchor's block in one
    masked forward, its heads fed the block's true tokens → (backbone logits, corrected logits, confidence)."""
    net = drafter.dspark_net
    anchors = ref["anchor_positions"][0]
    with torch.no_grad():
        hidden = anchored_hidden(net.backbone, target.get_input_embeddings(), ref["hidden_states"][0],
                                 ref["input_ids"][0], anchors, ref["position_ids"][0])       # [A, size, d]
        block_tokens = ref["input_ids"][0][anchors[:, None] + torch.arange(hidden.shape[1])]
        logits, confidence = net.teacher_forced(hidden, block_tokens)
        return net.backbone.lm_head(hidden), logits, confidence


@pytest.mark.parametrize("folder", FOLDERS)
def test_logits_and_confidence_equal_speculators(target, folder):
    drafter = flashmm.drafters.load(FIXTURES / folder)
    ref = load_file(FIXTURES / folder / "reference_logits.safetensors")
    base, logits, confidence = teacher_forced(drafter, target, ref)
    torch.testing.assert_close(base.flatten(0, 1), ref["logits"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits.flatten(0, 1), ref["markov_logits"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(confidence.flatten(), ref["confidence_logits"][0], atol=1e-4, rtol=1e-4)
    # the Markov head matters: without its bias some argmax would differ (the fixture's W1 is scaled up)
    assert not torch.equal(ref["logits"][0].argmax(-1), ref["markov_logits"][0].argmax(-1))


def begun(drafter: DSpark, target, prompt: torch.Tensor, root: int) -> torch.Tensor:
    """Bind ``drafter``, begin it on ``prompt`` [1, T] with the target's features; committed = prompt + root."""
    drafter.bind(CausalLMTarget(target))
    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i] for i in drafter.feature_layers], -1)
    drafter.begin(SequenceStart(input_ids=prompt, hidden_states=features))
    return torch.cat([prompt, torch.tensor([[root]])], dim=1)


@pytest.mark.parametrize("folder", FOLDERS)
def test_chain_is_the_argmax_given_the_tokens_drafted_before(target, folder):
    """Teacher-forcing the drafted chain itself (the path checked against speculators above) gives, at every
    drafting slot, logits whose argmax is the token drafted there."""
    drafter = flashmm.drafters.load(FIXTURES / folder)
    prompt = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(4))
    committed = begun(drafter, target, prompt, 77)
    draft = drafter.propose(committed, 8, None, None)
    net, first = drafter.dspark_net, drafter.dspark_net.first_slot
    size = net.backbone.config.block_size
    assert draft.tokens.shape[1] - 1 == size - first == drafter.max_draft_tokens
    with torch.no_grad():
        context = net.backbone.context(drafter._features, torch.arange(9))
        block = torch.tensor([77, *[net.backbone.config.mask_token_id] * (size - 1)])
        hidden = net.backbone.block_hidden(target.get_input_embeddings()(block), torch.arange(9, 9 + size), context)
        positions_tokens = torch.cat([torch.tensor([77]), draft.tokens[0, 1:]])[None, :size]   # tokens at p ..
        logits, _ = net.teacher_forced(hidden[None], positions_tokens)
    rows = logits[0, first:].argmax(-1)
    assert draft.tokens[0, 1:].tolist() == net.backbone.draft_to_target[rows].tolist()


def test_confidence_schedule_stops_where_the_running_product_falls_below_the_threshold(target):
    full = flashmm.drafters.load(FIXTURES / "dspark")
    prompt = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(5))
    chain = full.propose(begun(full, target, prompt, 40), 8, None, None).tokens[0, 1:]
    rows, confidence = full.dspark_net.draft_chain(  # the same chain, with its confidences
        full.net.block_hidden(target.get_input_embeddings()(torch.tensor([40] + [127] * 3)), torch.arange(9, 13),
                              full._context), 40, 4)
    assert full.net.draft_to_target[rows].tolist() == chain.tolist()
    running = confidence.sigmoid().cumprod(0)
    assert (running < 1).all() and len(set(running.tolist())) == 4
    for threshold in (*running.tolist(), 1.0):
        scheduled = flashmm.drafters.load(FIXTURES / "dspark", confidence_threshold=threshold)
        tokens = scheduled.propose(begun(scheduled, target, prompt, 40), 8, None, None).tokens[0, 1:]
        assert tokens.tolist() == chain[: int((running >= threshold).sum())].tolist()
    with pytest.raises(ValueError, match="confidence_threshold must be in"):
        flashmm.drafters.load(FIXTURES / "dspark", confidence_threshold=0.0)


@pytest.mark.parametrize("folder, options", [("dspark", {}), ("dspark", {"confidence_threshold": 0.3}),
                                             ("dspark_gated", {}), ("dspark_rnn", {"max_draft_tokens": 2})])
def test_wrap_folder_decodes_exactly(target, folder, options):
    drafter = flashmm.drafters.load(FIXTURES / folder, **options)
    assert isinstance(drafter, DSpark)
    for seed in (0, 1):
        prompt = torch.randint(3, 120, (1, 10), generator=torch.Generator().manual_seed(seed))
        sm = flashmm.wrap(target, drafter)
        assert torch.equal(sm.generate(prompt, max_new_tokens=20, do_sample=False),
                           target.generate(prompt, max_new_tokens=20, do_sample=False))
        assert sm.last_stats.drafted_tokens > 0
    batch = torch.randint(3, 120, (2, 8), generator=torch.Generator().manual_seed(2))
    sm = flashmm.wrap(target, FIXTURES / folder)
    assert torch.equal(sm.generate(batch, max_new_tokens=10, do_sample=False),
                       target.generate(batch, max_new_tokens=10, do_sample=False))


@pytest.mark.parametrize("overrides, drafter_side, target_side", [
    (dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
     "hidden size of its features: drafter 64", "target 32"),
    (dict(num_hidden_layers=4, vocab_size=256), "vocabulary (its Markov head's rows): drafter 128", "target 256"),
    (dict(num_hidden_layers=3), "feature layers (each below the target's layer count): drafter [1, 2, 3]",
     "target 3 layers"),
])
def test_mismatched_target_is_refused(overrides, drafter_side, target_side):
    folder = FIXTURES / "dspark"
    with pytest.raises(ValueError) as err:
        flashmm.wrap(tiny_lm("llama", **overrides), folder)
    message = str(err.value)
    assert str(folder) in message and drafter_side in message and target_side in message, message


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match=r"max_draft_tokens must be 1 \.\. 3"):
        flashmm.drafters.load(FIXTURES / "dspark_rnn", max_draft_tokens=4)
    (tmp_path / "config.json").write_text('{"speculators_model_type": "dspark", "transformer_layer_config": {}}')
    with pytest.raises(DrafterFileError, match="a speculators dspark config needs"):
        flashmm.drafters.load(tmp_path)
    with pytest.raises(ValueError, match="is a trained drafter: give the folder"):
        flashmm.wrap(tiny_lm("llama"), "dspark")


SAMPLING = dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95)


def test_sampling_distribution():
    """Sampled with a random DSpark drafter (rnn Markov head) on an 8-token target: the first two tokens'
    histogram matches the exact joint (χ²); the lossy typical verifier fails the same test. Drafted tokens are
    argmaxes (q = None), so the verifier's residual rule keeps the target's distribution."""
    from stats_utils import chi_square_pvalue, two_token_histogram, two_token_joint

    vocab = 8
    target = tiny_lm("llama", seed=1, vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.15)
    torch.manual_seed(0)
    backbone = DFlashConfig(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            intermediate_size=64, feature_layers=(0, 1), draft_vocab_size=vocab, block_size=3,
                            mask_token_id=vocab - 1, rms_norm_eps=1e-6, rope_theta=10000.0)
    heads = DSparkConfig(vocab_size=vocab, markov_rank=4, markov_head_type="rnn", confidence=True,
                         confidence_with_markov=True, sample_from_anchor=True)
    net = DSparkNet(DFlashNet(backbone), heads)
    prompt = torch.tensor([[3, 5, 3, 5, 3]])
    joint = two_token_joint(target, prompt, SAMPLING)
    exact = flashmm.wrap(target, DSpark(net))
    assert chi_square_pvalue(two_token_histogram(exact, prompt, SAMPLING, 300, vocab), joint) > 1e-3
    exact.generate(prompt, max_new_tokens=30, generator=torch.Generator().manual_seed(0), **SAMPLING)
    assert exact.last_stats.accepted_tokens > 0  # drafts were accepted: the residual rule was exercised
    biased = flashmm.wrap(target, DSpark(net), verifier="typical_lossy", typical_epsilon=0.05, typical_delta=0.05)
    assert chi_square_pvalue(two_token_histogram(biased, prompt, SAMPLING, 300, vocab), joint) < 1e-3
