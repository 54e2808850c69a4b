"""attention="triton" on models the tree kernel cannot run, and which attention the prefill runs.

The kernel computes neither attention logit soft-capping (Gemma 2) nor attention sinks (gpt-oss),
and keeps every tree ancestor visible, so a tree as deep as a sliding window is out of its reach.
Asked for Triton on such a model, flashmm must warn once and verify through the PyTorch path,
never raise after the prefill, and still return exactly what ``model.generate`` returns. On
every model the prefill runs the attention implementation the user loaded the model with; only
tree forwards run the tree kernel. On CPU the kernels run under TRITON_INTERPRET=1 (conftest).
"""
import warnings

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama
from transformers import (Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM, MistralConfig,
                          MistralForCausalLM)

import flashmm
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.kernels import ATTENTION_NAME, unsupported_features

from text_models import VOCAB, prompt, tiny_lm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=False)


def sharpened(model: torch.nn.Module) -> torch.nn.Module:
    """fp32 eval model whose greedy continuations are not ties (as tests/text_models.py does)."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.to(DEVICE).eval()


def tiny_gemma2():
    """Soft-capped attention logits (a cap low enough to change them), eager as Gemma 2 asks."""
    torch.manual_seed(0)
    config = Gemma2Config(**SMALL, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                          sliding_window=64, query_pre_attn_scalar=16, attn_implementation="eager")
    return sharpened(Gemma2ForCausalLM(config))


def tiny_gpt_oss():
    """Attention sinks (nonzero, so they change every softmax), mixed sliding/full layers."""
    torch.manual_seed(0)
    config = GptOssConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                          layer_types=["sliding_attention", "full_attention"], attn_implementation="eager")
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return sharpened(model)


def tiny_mistral_short_window():
    """Every layer slides with a window of 3: the 4-deep chains drafted below reach past it."""
    torch.manual_seed(0)
    return sharpened(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=3, attn_implementation="sdpa")))


def fallback_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "Triton tree-attention kernel" in str(w.message)]


@pytest.mark.parametrize("build, feature", [(tiny_gemma2, "soft-capping"), (tiny_gpt_oss, "attention sinks")])
def test_unsupported_attention_falls_back_with_one_warning(build, feature):
    model = build()
    assert any(feature in f for f in unsupported_features(model))
    ids = prompt(20, seed=3).to(DEVICE)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = flashmm.wrap(model, DraftModel(model, max_draft_tokens=3, tree_width=2, adaptive=False),
                          attention="triton")
        assert sm.target.backend == "torch"         # decided at wrap, before any prefill
        out = sm.generate(ids, max_new_tokens=8)
        out_again = sm.generate(ids, max_new_tokens=8)
    messages = fallback_warnings(caught)
    assert len(messages) == 1 and feature in messages[0] and type(model).__name__ in messages[0], messages
    assert torch.equal(out, expected) and torch.equal(out_again, expected)
    assert model.config._attn_implementation == "eager"
    assert sm.last_stats.tau > 1


def test_tree_deeper_than_sliding_window_falls_back_with_one_warning():
    model = tiny_mistral_short_window()
    ids = prompt(20, seed=3).to(DEVICE)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    sm = flashmm.wrap(model, DraftModel(tiny_mistral_short_window(), max_draft_tokens=4, adaptive=False),
                      attention="triton")
    assert sm.target.backend == "triton"            # a window the trees fit in is the kernel's job
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sm.generate(ids, max_new_tokens=8)
        out_again = sm.generate(ids, max_new_tokens=8)
    messages = [str(w.message) for w in caught if "sliding window (3)" in str(w.message)]
    assert len(messages) == 1 and "MistralForCausalLM" in messages[0], [str(w.message) for w in caught]
    assert torch.equal(out, expected) and torch.equal(out_again, expected)
    assert model.config._attn_implementation == "sdpa"


def test_prefill_runs_the_users_attention_and_trees_the_kernel():
    """A Llama loaded with eager attention: the prefill runs Llama's eager function, every tree
    forward runs the tree kernel, and the model keeps "eager" throughout and afterwards."""
    model = tiny_lm("llama").to(DEVICE)
    model.set_attn_implementation("eager")
    ids = prompt(16, seed=6).to(DEVICE)
    expected = model.generate(ids, max_new_tokens=10, do_sample=False)
    seen = []      # (query rows, implementation name) per attention-layer call
    eager_rows = []
    own_eager = modeling_llama.eager_attention_forward

    def spy_eager(module, query, *args, **kwargs):
        eager_rows.append(query.shape[2])
        return own_eager(module, query, *args, **kwargs)

    def record(module, args, kwargs):
        seen.append((kwargs["hidden_states"].shape[1], module.config._attn_implementation))

    sm = flashmm.wrap(model, DraftModel(tiny_lm("llama", seed=9).to(DEVICE), max_draft_tokens=3, tree_width=2,
                                        adaptive=False), attention="triton")
    hooks = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True) for layer in model.model.layers]
    modeling_llama.eager_attention_forward = spy_eager
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # a supported model: no fallback warning
            out = sm.generate(ids, max_new_tokens=10)
    finally:
        modeling_llama.eager_attention_forward = own_eager
        for hook in hooks:
            hook.remove()
    assert torch.equal(out, expected)
    layers = len(model.model.layers)
    prefill, trees = seen[:layers], seen[layers:]
    assert prefill == [(ids.shape[1], "eager")] * layers
    assert eager_rows == [ids.shape[1]] * layers       # Llama's own eager function ran the prefill, only it
    assert trees and all(name == ATTENTION_NAME for _, name in trees)
    assert sm.last_stats.verify_steps == len(trees) // layers
    assert model.config._attn_implementation == "eager"


def test_vision_language_prefill_keeps_its_attention():
    """Qwen2-VL loaded with eager attention on the Triton path: the vision tower and the prefill
    run eager, the tree forwards (M-RoPE positions) the tree kernel; output equals generate."""
    from mm_models import make_inputs, tiny_vlm

    model, processor = tiny_vlm("qwen2_vl")
    model = model.to(DEVICE)
    model.set_attn_implementation("eager")
    inputs = {k: v.to(DEVICE) for k, v in make_inputs(processor, "qwen2_vl", images=1).items()}
    expected = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    seen = []      # (part, implementation name) per attention call

    def recorder(part):
        return lambda module, args: seen.append((part, module.config._attn_implementation))

    attentions = [("vision", block.attn) for block in model.model.visual.blocks]
    attentions += [("text", layer.self_attn) for layer in model.get_decoder().layers]
    sm = flashmm.wrap(model, PromptLookup(), processor=processor, attention="triton")  # (its self-check runs text)
    hooks = [module.register_forward_pre_hook(recorder(part)) for part, module in attentions]
    try:
        out = sm.generate(**inputs, max_new_tokens=5)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(out, expected)
    text_layers = len(model.get_decoder().layers)
    prefill = seen[:len(attentions)]                      # the vision tower, then the text layers
    assert prefill == [(part, "eager") for part, _ in attentions]
    trees = [name for part, name in seen[len(attentions):] if part == "text"]
    assert len(trees) == sm.last_stats.verify_steps * text_layers
    assert set(trees) == {ATTENTION_NAME}
    assert model.config.get_text_config()._attn_implementation == "eager"
