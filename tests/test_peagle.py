"""P-EAGLE: the parallel EAGLE-3 head against speculators' own PEagleDraftModel, and exact decoding with it.

tests/fixtures/speculators/peagle holds a tiny random P-EAGLE checkpoint saved by speculators 0.9.0, the
logits of its training forward and the (anchor, depth) of every unit COD sampling put in it
(tools/fixtures/speculators_fixtures.py). Rebuilding that forward (speculators' attention rule written out
here, independently of flashmm's drafting pass), flashmm's head must give the same logits; the single pass
flashmm drafts with must give each rollout's; greedy decoding equals the target's generate and sampling
keeps its distribution.
"""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import flashmm
from flashmm.drafters import DrafterFileError, PEagle
from flashmm.drafters.base import SequenceStart
from flashmm.drafters.nets.eagle3_net import Eagle3Config, Eagle3Net
from flashmm.drafters.nets.peagle_net import PEagleNet
from flashmm.drafters.published import UnsupportedDrafterFormat
from flashmm.targets import CausalLMTarget

from text_models import tiny_lm

FOLDER = Path(__file__).parent / "fixtures" / "speculators" / "peagle"


@pytest.fixture(scope="module")
def target():
    return LlamaForCausalLM.from_pretrained(FOLDER.parent / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference():
    return load_file(FOLDER / "reference_logits.safetensors")


def training_forward(net: PEagleNet, embed, ids, features, anchor, depth) -> torch.Tensor:
    """speculators' PEagleDraftModel forward over units (anchor [U], depth [U]) of one sequence (ids [T],
    features [T, F]): unit i at position anchor + depth; depth 0: the token and features there, else the mask
    token and mask_hidden; unit q sees unit k when k has depth 0 and an anchor at or before q's, or k is in
    q's rollout with a depth at or below q's. → logits [U, V']."""
    place = anchor + depth
    first = depth == 0
    tokens = torch.where(first, ids[place], torch.full_like(place, net.mask_token_id))
    fused = torch.where(first[:, None], features[place], net.mask_hidden.expand(len(place), -1))
    sees = (first[None] & (anchor[None] <= anchor[:, None])) | \
           ((anchor[None] == anchor[:, None]) & (depth[None] <= depth[:, None]))
    out, _ = net.head(embed(tokens)[None], fused[None], place[None], sees[None])
    return net.head.logits(out[0])


def test_logits_equal_speculators(reference):
    drafter = flashmm.drafters.load(FOLDER)
    assert isinstance(drafter, PEagle) and drafter.max_draft_tokens == 2 and drafter.feature_layers == (1, 2, 3)
    anchor, depth = reference["anchor_pos"][0], reference["depth"][0]
    assert (depth > 0).sum() == 3
    with torch.no_grad():
        logits = training_forward(drafter.net, drafter.embedding, reference["input_ids"][0],
                                  reference["hidden_states"][0], anchor, depth)
    torch.testing.assert_close(logits, reference["logits"][0], atol=1e-5, rtol=1e-5)


def test_the_drafting_pass_gives_each_rollouts_logits(reference):
    """flashmm's one pass (committed units 0 .. a, then the depth units of the rollout at a) gives the logits
    speculators computed for unit (a, 0) and (a, 1), for each anchor COD sampling gave a depth-1 unit."""
    drafter = flashmm.drafters.load(FOLDER)
    net, embed = drafter.net, drafter.embedding
    ids, features, want = reference["input_ids"][0], reference["hidden_states"][0], reference["logits"][0]
    anchor, depth = reference["anchor_pos"][0], reference["depth"][0]
    mask_embed = embed(torch.tensor([net.mask_token_id]))[0]
    for i in (depth == 1).nonzero().flatten().tolist():
        a = int(anchor[i])
        with torch.no_grad():
            out, (keys, _) = net.parallel(embed(ids[: a + 1]), features[: a + 1], 0, mask_embed, 1)
        assert keys.shape[2] == a + 1                       # the depth unit's keys stay out of the cache
        torch.testing.assert_close(net.head.logits(out[a:]), want[[a, i]], atol=1e-5, rtol=1e-5)


def test_drafts_each_depths_argmax(target):
    """A step's chain is the argmax of every unit of the root's rollout (the committed unit before the root,
    then the depth units), mapped through d2t; the rollout rebuilt with the training forward above."""
    drafter = flashmm.drafters.load(FOLDER, max_draft_tokens=3)
    drafter.bind(CausalLMTarget(target))
    prompt = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i] for i in drafter.feature_layers], -1)[0]
    drafter.begin(SequenceStart(input_ids=prompt, hidden_states=features[None]))
    committed = torch.cat([prompt, torch.tensor([[77]])], dim=1)
    draft = drafter.propose(committed, 8, None, None)
    anchor = torch.cat([torch.arange(9), torch.tensor([8, 8])])
    depth = torch.cat([torch.zeros(9, dtype=torch.long), torch.tensor([1, 2])])
    ids = torch.cat([committed[0, 1:], torch.zeros(2, dtype=torch.long)])     # unit t reads x_{t+1}
    with torch.no_grad():
        logits = training_forward(drafter.net, drafter.embedding, ids, torch.cat([features, features[:2]]), anchor,
                                  depth)
    rows = logits[[8, 9, 10]].argmax(-1)
    assert draft.tokens[0].tolist() == [77, *drafter.net.head.draft_to_target[rows].tolist()]


@pytest.mark.parametrize("options", [{}, {"max_draft_tokens": 4}])
def test_wrap_folder_decodes_exactly(target, options):
    drafter = flashmm.drafters.load(FOLDER, **options)
    for seed in (0, 1):
        prompt = torch.randint(3, 120, (1, 10), generator=torch.Generator().manual_seed(seed))
        sm = flashmm.wrap(target, drafter)
        assert torch.equal(sm.generate(prompt, max_new_tokens=20, do_sample=False),
                           target.generate(prompt, max_new_tokens=20, do_sample=False))
        assert sm.last_stats.drafted_tokens > sm.last_stats.verify_steps > 0
    batch = torch.randint(3, 120, (2, 8), generator=torch.Generator().manual_seed(2))
    sm = flashmm.wrap(target, FOLDER)
    assert torch.equal(sm.generate(batch, max_new_tokens=10, do_sample=False),
                       target.generate(batch, max_new_tokens=10, do_sample=False))


@pytest.mark.parametrize("overrides, drafter_side, target_side", [
    (dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
     "hidden size of its features: drafter 64", "target 32"),
    (dict(num_hidden_layers=4, vocab_size=256), "vocabulary: drafter 128", "target 256"),
    (dict(num_hidden_layers=2), "drafter [1, 2, 3]", "target 2 layers"),
])
def test_mismatched_target_is_refused(overrides, drafter_side, target_side):
    with pytest.raises(ValueError) as err:
        flashmm.wrap(tiny_lm("llama", **overrides), FOLDER)
    message = str(err.value)
    assert str(FOLDER) in message and drafter_side in message and target_side in message, message


def test_refusals(tmp_path):
    import json
    import shutil

    folder = tmp_path / "peagle"
    shutil.copytree(FOLDER, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "norm_output": True}))
    with pytest.raises(UnsupportedDrafterFormat, match="norm_output"):
        flashmm.drafters.load(folder)
    (folder / "config.json").write_text(json.dumps({**config, "mask_token_id": None}))
    with pytest.raises(DrafterFileError, match="mask_token_id"):
        flashmm.drafters.load(folder)
    with pytest.raises(DrafterFileError, match="max_draft_tokens must be"):
        flashmm.drafters.load(FOLDER, max_draft_tokens=0)


SAMPLING = dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95)


def test_sampling_distribution():
    """Sampled with a random P-EAGLE head on an 8-token target: the first two tokens' histogram matches the
    exact joint (χ²); the lossy typical verifier fails the same test. Drafted tokens are argmaxes (q = None)."""
    from stats_utils import chi_square_pvalue, two_token_histogram, two_token_joint

    vocab = 8
    target = tiny_lm("llama", seed=1, vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.15)
    torch.manual_seed(0)
    head = Eagle3Net(Eagle3Config.for_target(target.config, vocab, (0, 1)))
    head.set_vocab(torch.arange(vocab))
    net = PEagleNet(head, mask_token_id=vocab - 1)
    torch.nn.init.normal_(net.mask_hidden)
    prompt = torch.tensor([[3, 5, 3, 5, 3]])
    joint = two_token_joint(target, prompt, SAMPLING)
    exact = flashmm.wrap(target, PEagle(net, max_draft_tokens=3))
    assert chi_square_pvalue(two_token_histogram(exact, prompt, SAMPLING, 300, vocab), joint) > 1e-3
    exact.generate(prompt, max_new_tokens=30, generator=torch.Generator().manual_seed(0), **SAMPLING)
    assert exact.last_stats.accepted_tokens > 0  # drafts were accepted: the residual rule was exercised
    biased = flashmm.wrap(target, PEagle(net, max_draft_tokens=3), verifier="typical_lossy", typical_epsilon=0.05,
                          typical_delta=0.05)
    assert chi_square_pvalue(two_token_histogram(biased, prompt, SAMPLING, 300, vocab), joint) < 1e-3
