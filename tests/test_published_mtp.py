"""speculators' ``mtp`` folders (flashmm.drafters.speculators_mtp) against speculators itself.

tests/fixtures/speculators/mtp holds a tiny random MTP checkpoint saved by speculators 0.9.0 (one Qwen3 layer,
its norms perturbed from ones) and the logits of every step of its teacher-forced training forward over
recorded tokens x_0 .. x_12 and target states (tools/fixtures/speculators_fixtures.py): step s at anchor i
reads x_{i+s+1} and predicts x_{i+s+2}. The drafter's chain at root R = i + 1, fed the recorded tokens as its
drafts, must give those logits at every step; then greedy decoding of the fixture's target equals its own
generate (one row, a ragged batch of two), sampled output has the target's distribution (χ², the lossy
typical verifier failing the same test), and what does not fit is refused naming the values or the file.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import flashmm
from flashmm.drafters import DrafterFileError, SpeculatorsMTP, load
from flashmm.drafters.base import SequenceStart, StepResult
from flashmm.drafters.published import UnsupportedDrafterFormat
from flashmm.targets import CausalLMTarget
from stats_utils import chi_square_pvalue, two_token_histogram, two_token_joint
from text_models import tiny_lm

FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
MTP = FIXTURES / "mtp"


@pytest.fixture(scope="module")
def target():
    return LlamaForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference():
    return load_file(str(MTP / "reference_logits.safetensors"))


def bound(target) -> SpeculatorsMTP:
    drafter = load(MTP)
    drafter.bind(CausalLMTarget(target))
    return drafter


def test_every_step_equals_speculators_at_every_root(target, reference):
    """A new sequence at each root R, and one sequence walked over roots 1, 2, 4, 5, 8, 9 whose argmax drafts
    (not the recorded tokens) are computed first at each root, so the next chain must drop the units that
    read them from each step's cache: every step's logits at anchor R-1 equal speculators'."""
    ids, hidden, want = reference["input_ids"], reference["hidden_states"], reference["logits"]
    steps, anchors = want.shape[:2]
    assert (steps, anchors) == (3, 9)
    drafter = bound(target)
    assert isinstance(drafter, SpeculatorsMTP) and drafter.max_draft_tokens == 3  # its speculative_tokens
    worst = 0.0
    for root in range(1, anchors + 1):
        drafter.begin(SequenceStart(input_ids=ids[:, :root], hidden_states=hidden[:, :root]))
        _, logits = drafter.chain(ids[:, :root + 1], steps, continuation=ids[0, root + 1:])
        worst = max(worst, float((logits - want[:, root - 1]).abs().max()))
    drafter.begin(SequenceStart(input_ids=ids[:, :1], hidden_states=hidden[:, :1]))
    seen = 1
    for root in (1, 2, 4, 5, 8, 9):
        if root > seen:
            drafter.observe(StepResult(committed=ids[:, :root + 1], accepted_len=root - seen - 1,
                                       path=torch.arange(root - seen)[None], hidden_states=hidden[:, seen:root]))
            seen = root
        drafted, logits = drafter.chain(ids[:, :root + 1], steps)
        assert logits.argmax(-1).tolist() == drafted.tolist()
        assert not torch.equal(drafted, ids[0, root + 1: root + 1 + steps])  # the caches saw other tokens
        worst = max(worst, float((logits[0] - want[0, root - 1]).abs().max()))
        _, logits = drafter.chain(ids[:, :root + 1], steps, continuation=ids[0, root + 1:])
        worst = max(worst, float((logits - want[:, root - 1]).abs().max()))
    assert worst < 1e-5, worst


def test_loads_by_folder_and_decodes_exactly(target):
    prompt = torch.randint(3, 120, (1, 10), generator=torch.Generator().manual_seed(0))
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    sm = flashmm.wrap(target, str(MTP))
    assert isinstance(sm.drafter, SpeculatorsMTP)
    assert torch.equal(sm.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=[]), expected)
    assert sm.last_stats.drafted_tokens > 0
    # a left-padded batch of two, each row drafted by its own fork
    ids = torch.cat([prompt[:, :8], torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt[:, 3:8].flip(1)], 1)])
    mask = (torch.arange(8) >= torch.tensor([[0], [3]])).long()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
    sm = flashmm.wrap(target, load(MTP, max_draft_tokens=2))
    out = sm.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert torch.equal(out, expected)


SAMPLING = dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95)


def test_sampling_distribution(tmp_path):
    """Sampled on an 8-token target with the fixture's layer (its vocabulary set to 8: the layer has no
    vocabulary-sized weights, embedding and head being the target's): the first two tokens' histogram matches
    the exact joint (χ²); the lossy typical verifier fails the same test."""
    vocab = 8
    folder = edited_copy(tmp_path, layer_vocab_size=vocab)
    target = tiny_lm("llama", seed=1, vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.15)
    prompt = torch.tensor([[3, 5, 3, 5, 3]])
    joint = two_token_joint(target, prompt, SAMPLING)
    exact = flashmm.wrap(target, load(folder, max_draft_tokens=2))
    assert chi_square_pvalue(two_token_histogram(exact, prompt, SAMPLING, 300, vocab), joint) > 1e-3
    biased = flashmm.wrap(target, load(folder, max_draft_tokens=2), verifier="typical_lossy", typical_epsilon=0.05,
                          typical_delta=0.05)
    assert chi_square_pvalue(two_token_histogram(biased, prompt, SAMPLING, 300, vocab), joint) < 1e-3


@pytest.mark.parametrize("overrides, drafter_side, target_side", [
    (dict(vocab_size=256), "vocabulary: drafter 128", "target 256"),
    (dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1), "hidden size: drafter 64", "target 32"),
])
def test_mismatched_target_is_refused(overrides, drafter_side, target_side):
    other = tiny_lm("llama", **overrides)
    with pytest.raises(ValueError) as err:
        flashmm.wrap(other, str(MTP)).generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    message = str(err.value)
    assert str(MTP) in message and drafter_side in message and target_side in message


ABSENT = object()


def edited_copy(tmp_path, **changes) -> Path:
    """A copy of the fixture folder with config.json's ``changes`` (``layer_X``: transformer_layer_config's X;
    ABSENT: the key removed)."""
    folder = tmp_path / "mtp"
    shutil.copytree(MTP, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        section = config["transformer_layer_config"] if key.startswith("layer_") else config
        key = key[len("layer_"):] if key.startswith("layer_") else key
        if value is ABSENT:
            del section[key]
        else:
            section[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes, words", [
    (dict(transformer_layer_config=ABSENT), "has no 'transformer_layer_config' object"),
    (dict(layer_hidden_size=ABSENT), r"transformer_layer_config needs \['hidden_size'\]"),
    (dict(layer_num_attention_heads="two"), "transformer_layer_config: .*num_attention_heads"),
    (dict(layer_intermediate_size=-1), "transformer_layer_config: "),
])
def test_malformed_config_is_refused_naming_config_json(tmp_path, changes, words):
    config = edited_copy(tmp_path, **changes) / "config.json"
    with pytest.raises(DrafterFileError, match=words) as err:
        load(config.parent)
    assert str(config) in str(err.value)


@pytest.mark.parametrize("changes, words", [
    (dict(layer_model_type="qwen3_next"), "model_type is 'qwen3_next'"),
    (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers is 2"),
    (dict(draft_vocab_size=96), "draft_vocab_size is 96"),
    (dict(layer_use_sliding_window=True, layer_sliding_window=4), "sliding window"),
])
def test_variants_flashmm_does_not_run_are_refused(tmp_path, changes, words):
    folder = edited_copy(tmp_path, **changes)
    with pytest.raises(UnsupportedDrafterFormat, match=words) as err:
        load(folder)
    assert str(folder / "config.json") in str(err.value)


def test_weights_that_do_not_match_name_the_file(tmp_path):
    from safetensors.torch import save_file

    folder = edited_copy(tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    del state["mtp_layers.0.self_attn.q_norm.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(DrafterFileError, match="q_norm") as err:
        load(folder)
    assert str(folder / "model.safetensors") in str(err.value)
    state["mtp_layers.1.input_proj.weight"] = state["mtp_layers.0.input_proj.weight"].clone()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(DrafterFileError, match=r"mtp_layers\.1\.input_proj"):
        load(folder)


def test_options_are_checked():
    with pytest.raises(DrafterFileError, match="max_draft_tokens must be >= 1"):
        load(MTP, max_draft_tokens=0)
    assert load(MTP, max_draft_tokens=5).max_draft_tokens == 5
