"""Drafters in vLLM speculators' layout (flashmm.drafters.published), checked against speculators itself:
the fixtures under tests/fixtures/speculators/ were written by speculators 0.9.0's own classes, with each
drafter's logits on recorded inputs (tools/fixtures/speculators_fixtures.py; speculators is not needed here)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import flashmm
from flashmm.drafters import load
from flashmm.drafters.base import SequenceStart
from flashmm.drafters.eagle3 import save_head
from flashmm.drafters.export import export_drafter
from flashmm.drafters.files import DrafterFileError
from flashmm.drafters.nets.eagle3_net import Eagle3Config, Eagle3Net
from flashmm.drafters.published import SpeculatorsEagle3Drafter, UnsupportedDrafterFormat
from flashmm.targets import CausalLMTarget

from text_models import tiny_lm

FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
EAGLE3 = FIXTURES / "eagle3"


@pytest.fixture(scope="module")
def target():
    return LlamaForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference():
    return load_file(str(EAGLE3 / "reference_logits.safetensors"))


def test_eagle3_logits_equal_speculators(reference):
    """Each train-time-test step of speculators' Eagle3DraftModel.forward, rebuilt from flashmm's head:
    step 0 over the target's features (causal), step k over step k-1's outputs, attending to step 0's
    units j <= i and to its own earlier-step units at i (speculators' diagonal draft mask)."""
    drafter = load(EAGLE3)
    assert isinstance(drafter, SpeculatorsEagle3Drafter) and drafter.feature_layers == (1, 2, 3)
    net, embed = drafter.net, drafter.embedding
    ids, positions, want = reference["input_ids"], reference["position_ids"], reference["logits"]
    t = ids.shape[1]
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    with torch.no_grad():
        out, past = net(embed(ids), reference["hidden_states"], positions, causal[None])
        torch.testing.assert_close(net.logits(out), want[0][None], atol=1e-5, rtol=0)
        for step in range(1, want.shape[0]):
            forced = torch.cat([ids[:, step:], ids.new_zeros(1, step)], dim=1)   # x_{i+1+step}, zero-padded
            mask = torch.cat([causal] + [torch.eye(t, dtype=torch.bool)] * step, dim=1)[None]
            out, past = net(embed(forced), out, positions + step, mask, past)
            torch.testing.assert_close(net.logits(out), want[step][None], atol=1e-5, rtol=0)


def test_eagle3_drafter_after_bind_matches_speculators(target, reference):
    """Through the drafter protocol after bind (flashmm's positions from 0, the embedding bind chose, its
    vocabulary maps): the head's output at the last recorded unit gives speculators' step-0 logits there, and
    the first drafted token is the target id of their argmax. The fixture's embed_tokens is not the target's
    (trained with embed_requires_grad), so embedding with the target's table would fail this."""
    assert not torch.equal(load(EAGLE3).embedding.weight, target.get_input_embeddings().weight)
    drafter = load(EAGLE3, tree="chain", depth=1, adaptive=False)
    drafter.bind(CausalLMTarget(target))
    tokens, features = reference["target_token_ids"], reference["hidden_states"]
    n = features.shape[1]
    drafter.begin(SequenceStart(input_ids=tokens[:, :n], hidden_states=features))
    draft = drafter.propose(tokens[:, : n + 1], 4, None, None)
    want = reference["logits"][0, -1]
    torch.testing.assert_close(drafter.net.logits(drafter._root_out), want, atol=1e-5, rtol=0)
    row = int(want.argmax())
    assert int(draft.tokens[0, 1]) == row + int(drafter.net.d2t[row])


def test_wrap_folder_generates_exactly(target, reference):
    prompt = reference["target_token_ids"][:, :8]
    want = target.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None)
    sm = flashmm.wrap(target, str(EAGLE3))
    assert torch.equal(sm.generate(prompt, max_new_tokens=16, eos_token_id=[]), want)
    # drafting every step (no adaptive pause), so every step verifies the head's chain; a left-padded
    # batch of two rows, each drafted by its own fork of the drafter
    ids = torch.cat([prompt, torch.cat([torch.zeros(1, 2, dtype=torch.long), prompt[:, 2:].flip(1)], dim=1)])
    mask = (torch.arange(8) >= torch.tensor([[0], [2]])).long()
    want = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    sm = flashmm.wrap(target, load(EAGLE3, tree="chain", depth=3, adaptive=False))
    assert torch.equal(sm.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0), want)
    assert sm.last_stats.drafted_tokens >= 3 * 2 * 8


@pytest.mark.parametrize("overrides, drafter_side, target_side", [
    (dict(num_hidden_layers=2), "[1, 2, 3]", "2 layers"),
    (dict(num_hidden_layers=4, vocab_size=256), "vocabulary: drafter 128", "target 256"),
    (dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
     "hidden size of its features: drafter 64", "target 32"),
])
def test_mismatched_target_is_refused(overrides, drafter_side, target_side):
    other = tiny_lm("llama", **overrides)
    with pytest.raises(ValueError) as err:
        flashmm.wrap(other, str(EAGLE3)).generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    message = str(err.value)
    assert str(EAGLE3) in message and drafter_side in message and target_side in message


@pytest.mark.parametrize("algorithm", ["xpress", "medusa9"])
def test_algorithms_flashmm_has_no_method_for_are_refused(tmp_path, algorithm):
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": algorithm}))
    with pytest.raises(UnsupportedDrafterFormat, match=f"flashmm has no {algorithm} method yet") as err:
        load(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and repr(algorithm) in message
    assert "'eagle3', 'dflash', 'dflash2', 'dspark', 'peagle', 'mtp'" in message  # what it does read


@pytest.mark.parametrize("algorithm, cls", [("dflash", "DFlash"), ("dflash2", "DFlash2"), ("dspark", "DSpark"),
                                            ("peagle", "PEagle"), ("mtp", "SpeculatorsMTP")])
def test_block_and_parallel_drafters_load_by_folder(algorithm, cls):
    """Each speculators algorithm with a drafter loads by its folder (their own tests: test_dflash,
    test_dflash2, test_dspark, test_peagle, test_published_mtp)."""
    assert type(load(FIXTURES / algorithm)).__name__ == cls


def edited_copy(tmp_path, **changes) -> Path:
    folder = tmp_path / "eagle3"
    shutil.copytree(EAGLE3, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("layer_"):
            config["transformer_layer_config"][key[len("layer_"):]] = value
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes, words", [
    (dict(norm_output=True), "norm_output"),
    (dict(fc_norm=True), "fc_norm"),
    (dict(layer_model_type="qwen3"), "model_type is 'qwen3'"),
    (dict(layer_num_hidden_layers=2), "num_hidden_layers is 2"),
])
def test_variants_flashmm_cannot_run_are_refused(tmp_path, changes, words):
    folder = edited_copy(tmp_path, **changes)
    with pytest.raises(UnsupportedDrafterFormat, match=words) as err:
        load(folder)
    assert str(folder / "config.json") in str(err.value)


def test_broken_folders_name_the_file(tmp_path):
    folder = edited_copy(tmp_path, eagle_aux_hidden_state_layer_ids=None)
    with pytest.raises(DrafterFileError, match="eagle_aux_hidden_state_layer_ids"):
        load(folder)
    folder = edited_copy(tmp_path / "b", draft_vocab_size=95)
    with pytest.raises(DrafterFileError, match="model.safetensors"):
        load(folder)


class NotATensor:
    """A class a pickle would have to import and build: weights_only loading refuses it."""


def test_pickled_weights_load_only_as_plain_tensors(tmp_path, reference):
    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(EAGLE3 / "config.json", folder / "config.json")
    torch.save(load_file(str(EAGLE3 / "model.safetensors")), folder / "pytorch_model.bin")
    assert torch.equal(load(folder).net.lm_head.weight, load(EAGLE3).net.lm_head.weight)
    torch.save({"fc.weight": NotATensor()}, folder / "pytorch_model.bin")
    with pytest.raises(DrafterFileError, match="weights_only"):
        load(folder)


def test_flashmm_export_reads_back_through_the_same_loader(tmp_path):
    """flashmm's own speculators export (flashmm export-drafter --format speculators) is read by this loader
    into a head with the same weights."""
    lm = tiny_lm("llama", seed=0)
    torch.manual_seed(2)
    net = Eagle3Net(Eagle3Config.for_target(lm.config, 100, (2, 1, 0)))
    net.set_vocab(torch.arange(28, 128))
    head = save_head(tmp_path / "head", net, {"method": "eagle3", "target": "tiny"}, dict(tree="chain"))
    out = export_drafter(head, "speculators", tmp_path / "exported")
    read = load(out)
    assert isinstance(read, SpeculatorsEagle3Drafter) and read.embedding is None
    mine = load(head).net.state_dict()
    assert all(torch.equal(read.net.state_dict()[k], v.float() if v.is_floating_point() else v)
               for k, v in mine.items())


def test_a_head_with_its_own_embeddings_is_not_saved_as_a_flashmm_folder(tmp_path):
    with pytest.raises(ValueError, match="embed_tokens"):
        load(EAGLE3).save(tmp_path / "saved", {"method": "eagle3", "target": "tiny"})
    assert not (tmp_path / "saved").exists()
