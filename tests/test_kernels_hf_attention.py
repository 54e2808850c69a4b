"""Tree attention inside real transformers models (tiny random configs, fp32).

A tree forward through the registered attention function (Triton kernel under
TRITON_INTERPRET=1 on CPU, and the torch backend) must give the logits of the same forward
with a 4D additive mask through SDPA (TokenTree.attention_bias, windowed where the model
has sliding-window layers); the switch routes only the forwards inside it and always gives the
model back its own implementation.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import (  # noqa: E402
    DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
    MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
)

from flashmm.kernels.hf_attention import (  # noqa: E402
    ATTENTION_NAME, TreeAttentionSwitch, resolve_backend, tree_attention_kwargs,
)
from flashmm.targets.cache import cache_argument  # noqa: E402
from flashmm.tree.token_tree import TokenTree  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TREE = TokenTree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])


def build(name: str):
    torch.manual_seed(0)
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON))
    elif name == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON))
    elif name == "mistral":        # every layer slides; the prefix is longer than the window
        model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=8))
    else:                          # Gemma 3 mixes sliding and full layers
        model = Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, sliding_window=8,
                                                   layer_types=["sliding_attention", "full_attention"]))
    return model.to(DEVICE).eval()


def reference_mask(model, tree: TokenTree, prefix: int, bsz: int, pad: torch.Tensor | None, window=True):
    """Additive [B, 1, N, P + N] mask (a dict by layer type for mixed models), windows applied."""
    bias = tree.attention_bias(prefix, torch.float32, DEVICE).expand(bsz, -1, -1, -1).clone()
    if pad is not None:
        cols = torch.arange(prefix, device=DEVICE)
        bias[:, :, :, :prefix] = bias[:, :, :, :prefix].masked_fill(
            (cols[None] < pad[:, None])[:, None, None], torch.finfo(torch.float32).min)
    size = getattr(model.config, "sliding_window", None)
    if size is None or not window:
        return bias
    q_pos = tree.positions(prefix).to(DEVICE)
    k_pos = torch.cat([torch.arange(prefix, device=DEVICE), q_pos])
    windowed = bias.masked_fill((q_pos[:, None] - k_pos[None]) >= size, torch.finfo(torch.float32).min)
    if getattr(model.config, "layer_types", None) and "full_attention" in model.config.layer_types:
        return {"full_attention": bias, "sliding_attention": windowed}
    return windowed


def prefill(model, ids, attention_mask=None):
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=attention_mask, **{cache_argument(model): cache}, use_cache=True)
    return cache, out.logits


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma3"])
def test_tree_forward_matches_additive_mask(name):
    model = build(name)
    gen = torch.Generator().manual_seed(1)
    bsz, prefix = 2, 13
    ids = torch.randint(0, VOCAB, (bsz, prefix), generator=gen).to(DEVICE)
    tokens = torch.randint(0, VOCAB, (bsz, TREE.num_nodes), generator=gen).to(DEVICE)
    positions = TREE.positions(prefix).to(DEVICE)[None].expand(bsz, -1)
    with torch.no_grad():
        cache, plain_prefill = prefill(model, ids)
        expected = model(input_ids=tokens, **{cache_argument(model): cache}, use_cache=True, position_ids=positions,
                         attention_mask=reference_mask(model, TREE, prefix, bsz, None)).logits
        if getattr(model.config, "sliding_window", None):   # the window must matter here
            cache, _ = prefill(model, ids)
            unwindowed = model(input_ids=tokens, **{cache_argument(model): cache}, use_cache=True, position_ids=positions,
                               attention_mask=reference_mask(model, TREE, prefix, bsz, None, window=False)).logits
            assert (unwindowed - expected).abs().max() > 1e-3
        switch = TreeAttentionSwitch(model)
        assert model.config._attn_implementation == "sdpa"                      # building it changes nothing
        for backend in ("triton", "torch"):
            cache, logits = prefill(model, ids)
            torch.testing.assert_close(logits, plain_prefill, atol=0, rtol=0)
            kwargs = tree_attention_kwargs(TREE, prefix, bsz, DEVICE, backend=backend)
            with switch:
                assert model.config._attn_implementation == ATTENTION_NAME
                got = model(input_ids=tokens, **{cache_argument(model): cache}, use_cache=True, position_ids=positions,
                            **kwargs).logits
            assert model.config._attn_implementation == "sdpa"
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            assert cache.get_seq_length() == prefix + TREE.num_nodes


def test_left_padded_batch():
    model = build("llama")
    gen = torch.Generator().manual_seed(2)
    bsz, prefix = 3, 11
    ids = torch.randint(0, VOCAB, (bsz, prefix), generator=gen).to(DEVICE)
    pad = torch.tensor([0, 4, 7], device=DEVICE)
    attention_mask = (torch.arange(prefix, device=DEVICE)[None] >= pad[:, None]).long()
    tokens = torch.randint(0, VOCAB, (bsz, TREE.num_nodes), generator=gen).to(DEVICE)
    positions = (prefix - pad)[:, None] + TREE.depth.to(DEVICE)[None]
    with torch.no_grad():
        cache, _ = prefill(model, ids, attention_mask)
        expected = model(input_ids=tokens, **{cache_argument(model): cache}, use_cache=True, position_ids=positions,
                         attention_mask=reference_mask(model, TREE, prefix, bsz, pad)).logits
        cache, _ = prefill(model, ids, attention_mask)
        kwargs = tree_attention_kwargs(TREE, prefix, bsz, DEVICE, backend="triton", padding_mask=attention_mask)
        with TreeAttentionSwitch(model):
            got = model(input_ids=tokens, **{cache_argument(model): cache}, use_cache=True, position_ids=positions,
                        **kwargs).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_chain_through_kernel_equals_plain_causal_forward():
    """A chain verified through the tree path equals the model's own causal forward."""
    model = build("qwen2")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, 20), generator=gen).to(DEVICE)
    with torch.no_grad():
        cache, _ = prefill(model, ids[:, :12])
        expected = model(input_ids=ids[:, 12:], **{cache_argument(model): cache}, use_cache=True).logits
        cache, _ = prefill(model, ids[:, :12])
        chain = TokenTree.chain(7)
        with TreeAttentionSwitch(model):
            got = model(input_ids=ids[:, 12:], **{cache_argument(model): cache}, use_cache=True,
                        position_ids=chain.positions(12).to(DEVICE)[None],
                        **tree_attention_kwargs(chain, 12, 1, DEVICE, backend="triton")).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_errors_name_the_fix():
    model = build("llama")
    switch = TreeAttentionSwitch(model)
    cache, _ = prefill(model, torch.zeros(1, 4, dtype=torch.long, device=DEVICE))
    kwargs = tree_attention_kwargs(TREE, 3, 1, DEVICE, backend="torch")   # wrong prefix length
    with pytest.raises(ValueError, match="prefix_len"), torch.no_grad(), switch:
        model(input_ids=torch.zeros(1, TREE.num_nodes, dtype=torch.long, device=DEVICE),
              **{cache_argument(model): cache}, **kwargs)
    assert model.config._attn_implementation == "sdpa"                   # given back on the error too
    kwargs.pop("spec_tree")                                               # mask without its args
    with pytest.raises(RuntimeError, match="attention='torch'"), torch.no_grad(), switch:
        model(input_ids=torch.zeros(1, TREE.num_nodes, dtype=torch.long, device=DEVICE), **kwargs)
    with pytest.raises(ValueError, match="one of"):
        resolve_backend("fast", "cpu")
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("auto", "cuda") == "triton"
