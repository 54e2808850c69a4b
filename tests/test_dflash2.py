"""DFlash-2: the convolved block drafter with its candidate selector against speculators' own DFlash2DraftModel,
and exact decoding with it.

tests/fixtures/speculators/dflash2 holds a tiny random DFlash-2 checkpoint saved by speculators 0.9.0 (its
convolutions and selector moved off their initialisation, which is DFlash's layer and a selector too weak to
change a token) and what its training forward computed (tools/fixtures/speculators_fixtures.py): the anchors
it picked, every block position's unary logits, and the selector's inputs (previous tokens, candidates) and
scores. flashmm's network must give the same numbers; its drafting must follow the selector (which changes the
unary argmax at most of the fixture's positions); greedy decoding equals the target's generate (one row, a
ragged batch of two), a sampled run has the target's distribution (χ², the lossy typical verifier failing),
and what does not fit is refused naming the values or the file.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import flashmm
from flashmm.drafters import DFlash2, DrafterFileError, load
from flashmm.drafters.base import SequenceStart
from flashmm.drafters.nets.dflash2_net import CandidateSelector, DFlash2Net
from flashmm.drafters.nets.dflash_net import DFlashConfig, DFlashNet, anchored_hidden
from stats_utils import chi_square_pvalue, two_token_histogram, two_token_joint
from text_models import tiny_lm

FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
DFLASH2 = FIXTURES / "dflash2"


@pytest.fixture(scope="module")
def target():
    return LlamaForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference():
    return load_file(str(DFLASH2 / "reference_logits.safetensors"))


def test_training_forward_equals_speculators(target, reference):
    """The fixture's anchored blocks in one masked forward: every position's unary logits (the target's LM
    head on the convolved layers' output) and the selector's scores of the recorded candidates equal
    speculators'; the recorded previous tokens are the block's tokens shifted by one, the anchor first."""
    drafter = load(DFLASH2)
    assert isinstance(drafter, DFlash2) and drafter.max_draft_tokens == 3
    net, selector = drafter.dflash2_net.backbone, drafter.dflash2_net.candidate_selector
    ids, anchors = reference["input_ids"][0], reference["anchor_positions"][0]
    with torch.no_grad():
        hidden = anchored_hidden(net, target.get_input_embeddings(), reference["hidden_states"][0], ids, anchors,
                                 reference["position_ids"][0]).flatten(0, 1)                  # [A * size, d]
        unary = target.get_output_embeddings()(hidden)
        scores = selector.scores(unary, hidden, reference["predecessor_ids"][0], reference["candidate_ids"][0])
    torch.testing.assert_close(unary, reference["logits"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(scores, reference["candidate_logits"][0], atol=1e-5, rtol=0)
    size = net.config.block_size
    block = ids[(anchors[:, None] + torch.arange(size)).clamp(max=ids.shape[0] - 1)]             # [A, size]
    previous = torch.cat([block[:, :1], block[:, :-1]], dim=1)
    assert torch.equal(reference["predecessor_ids"][0].view(-1, size)[:, 1:], previous[:, 1:])
    assert torch.equal(reference["predecessor_ids"][0].view(-1, size)[:, 0], block[:, 0])
    # the selector matters here: its best candidate is not the unary top-1 at most positions
    assert int((scores.argmax(-1) != 0).sum()) > scores.shape[0] // 2


def test_drafts_what_the_selector_picks(target):
    """A step's draft is the block's chain read position by position: the best-scoring of the unary top-k given
    the token drafted before (the root first), which here differs from the unary argmax chain."""
    drafter = load(DFLASH2)
    sm = flashmm.wrap(target, drafter)
    differs = False
    for seed in range(4):
        prompt = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            hidden = target(prompt, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in drafter.feature_layers], -1)[0]
        drafter.begin(SequenceStart(input_ids=prompt, hidden_states=features[None]))
        root = 77
        draft = drafter.propose(torch.cat([prompt, torch.tensor([[root]])], dim=1), 8, None, None)
        net, selector = drafter.dflash2_net.backbone, drafter.dflash2_net.candidate_selector
        with torch.no_grad():
            context = net.context(features, torch.arange(9))
            block = torch.tensor([root, *[net.config.mask_token_id] * 3])
            states = net.block_hidden(sm.target.input_embeddings()(block), torch.arange(9, 13), context)[1:]
            unary = target.get_output_embeddings()(states)
            chain, previous = [], root
            for k in range(3):
                candidates = unary[k].topk(selector.top_k).indices
                scores = selector.scores(unary[k: k + 1], states[k: k + 1], torch.tensor([previous]), candidates[None])
                previous = int(candidates[scores[0].argmax()])
                chain.append(previous)
        assert draft.tokens[0].tolist() == [root, *chain]
        differs |= chain != unary.argmax(-1).tolist()
    assert differs


def test_loads_by_folder_and_decodes_exactly(target):
    prompt = torch.randint(3, 120, (1, 10), generator=torch.Generator().manual_seed(0))
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    sm = flashmm.wrap(target, str(DFLASH2))
    assert isinstance(sm.drafter, DFlash2)
    assert torch.equal(sm.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=[]), expected)
    assert sm.last_stats.drafted_tokens > 0
    ids = torch.cat([prompt[:, :8], torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt[:, 3:8].flip(1)], 1)])
    mask = (torch.arange(8) >= torch.tensor([[0], [3]])).long()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
    sm = flashmm.wrap(target, load(DFLASH2, max_draft_tokens=2))
    out = sm.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert torch.equal(out, expected)


SAMPLING = dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95)


def test_sampling_distribution():
    """Sampled with a random DFlash-2 drafter (convolutions and selector off their identity / weak
    initialisation) on an 8-token target: the first two tokens' histogram matches the exact joint (χ²); the
    lossy typical verifier fails the same test. Drafts are deterministic (q = None), so the verifier's
    residual rule keeps the target's distribution."""
    vocab = 8
    target = tiny_lm("llama", seed=1, vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.15)
    torch.manual_seed(0)
    config = DFlashConfig(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          intermediate_size=64, feature_layers=(1, 2), draft_vocab_size=vocab, block_size=3,
                          mask_token_id=vocab - 1, rms_norm_eps=1e-6, rope_theta=10000.0, conv_kernel_size=2,
                          conv_group_size=16)
    net = DFlash2Net(DFlashNet(config), CandidateSelector(vocab, 64, rank=4, top_k=3))
    with torch.no_grad():
        for name, parameter in net.named_parameters():
            parameter.copy_(torch.randn_like(parameter) * (1.0 if "codebook" in name or "base_kernel" in name else 0.1))
    prompt = torch.tensor([[3, 5, 3, 5, 3]])
    joint = two_token_joint(target, prompt, SAMPLING)
    exact = flashmm.wrap(target, DFlash2(net))
    assert chi_square_pvalue(two_token_histogram(exact, prompt, SAMPLING, 300, vocab), joint) > 1e-3
    biased = flashmm.wrap(target, DFlash2(net), verifier="typical_lossy", typical_epsilon=0.05, typical_delta=0.05)
    assert chi_square_pvalue(two_token_histogram(biased, prompt, SAMPLING, 300, vocab), joint) < 1e-3


@pytest.mark.parametrize("overrides, words", [
    (dict(vocab_size=256), "vocabulary: drafter 128, target 256"),
    (dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=4),
     "reads 192 feature values (3 layers); the target's hidden size is 32"),
])
def test_mismatched_target_is_refused(overrides, words):
    other = tiny_lm("llama", **overrides)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        flashmm.wrap(other, str(DFLASH2)).generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)


def edited_copy(tmp_path, **changes) -> Path:
    """A copy of the fixture folder with config.json's top-level ``changes`` (None: the key removed)."""
    folder = tmp_path / "dflash2"
    shutil.copytree(DFLASH2, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes, words", [
    (dict(conv_kernel_size=None), "needs 'conv_kernel_size'"),
    (dict(conv_group_size=24), "group_size dividing the hidden size 64"),
    (dict(selector_top_k=500), "selector_top_k must be 1 .. the vocabulary"),
    (dict(sample_from_anchor=True), "sample_from_anchor True"),
    (dict(selector_rank=4), "model.safetensors"),
])
def test_malformed_or_unsupported_configs_are_refused_naming_the_file(tmp_path, changes, words):
    folder = edited_copy(tmp_path, **changes)
    with pytest.raises(DrafterFileError, match=words) as err:
        load(folder)
    assert str(folder) in str(err.value)
    if words != "model.safetensors":
        assert str(folder / "config.json") in str(err.value)


def test_options_are_checked():
    with pytest.raises(ValueError, match="max_draft_tokens must be 1 .. 3"):
        load(DFLASH2, max_draft_tokens=4)
    with pytest.raises(TypeError, match="unknown option"):
        load(DFLASH2, tree=True)
