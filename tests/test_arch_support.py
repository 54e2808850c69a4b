"""One tiny model of every kind: exact (token-identical to model.generate, τ > 1 with drafter = target)
or refused at wrap() with the reason. eval/arch_support.py runs every registered architecture;
hybrid and recurrent models (Mamba, Mamba-2, Bamba, Qwen3-Next) are in tests/test_hybrid.py."""
import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.targets import UnsupportedModel

from text_models import prompt, tiny_causal_lm, tiny_lm

MAX_NEW = 12


def assert_exact(model, ids, min_tau=1.0):
    """Prompt lookup, drafter = target (chain) and drafter = target (width-2 tree) all give
    model.generate's greedy tokens; τ > min_tau with drafter = target."""
    ref = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    for drafter in (PromptLookup(), DraftModel(model, max_draft_tokens=4, adaptive=False),
                    DraftModel(model, max_draft_tokens=8, tree_width=2, adaptive=False)):
        sm = flashmm.wrap(model, drafter)
        out = sm.generate(ids, max_new_tokens=MAX_NEW)
        assert torch.equal(out, ref), type(drafter).__name__
        if isinstance(drafter, DraftModel):
            assert sm.last_stats.tau > min_tau


def repeated_prompt(length: int = 10) -> torch.Tensor:
    ids = prompt(length, seed=length)
    return torch.cat([ids, ids], dim=1)  # something for prompt lookup to find


def test_dense():
    assert_exact(tiny_lm("llama"), repeated_prompt(), min_tau=4.0)


def test_sliding_window():
    """A window (8) shorter than the prompt: tree masks must apply it."""
    assert_exact(tiny_lm("mistral", sliding_window=8), repeated_prompt(12), min_tau=4.0)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe(model_type):
    assert_exact(tiny_causal_lm(model_type), repeated_prompt(), min_tau=4.0)


def test_moe_routing_does_not_depend_on_tokens_per_forward():
    """Each token of a Qwen3-MoE forward picks the same experts, and gets the same block output
    (to fp32 rounding), whether it shares the forward with 8 other tokens or runs alone."""
    model = tiny_causal_lm("qwen3_moe", num_experts=32, num_experts_per_tok=4)
    block = model.model.layers[0].mlp
    hidden = torch.randn(1, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        together = block(hidden)
        alone = torch.cat([block(hidden[:, i : i + 1]) for i in range(9)], dim=1)
        experts_together = block.gate(hidden[0])[2]
        experts_alone = torch.cat([block.gate(hidden[0, i : i + 1])[2] for i in range(9)])
    assert torch.equal(experts_together.sort(-1).values, experts_alone.sort(-1).values)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_encoder_head_with_is_decoder_gets_generates_positions():
    """RoBERTa-style heads derive positions from padding_idx + 1 when given none, while generate
    passes arange positions: flashmm passes generate's (prefill, chains, trees) and is exact."""
    assert_exact(tiny_causal_lm("roberta", is_decoder=True), repeated_prompt())


def test_causal_model_whose_config_says_is_decoder_false():
    """GPT-NeoX's config carries is_decoder=False, yet it attends causally: decoded, not refused."""
    model = tiny_causal_lm("gpt_neox")
    assert model.config.is_decoder is False
    assert_exact(model, repeated_prompt(), min_tau=4.0)


@pytest.mark.parametrize("model_type, overrides, reason", [
    ("roberta", {}, "is_decoder=False"),  # encoder-derived: bidirectional, no autoregressive decoding
    # recurrence outside transformers' cache layers: _is_stateful before transformers 5.25, its own cache after
    ("rwkv", {"attention_hidden_size": 64}, "stateful|a cache of its own"),
    ("cpmant", {}, "cached tree forward fails"),  # own positions / cache layout: caught by the self-check
])
def test_refused_with_reason(model_type, overrides, reason):
    model = tiny_causal_lm(model_type, **overrides)
    with pytest.raises(UnsupportedModel, match=reason) as refusal:
        flashmm.wrap(model, PromptLookup())
    assert type(model).__name__ in str(refusal.value)


def tiny_bart():
    """A tiny BART decoder (BartForCausalLM): it numbers positions itself (no position_ids argument)."""
    from transformers import BartConfig, BartForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    config = BartConfig(vocab_size=128, d_model=64, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
                        encoder_attention_heads=4, decoder_ffn_dim=128, encoder_ffn_dim=128, max_position_embeddings=256,
                        is_decoder=True, is_encoder_decoder=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        init_std=0.2)
    return BartForCausalLM(config).eval()


def test_a_decoder_numbering_its_own_positions_gets_the_trees_positions():
    """BART-family decoders derive positions from the cache length, right for a chain and wrong for a
    tree: flashmm hands their position embedding the tree's positions, so width-2 trees are exact."""
    model = tiny_bart()
    assert_exact(model, repeated_prompt(), min_tau=2.0)
    batch = torch.cat([prompt(8, seed=1), prompt(8, seed=2)])       # equal lengths: rows, exact
    sm = flashmm.wrap(model, DraftModel(model, max_draft_tokens=8, tree_width=2, adaptive=False))
    assert torch.equal(sm.generate(batch, max_new_tokens=MAX_NEW),
                       model.generate(batch, max_new_tokens=MAX_NEW, do_sample=False))
    padded = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), prompt(6, seed=3)], 1), prompt(8, seed=4)])
    with pytest.raises(NotImplementedError, match="padding"):
        sm.generate(padded, attention_mask=(padded != 0).long(), max_new_tokens=4)


def _bare_llama():
    """A LlamaModel: the decoder without its language-model head (get_output_embeddings() is None)."""
    from transformers import LlamaConfig, LlamaModel  # noqa: PLC0415

    return LlamaModel(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2)).eval()


@pytest.mark.parametrize("model_type, cls_name, reason", [
    ("musicgen", "MusicgenForCausalLM", "list of 4 heads"),  # one head per audio codebook
    # block diffusion: logits for a whole block per forward (the self-check's shapes differ; it crashed before)
    ("diffusion_gemma", "DiffusionGemmaForBlockDiffusion", "non-autoregressive"),
    ("llama", "LlamaModel", "no language-model head"),
])
def test_not_a_next_token_decoder_is_refused(model_type, cls_name, reason):
    """Models without one next-token distribution per input token are refused at wrap(), naming why."""
    from tools.arch.tiny_configs import tiny_model  # noqa: PLC0415

    model = _bare_llama() if cls_name == "LlamaModel" else tiny_model(model_type, cls_name)
    with pytest.raises(UnsupportedModel, match=reason) as refusal:
        flashmm.wrap(model, PromptLookup())
    assert cls_name in str(refusal.value)
