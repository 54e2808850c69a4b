"""Sliding windows and attention chunks: flashmm reads a config's window as generate reads it, and its
self-check runs a prompt longer than any window the config names, so a model whose forward applies a
window otherwise than flashmm's masks is refused instead of decoded differently (issue 41)."""
import pytest
import torch
from transformers import (Llama4ForCausalLM, Llama4TextConfig, Qwen2Config, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          cache_utils)

import flashmm
import flashmm.targets.text as text_target
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.targets import CausalLMTarget, UnsupportedModel
from flashmm.targets.layout import AttentionLayout, attention_layout
from flashmm.targets.support import check_prompt_length

from text_models import tiny_lm

MAX_NEW = 12


def qwen3_moe_window_edited_after_loading() -> torch.nn.Module:
    """Issue 41's model: Qwen3-MoE built without a window, then given one (the constructor drops
    sliding_window when use_sliding_window is False; a config edited after loading keeps it, and the
    model's forward applies it: ``create_sliding_window_causal_mask`` whenever sliding_window is set)."""
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=False, use_sliding_window=False,
                            max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.sliding_window = 8
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


def issue_prompt() -> torch.Tensor:
    """LongTensor [1, 24]: a 10-token segment, again, and its first 4 tokens."""
    g = torch.Generator().manual_seed(7)
    seg = torch.randint(3, 128, (10,), generator=g)
    return torch.cat([seg, seg, seg[:4]])[None]


def tiny_llama4_text(chunk: int = 8) -> torch.nn.Module:
    """Llama 4's text model: its first layer chunked (attention_chunk_size), its second full."""
    config = Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=1,
                              no_rope_layers=[1, 0], attention_chunk_size=chunk, max_position_embeddings=512,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Llama4ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper logits: greedy continuations without near-ties
    return model


# ---------------------------------------------------------------------------- the issue's model
@pytest.mark.parametrize("backends", [{}, {"linear": "torch", "attention": "torch"}])
def test_window_set_after_loading_is_decoded_as_generate_decodes_it(backends):
    model, ids = qwen3_moe_window_edited_after_loading(), issue_prompt()
    ref = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    unwindowed = qwen3_moe_window_edited_after_loading()
    unwindowed.config.sliding_window = None
    assert not torch.equal(ref, unwindowed.generate(ids, max_new_tokens=MAX_NEW, do_sample=False))  # it matters
    for drafter in (PromptLookup(), DraftModel(model, max_draft_tokens=4, tree_width=2, adaptive=False)):
        out = flashmm.wrap(model, drafter, **backends).generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
        assert torch.equal(out, ref), type(drafter).__name__


def test_window_set_after_loading_in_a_left_padded_batch():
    """The batched path applies the same window (from each row's slot positions)."""
    model, ids = qwen3_moe_window_edited_after_loading(), issue_prompt()
    batch = torch.cat([ids, torch.cat([torch.zeros(1, 6, dtype=torch.long), ids[:, 6:]], 1)])
    mask = torch.ones_like(batch)
    mask[1, :6] = 0
    ref = model.generate(batch, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    out = flashmm.wrap(model, PromptLookup()).generate(batch, attention_mask=mask, max_new_tokens=MAX_NEW,
                                                       do_sample=False)
    assert torch.equal(out, ref)


def test_self_check_prompt_exceeds_the_configured_window(monkeypatch):
    """The prompt the self-check prefills is longer than the 8-token window."""
    model = qwen3_moe_window_edited_after_loading()
    prompts = []
    real_prefill = CausalLMTarget.prefill

    def spy(self, input_ids, *args, **kwargs):
        prompts.append(input_ids.shape[1])
        return real_prefill(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(CausalLMTarget, "prefill", spy)
    flashmm.wrap(model, PromptLookup())
    assert prompts and prompts[0] == check_prompt_length(model) > model.config.sliding_window
    assert check_prompt_length(tiny_lm("llama")) == 5                      # no window: as short as before
    assert check_prompt_length(tiny_lm("gemma3")) == 25                     # window 24 on its sliding layers
    assert check_prompt_length(tiny_lm("mistral")) == 5                     # window 4096 > max_position_embeddings


def test_self_check_refuses_a_target_that_reads_the_window_otherwise(monkeypatch):
    """flashmm's old reading (use_sliding_window=False: no window) decodes the issue's model differently
    from generate; the self-check's prompt, longer than the window, now refuses it instead."""
    unwindowed = AttentionLayout(mask_types=("full_attention",), window=None, chunk=None)
    monkeypatch.setattr(text_target, "attention_layout", lambda config: unwindowed)
    with pytest.raises(UnsupportedModel, match="8-token sliding window"):
        flashmm.wrap(qwen3_moe_window_edited_after_loading(), PromptLookup())


def test_a_window_only_generate_s_cache_applies():
    """Llama's forward builds no window mask, but generate's cache for a config naming a window keeps only
    the last window - 1 rows (DynamicSlidingWindowLayer), so its cached steps see a window all the same:
    flashmm reads the window from the same field and decodes the same tokens."""
    model, ids = tiny_lm("llama"), issue_prompt()
    model.config.sliding_window = 6
    ref = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    assert not torch.equal(ref, tiny_lm("llama").generate(ids, max_new_tokens=MAX_NEW, do_sample=False))
    assert torch.equal(flashmm.wrap(model, PromptLookup()).generate(ids, max_new_tokens=MAX_NEW, do_sample=False), ref)


# ---------------------------------------------------------------------------- chunked attention
def test_chunked_attention_matches_generate():
    """Llama 4 text (chunks of 8 on its first layer), single sequence and left-padded batch."""
    model, ids = tiny_llama4_text(), issue_prompt()
    sm = flashmm.wrap(model, PromptLookup())
    assert torch.equal(sm.generate(ids, max_new_tokens=MAX_NEW, do_sample=False),
                       model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False))
    assert sm.last_stats.tau > 1
    batch = torch.cat([ids, torch.cat([torch.zeros(1, 5, dtype=torch.long), ids[:, 5:]], 1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    assert torch.equal(sm.generate(batch, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False),
                       model.generate(batch, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False))


def test_self_check_refuses_a_target_that_ignores_chunks(monkeypatch):
    unchunked = AttentionLayout(mask_types=("chunked_attention", "full_attention"), window=None, chunk=None)
    monkeypatch.setattr(text_target, "attention_layout", lambda config: unchunked)
    with pytest.raises(UnsupportedModel, match="8-token sliding window or attention chunk"):
        flashmm.wrap(tiny_llama4_text(), PromptLookup())


# ---------------------------------------------------------------------------- the reading itself
@pytest.mark.parametrize("case", ["qwen3_moe_edited", "qwen3_moe_off", "qwen2_layer_types_edited", "qwen2_mixed",
                                  "llama4_chunked", "gemma3", "mistral"])
def test_layout_reads_what_transformers_cache_reads(case):
    """attention_layout gives the layer types and windows transformers' own reading of the config gives
    (cache_utils.get_layer_types_and_kwargs, which builds generate's cache)."""
    if case == "qwen3_moe_edited":
        config = qwen3_moe_window_edited_after_loading().config
    elif case == "qwen3_moe_off":
        config = Qwen3MoeConfig(use_sliding_window=False, sliding_window=8, num_hidden_layers=2)
    elif case == "qwen2_layer_types_edited":  # layer_types say full: generate ignores a window set later
        config = Qwen2Config(use_sliding_window=False, num_hidden_layers=2)
        config.sliding_window = 8
    elif case == "qwen2_mixed":
        config = Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, num_hidden_layers=2)
    elif case == "llama4_chunked":
        config = tiny_llama4_text().config
    else:
        config = tiny_lm(case).config
    layer_types, kwargs = cache_utils.get_layer_types_and_kwargs(config)
    layout = attention_layout(config)
    assert layout.mask_types == tuple(sorted(set(layer_types)))
    for layer_type, layer_kwargs in zip(layer_types, kwargs):
        size = layer_kwargs.get("sliding_window")
        if layer_type == "sliding_attention":
            assert layout.window == size
        elif layer_type == "chunked_attention":
            assert layout.chunk == size
