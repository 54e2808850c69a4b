"""flashmm export-drafter: EAGLE-3 heads in SGLang's and vLLM speculators' layouts, validated before
writing and read back by flashmm into a drafter that drafts exactly as the original."""
import json

import pytest
import torch
from safetensors.torch import load_file

import flashmm
from flashmm.drafters import load
from flashmm.drafters.base import SequenceStart
from flashmm.drafters.eagle3 import save_head
from flashmm.drafters.export import check_state, expected_shapes, read_exported
from flashmm.drafters.nets.eagle3_net import Eagle3Config, Eagle3Net
from flashmm.serve.cli import main
from flashmm.targets import CausalLMTarget

from text_models import VOCAB, prompt, tiny_lm


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    target = tiny_lm("llama", seed=0)
    torch.manual_seed(2)
    net = Eagle3Net(Eagle3Config.for_target(target.config, 100, (2, 1, 0)))
    net.set_vocab(torch.arange(VOCAB - 100, VOCAB))
    with torch.no_grad():
        net.lm_head.weight.mul_(6.0)
    folder = save_head(tmp_path_factory.mktemp("head") / "eagle3", net,
                       {"method": "eagle3", "target": {"name": "tiny", "vocab_size": VOCAB, "num_hidden_layers": 2}},
                       dict(tree="dynamic", depth=3, top_k=3))
    return target, folder


def drafts(drafter, target, ids):
    """The drafter's trees over a teacher-forced continuation (features from the target itself)."""
    drafter.bind(CausalLMTarget(target))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i] for i in drafter.feature_layers], dim=-1)
    drafter.begin(SequenceStart(input_ids=ids[:, :6], hidden_states=feats[:, :6]))
    out = []
    for n in range(6, ids.shape[1] - 1):
        draft = drafter.propose(ids[:, : n + 1], 8, None, None)
        out.append((draft.tokens.tolist(), draft.tree.parents.tolist()))
        drafter._pending = torch.cat([drafter._pending, feats[0, n: n + 1]])     # one token accepted per step
    return out


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_export_round_trip_drafts_identically(head, tmp_path, fmt):
    target, folder = head
    assert main(["export-drafter", str(folder), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    state = load_file(str(tmp_path / fmt / "model.safetensors"))
    prefix = "midlayer." if fmt == "sglang" else "layers.0."
    assert set(state) == set(expected_shapes(Eagle3Config.from_dict(json.loads(
        (folder / "drafter.json").read_text())["eagle3_config"]), prefix))
    assert state["lm_head.weight"].dtype == torch.float16 and state["d2t"].dtype == torch.int64
    if fmt == "sglang":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 100
        assert config["target_hidden_size"] == 64 and config["tie_word_embeddings"] is False
        assert config["num_hidden_layers"] == 1
        # (2, 1, 0) is not SGLang's default capture for 2 layers: explicit ids, as layer outputs
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 0, -1]
    else:
        assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 100
        assert config["speculators_config"]["algorithm"] == "eagle3"
        assert config["transformer_layer_config"]["vocab_size"] == VOCAB
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 1, 0]
    ids = target.generate(prompt(6, seed=5), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert drafts(read_exported(tmp_path / fmt, tree="dynamic", depth=3, top_k=3), target, ids) == \
        drafts(load(folder), target, ids)
    sm = flashmm.wrap(target, read_exported(tmp_path / fmt))
    assert torch.equal(sm.generate(ids[:, :6], max_new_tokens=12, eos_token_id=[]),
                       target.generate(ids[:, :6], max_new_tokens=12, do_sample=False, eos_token_id=None))


def test_export_refuses_broken_states(head):
    _, folder = head
    cfg = Eagle3Config.from_dict(json.loads((folder / "drafter.json").read_text())["eagle3_config"])
    state = load_file(str(folder / "model.safetensors"))
    check_state(state, cfg, "midlayer.")
    with pytest.raises(ValueError, match="missing keys"):
        check_state({k: v for k, v in state.items() if k != "fc.weight"}, cfg, "midlayer.")
    with pytest.raises(ValueError, match="wrong shapes"):
        check_state({**state, "lm_head.weight": state["lm_head.weight"][:-1]}, cfg, "midlayer.")
    with pytest.raises(ValueError, match="nonzero"):
        check_state({**state, "d2t": state["d2t"] + 1}, cfg, "midlayer.")
    assert main(["export-drafter", str(folder.parent), "--format", "sglang", "--out", "/tmp/never"]) == 2
