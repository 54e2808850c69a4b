"""flashmm export-drafter --format vllm-medusa: Medusa heads in vLLM's Medusa layout compute the heads' logits.

The exported folder is read back by hand as vLLM's Medusa model reads it (vLLM 0.32 model_executor/models/
medusa.py: blocks.{k}.layers.0 residual SiLU blocks with bias, one shared lm_head with original_lm_head,
token_map for a truncated vocabulary) and its float64 logits must rank tokens as flashmm's Medusa does.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

import flashmm
from flashmm.drafters import load
from flashmm.drafters.head_base import save_heads
from flashmm.drafters.nets.medusa_net import MedusaHeads
from flashmm.serve.cli import main
from text_models import tiny_lm


@pytest.fixture()
def medusa_folder(tmp_path):
    target = tiny_lm("llama", seed=0)
    target.save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    heads = MedusaHeads(target.config.hidden_size, num_heads=3)
    with torch.no_grad():
        heads.weight.normal_(0, 0.2)
        heads.bias.normal_(0, 0.2)
    vocab = torch.arange(0, 128, 2)
    save_heads(tmp_path / "medusa", "medusa", heads, heads.config(), vocab,
               {"method": "medusa", "target": {"name": "tiny", "vocab_size": 128}})
    return target, tmp_path


def test_export_computes_the_heads(medusa_folder):
    target, root = medusa_folder
    out = root / "vllm"
    assert main(["export-drafter", str(root / "medusa"), "--format", "vllm-medusa", "--target",
                 str(root / "target"), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["num_hidden_layers"] == 1
    assert config["original_lm_head"] and config["medusa_fc_bias"] and config["truncated_vocab_size"] == 64
    state = {k: v.double() if v.is_floating_point() else v for k, v in load_file(out / "model.safetensors").items()}
    assert set(state) == {*(f"blocks.{k}.layers.0.{p}" for k in range(3) for p in ("weight", "bias")),
                          "lm_head.weight", "token_map"}

    drafter = load(root / "medusa")
    flashmm.wrap(target, drafter)  # binds the target's LM head
    hidden = torch.randn(5, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = drafter.logits(drafter.heads(hidden))                                     # [5, K, Vd]
    for k in range(3):
        x = hidden.double()
        x = x + torch.nn.functional.silu(x @ state[f"blocks.{k}.layers.0.weight"].T + state[f"blocks.{k}.layers.0.bias"])
        theirs = x @ state["lm_head.weight"].T                                         # [5, 64]: rows token_map
        torch.testing.assert_close(ours[:, k].double(), theirs, atol=2e-3, rtol=1e-3)  # heads stored in fp16
        assert torch.equal(drafter.target_ids(ours[:, k].argmax(-1)), state["token_map"][theirs.argmax(-1)])


def test_export_refusals(medusa_folder, capsys):
    _, root = medusa_folder
    assert main(["export-drafter", str(root / "medusa"), "--format", "vllm-medusa", "--out", str(root / "x")]) == 2
    assert "needs --target" in capsys.readouterr().err
    wrong = tiny_lm("llama", seed=0, vocab_size=96)
    wrong.save_pretrained(root / "wrong")
    assert main(["export-drafter", str(root / "medusa"), "--format", "vllm-medusa", "--target", str(root / "wrong"),
                 "--out", str(root / "x")]) == 2
    assert "128 tokens" in capsys.readouterr().err
