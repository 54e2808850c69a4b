"""flashmm export-drafter on a DFlash drafter: vLLM speculators' dflash layout, checked against the layout
speculators 0.9.0 itself wrote (tests/fixtures/speculators/dflash) and read back by flashmm's speculators
reader into a drafter whose logits equal the original's and that decodes exactly."""
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import flashmm
from flashmm.drafters import load
from flashmm.drafters.dflash import DFlash
from flashmm.drafters.nets.dflash_net import DFlashNet
from flashmm.serve.cli import main
from flashmm.train.dflash import new_net, save_dflash

from text_models import VOCAB, prompt, tiny_lm

FIXTURE = Path(__file__).parent / "fixtures" / "speculators" / "dflash"
LAYERS = 4
TARGET_INFO = {"name": "tiny-llama", "vocab_size": VOCAB, "num_hidden_layers": LAYERS,
               "architectures": ["LlamaForCausalLM"]}


@pytest.fixture(scope="module")
def target():
    return tiny_lm("llama", seed=0, num_hidden_layers=LAYERS)


def saved_dflash(folder: Path, target, draft_vocab, num_layers: int = 1, feature_layers=(3, 1, 2)) -> Path:
    """An untrained DFlash for ``target`` saved in flashmm's layout (its layers scaled up so that the
    drafts depend on them, not only on the LM head)."""
    torch.manual_seed(3)
    net = new_net(target, feature_layers, block_size=4, mask_token_id=VOCAB - 1, draft_vocab=draft_vocab,
                  num_layers=num_layers)
    with torch.no_grad():
        for layer in net.layers:
            layer.o_proj.weight.mul_(4.0)
            layer.down_proj.weight.mul_(4.0)
    return save_dflash(folder, net, {"method": "dflash", "target": TARGET_INFO})


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    """(flashmm folder, exported folder) for a drafter with a shuffled 100-token draft vocabulary."""
    root = tmp_path_factory.mktemp("dflash_export")
    vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:100]
    folder = saved_dflash(root / "dflash", target, vocab)
    assert main(["export-drafter", str(folder), "--format", "speculators", "--out", str(root / "out")]) == 0
    return folder, root / "out"


def target_logits(drafter: DFlash, target, features: torch.Tensor, block: torch.Tensor, root: int) -> torch.Tensor:
    """The drafter's block logits [block_size, V] over the target's vocabulary (-inf outside its draft
    vocabulary): the context is ``features`` [root, F] at positions 0 .. root-1."""
    net = drafter.net
    with torch.no_grad():
        context = net.context(features, torch.arange(root))
        positions = torch.arange(root, root + block.numel())
        logits = net.block_logits(target.get_input_embeddings()(block), positions, context)
    full = torch.full((block.numel(), VOCAB), float("-inf"))
    full[:, net.draft_to_target] = logits
    return full


def key_tree(value):
    """A JSON value's structure: its keys, recursively (lists by their first element)."""
    if isinstance(value, dict):
        return {k: key_tree(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [key_tree(value[0])]
    return None


def test_exported_drafter_gives_the_original_logits(target, exported):
    folder, out = exported
    original, published = load(folder), load(out)
    assert isinstance(published, DFlash)
    assert published.net.config.feature_layers == (3, 1, 2)
    assert not torch.equal(published.net.draft_to_target, original.net.draft_to_target)  # rows were reordered
    ids = prompt(24, seed=4)
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i][0] for i in (3, 1, 2)], dim=-1)
    for root in (5, 17):
        block = torch.full((4,), VOCAB - 1)
        block[0] = ids[0, root]
        expected = target_logits(original, target, features[:root], block, root)
        torch.testing.assert_close(target_logits(published, target, features[:root], block, root), expected,
                                   atol=1e-5, rtol=1e-5)


def test_config_has_the_keys_speculators_writes(exported):
    _, out = exported
    config = json.loads((out / "config.json").read_text())
    reference = json.loads((FIXTURE / "config.json").read_text())
    ours, theirs = key_tree(config), key_tree(reference)
    # auto_map names the copy of speculators' config source speculators writes beside its weights;
    # "flashmm" records where the export came from (vLLM keeps unknown keys as attributes)
    assert "exported_from" in ours.pop("flashmm") and theirs.pop("auto_map") == {"": None}
    assert ours == theirs
    assert config["aux_hidden_state_layer_ids"] == [3, 1, 2]  # HF output_hidden_states indices, as speculators'
    assert (config["block_size"], config["mask_token_id"], config["draft_vocab_size"]) == (4, VOCAB - 1, 100)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"] == {"architectures": ["LlamaForCausalLM"],
                                                        "name_or_path": "tiny-llama"}
    layer = config["transformer_layer_config"]
    assert (layer["vocab_size"], layer["num_hidden_layers"], layer["hidden_size"]) == (VOCAB, 1, 64)
    assert config["sliding_window_non_causal"] is True  # vLLM: bidirectional block (export_dflash.py)


def test_weights_have_speculators_names_and_maps(exported):
    folder, out = exported
    state, reference = load_file(out / "model.safetensors"), load_file(FIXTURE / "model.safetensors")
    assert sorted(state) == sorted(reference)
    assert {k: v.dtype for k, v in state.items()} == {k: v.dtype for k, v in reference.items()}
    vocab = load(folder).net.draft_to_target
    targets = torch.arange(100) + state["d2t"]
    assert torch.equal(targets, vocab.sort().values) and torch.equal(torch.nonzero(state["t2d"]).flatten(), targets)
    assert state["t2d"].shape == (VOCAB,)


def test_more_layers_and_the_whole_vocabulary(target, tmp_path):
    """Two layers' names equal the fixture's one layer's modulo the index; a whole-vocabulary drafter is written
    without d2t / t2d (as speculators writes it; vLLM then has no map to load) and still drafts as before."""
    folder = saved_dflash(tmp_path / "dflash", target, None, num_layers=2)
    from flashmm.drafters.export import export_drafter

    out = export_drafter(folder, "speculators", tmp_path / "out")
    names = set(load_file(out / "model.safetensors"))
    reference = set(load_file(FIXTURE / "model.safetensors")) - {"d2t", "t2d"}
    assert {re.sub(r"^layers\.\d+\.", "layers.N.", k) for k in names} == \
        {re.sub(r"^layers\.\d+\.", "layers.N.", k) for k in reference}
    assert {k for k in names if k.startswith("layers.1.")} and "d2t" not in names
    ids = prompt(12, seed=2)
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i][0] for i in (3, 1, 2)], dim=-1)[:9]
    block = torch.tensor([int(ids[0, 9]), VOCAB - 1, VOCAB - 1, VOCAB - 1])
    torch.testing.assert_close(target_logits(load(out), target, features, block, 9),
                               target_logits(load(folder), target, features, block, 9), atol=1e-5, rtol=1e-5)


def test_round_trip_of_speculators_names():
    """state_to_speculators undoes state_from_speculators on the checkpoint speculators wrote."""
    reference = load_file(FIXTURE / "model.safetensors")
    ours = DFlashNet.state_from_speculators(reference)
    assert DFlashNet.state_to_speculators(ours).keys() == reference.keys() - {"d2t", "t2d"}


def test_exported_drafter_decodes_exactly(target, exported):
    _, out = exported
    ids = prompt(10, seed=5)
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    sm = flashmm.wrap(target, str(out))
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False), expected)
    assert sm.last_stats.verify_steps > 0


def test_refusals(target, tmp_path):
    # the last layer's output: HF normalizes hidden_states[n], vLLM captures it before the final norm
    last = saved_dflash(tmp_path / "last", target, None, feature_layers=(1, LAYERS))
    assert main(["export-drafter", str(last), "--format", "speculators", "--out", str(tmp_path / "x")]) == 2
    ok = saved_dflash(tmp_path / "ok", target, None)
    assert main(["export-drafter", str(ok), "--format", "sglang", "--out", str(tmp_path / "y")]) == 2
    info = json.loads((ok / "drafter.json").read_text())
    (ok / "drafter.json").write_text(json.dumps({**info, "target": "tiny-llama"}))
    with pytest.raises(ValueError, match="vocab_size"):
        from flashmm.drafters.export_dflash import export_dflash

        export_dflash(ok, tmp_path / "z")


def test_target_folder_names_the_verifier(target, exported, tmp_path):
    """--target (a Hugging Face folder) supplies what drafter.json may not record: the verifier's path and
    architectures, its context length and token ids."""
    folder, _ = exported
    target.save_pretrained(tmp_path / "target")
    out = tmp_path / "out"
    assert main(["export-drafter", str(folder), "--format", "speculators", "--target", str(tmp_path / "target"),
                 "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {"architectures": ["LlamaForCausalLM"],
                                                        "name_or_path": str(tmp_path / "target")}
    layer = config["transformer_layer_config"]
    assert (layer["max_position_embeddings"], layer["bos_token_id"], layer["eos_token_id"]) == (512, 1, 2)
