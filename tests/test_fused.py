"""flashmm's fused step (flashmm.targets.fused) against the model's own forward and ``generate``."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import flashmm
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.targets import fused, fused_attention
from flashmm.targets import cache as kv
from flashmm.targets.layout import attention_layout
from flashmm.targets.onednn import onednn_available
from flashmm.tree.token_tree import TokenTree

from text_models import prompt, ragged_batch, tiny_lm

pytestmark = pytest.mark.skipif(not (onednn_available() and fused.can_pack()), reason="torch without oneDNN")
FUSED = ["llama", "qwen2", "qwen3"]  # plain, q/k/v biases, per-head q/k norms


def own(model, ids, cache, **kwargs):
    out = model(input_ids=ids, use_cache=True, output_hidden_states=True, **{kv.cache_argument(model): cache}, **kwargs)
    return out.logits, out.hidden_states


def close(a, b):
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", FUSED)
@torch.no_grad()
def test_every_forward_shape_equals_the_models_own(arch):
    """Prompt, chain after the cache, a tree under a 4-D mask and a padded batch's prompt: logits and every
    hidden state equal the model's own forward to fp32 rounding, and the caches hold the same rows."""
    model = tiny_lm(arch)
    assert fused.supports(model, attention_layout(model.config)) is None
    step = fused.fused_step(model)
    ids = prompt(30, seed=2)
    mine, theirs = DynamicCache(), DynamicCache()
    logits, hidden = step(ids, torch.arange(30)[None], mine, want_hidden=True)
    ref_logits, ref_hidden = own(model, ids, theirs)
    close(logits, ref_logits)
    assert len(hidden) == len(ref_hidden)
    for a, b in zip(hidden, ref_hidden):
        close(a, b)
    chain = prompt(3, seed=4)
    positions = torch.arange(30, 33)[None]
    close(step(chain, positions, mine)[0], own(model, chain, theirs, position_ids=positions)[0])
    for a, b in zip(kv.layer_tensors(mine), kv.layer_tensors(theirs)):
        close(a, b)
    tree = TokenTree(torch.tensor([-1, 0, 0, 1, 2]))
    nodes, mask = prompt(5, seed=6), tree.attention_bias(33, torch.float32, torch.device("cpu"))
    positions = tree.positions(33)[None]
    close(step(nodes, positions, mine, mask)[0], own(model, nodes, theirs, attention_mask=mask, position_ids=positions)[0])
    batch, attention = ragged_batch()
    places = (attention.cumsum(-1) - 1).clamp(min=0)
    logits, _ = step(batch, places, DynamicCache(), attention, logits_to_keep=1)
    ref, _ = own(model, batch, DynamicCache(), attention_mask=attention, position_ids=places, logits_to_keep=1)
    close(logits, ref)


@torch.no_grad()
def test_the_cache_room_is_reused_and_readopted():
    """Steps write into the room behind a layer's tensors (no copy of the cache per step); a cache whose
    tensors were replaced (the model's own forward, a path kept out of order) is adopted again, and the
    rows stay those of the model's own cache."""
    model = tiny_lm("llama")
    step = fused.fused_step(model)
    mine, theirs = DynamicCache(), DynamicCache()
    ids = prompt(20, seed=1)
    step(ids, torch.arange(20)[None], mine)
    own(model, ids, theirs)
    room = mine.layers[0].room[0].data_ptr()
    for start in range(20, 26):
        token = prompt(1, seed=start)
        step(token, torch.tensor([[start]]), mine)
        own(model, token, theirs, position_ids=torch.tensor([[start]]))
    assert mine.layers[0].keys.data_ptr() == room  # six steps, one allocation
    kv.keep_rows(mine, 22, torch.tensor([[0, 2, 3]]))
    kv.keep_rows(theirs, 22, torch.tensor([[0, 2, 3]]))
    token = prompt(1, seed=40)
    own(model, token, mine, position_ids=torch.tensor([[25]]))  # the model's own forward: cat, a new tensor
    own(model, token, theirs, position_ids=torch.tensor([[25]]))
    token = prompt(2, seed=41)
    close(step(token, torch.tensor([[26, 27]]), mine)[0], own(model, token, theirs, position_ids=torch.tensor([[26, 27]]))[0])
    for a, b in zip(kv.layer_tensors(mine), kv.layer_tensors(theirs)):
        close(a, b)


def group_cost(groups, first, slots):
    return sum(fused_attention.CALL_SLOTS + (end - start) * (slots - low) for start, end, low in groups)


def test_row_groups_are_the_cheapest_runs_of_rows():
    """row_groups against every split of the rows into runs (brute force): the same cost, and each run
    starting at the first slot one of its rows sees."""
    import itertools

    slots = 900
    for first in ([0, 700, 850, 860, 0, 880, 875, 10], [5, 5, 5], [800, 0], [600, 610, 620, 0, 0, 640]):
        bias = torch.zeros(len(first), 1, 2, slots)
        for b, f in enumerate(first):
            bias[b, :, :, :f] = torch.finfo(torch.float32).min
        groups = fused_attention.row_groups(bias)
        splits = []
        for cuts in itertools.product([False, True], repeat=len(first) - 1):
            edges = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [len(first)]
            splits.append([(a, b, min(first[a:b])) for a, b in zip(edges, edges[1:])])
        cheapest = min(group_cost(g, first, slots) for g in splits)
        if groups is None:
            assert group_cost([(0, len(first), 0)], first, slots) == cheapest
        else:
            assert group_cost(groups, first, slots) == cheapest
            assert [g[:2] for g in groups] == sorted(g[:2] for g in groups) and groups[-1][1] == len(first)
            assert all(low == min(first[a:b]) for a, b, low in groups)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_rows_attending_from_different_slots_equal_the_models_own(arch):
    """A batch whose rows see different leading slots (a batch's holes and a longer row's prompt) attends in
    runs of rows (row_groups): logits equal the model's own forward under the same mask."""
    model = tiny_lm(arch)
    step = fused.fused_step(model)
    lengths = (300, 12, 290, 20)
    ids, attention = ragged_batch(lengths)
    places = (attention.cumsum(-1) - 1).clamp(min=0)
    mine, theirs = DynamicCache(), DynamicCache()
    step(ids, places, mine, attention)
    own(model, ids, theirs, attention_mask=attention, position_ids=places)
    tree = TokenTree(torch.tensor([-1, 0, 0]))
    nodes = torch.cat([prompt(3, seed=50 + b) for b in range(len(lengths))])
    width = ids.shape[1]
    allowed = torch.cat([attention.bool()[:, None, :].expand(-1, 3, -1),
                         tree.attention_bias(0, torch.float32, torch.device("cpu"))[0, 0].eq(0)[None].expand(4, -1, -1)], 2)
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[:, None]
    positions = attention.sum(1, keepdim=True) + tree.positions(0)[None]
    assert fused_attention.row_groups(bias) is not None
    close(step(nodes, positions, mine, bias)[0], own(model, nodes, theirs, attention_mask=bias, position_ids=positions)[0])


@pytest.mark.parametrize("arch", FUSED)
def test_rows_with_fewer_real_nodes_attend_with_their_own_queries(arch):
    """A padded tree forward whose rows have 3, 1, 2 and 1 real nodes (``nodes``): rows attend in runs by
    how many queries they need (query_runs), and each row's real positions equal the model's own forward
    under the same mask; padding positions are zeros."""
    # a call costs CALL_SLOTS + rows x slots x (1 + QUERY_WEIGHT x (queries - 1)): long rows split, short ones not
    assert fused_attention.query_runs([(0, 4, 0)], [3, 1, 1, 2], 2000) == [(0, 1, 0, 3), (1, 3, 0, 1), (3, 4, 0, 2)]
    assert fused_attention.query_runs([(0, 4, 0)], [3, 1, 1, 2], 100) == [(0, 4, 0, 3)]
    assert fused_attention.query_runs([(0, 2, 5), (2, 4, 0)], [1, 1, 4, 2], 2000) == [(0, 2, 5, 1), (2, 4, 0, 4)]
    model = tiny_lm(arch)
    step = fused.fused_step(model)
    lengths, nodes = (300, 12, 290, 20), [3, 1, 2, 1]
    ids, attention = ragged_batch(lengths)
    places = (attention.cumsum(-1) - 1).clamp(min=0)
    mine, theirs = DynamicCache(), DynamicCache()
    step(ids, places, mine, attention)
    own(model, ids, theirs, attention_mask=attention, position_ids=places)
    tree = TokenTree(torch.tensor([-1, 0, 0]))   # a real node never sees a later (padding) one
    drafted = torch.cat([prompt(3, seed=60 + b) for b in range(len(lengths))])
    allowed = torch.cat([attention.bool()[:, None, :].expand(-1, 3, -1),
                         tree.attention_bias(0, torch.float32, torch.device("cpu"))[0, 0].eq(0)[None].expand(4, -1, -1)], 2)
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[:, None]
    positions = attention.sum(1, keepdim=True) + tree.positions(0)[None]
    got = step(drafted, positions, mine, bias, nodes=nodes)[0]
    want = own(model, drafted, theirs, attention_mask=bias, position_ids=positions)[0]
    for b, count in enumerate(nodes):
        close(got[b, :count], want[b, :count])
        assert not got[b, count:].any()


class StepCounter:
    def __init__(self, monkeypatch):
        self.calls = []
        original = fused.FusedDecoder.__call__

        def counting(step, input_ids, *args, **kwargs):
            self.calls.append(tuple(input_ids.shape))
            return original(step, input_ids, *args, **kwargs)

        monkeypatch.setattr(fused.FusedDecoder, "__call__", counting)


@pytest.mark.parametrize("arch", FUSED)
def test_greedy_on_the_fused_step_is_generate(arch, monkeypatch):
    """flashmm on a fused target: one row and a ragged batch of three, greedy output equal to the model's
    own (batched) ``generate``; the prefill and every verification ran on the fused step."""
    model, draft = tiny_lm(arch), tiny_lm(arch, seed=5)
    counter = StepCounter(monkeypatch)
    ids = prompt(40, seed=3)
    reference = model.generate(ids, do_sample=False, max_new_tokens=24)
    batch, attention = ragged_batch()
    batch_reference = model.generate(batch, attention_mask=attention, do_sample=False, max_new_tokens=20)
    for drafter in (PromptLookup(), DraftModel(draft, max_draft_tokens=4, tree_width=2, adaptive=False)):
        sm = flashmm.wrap(model, drafter, linear="onednn")
        assert sm.target.unfused is None
        counter.calls.clear()
        assert torch.equal(sm.generate(ids, max_new_tokens=24), reference)
        target_calls = [shape for shape in counter.calls if shape[0] == 1]
        assert len(target_calls) == 1 + sm.last_stats.verify_steps and target_calls[0] == (1, 40)
        assert torch.equal(sm.generate(batch, attention_mask=attention, max_new_tokens=20), batch_reference)


def test_generate_on_the_fused_forward_is_generate():
    """FusedForward (the plain_onednn baseline's forward): ``generate`` of one prompt and of a padded
    batch gives the tokens of the model's own forward, and the model's forward is its own again after."""
    model = tiny_lm("qwen2")
    batch, attention = ragged_batch()
    reference = model.generate(batch, attention_mask=attention, do_sample=False, max_new_tokens=20)
    single = model.generate(prompt(30), do_sample=False, max_new_tokens=20)
    with fused.FusedForward(model):
        assert torch.equal(model.generate(batch, attention_mask=attention, do_sample=False, max_new_tokens=20), reference)
        assert torch.equal(model.generate(prompt(30), do_sample=False, max_new_tokens=20), single)
    assert "forward" not in model.__dict__


def test_what_is_not_fused_says_why():
    """Models the step does not compute, and linear='torch', keep the model's own forward, naming why."""
    assert "Gemma3ForCausalLM is not one of" in flashmm.wrap(tiny_lm("gemma3"), PromptLookup()).target.unfused
    assert "sliding-window" in fused.supports(tiny_lm("mistral"), attention_layout(tiny_lm("mistral").config))
    assert "fp32" in fused.supports(tiny_lm("llama").to(torch.bfloat16), attention_layout(tiny_lm("llama").config))
    assert "linear='torch'" in flashmm.wrap(tiny_lm("llama"), PromptLookup(), linear="torch").target.unfused
    hooked = tiny_lm("llama")
    hooked.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert "hooked forward" in fused.supports(hooked, attention_layout(hooked.config))  # (the step would skip it)
    model = tiny_lm("llama")
    ids = prompt(4)
    with torch.enable_grad(), fused.FusedForward(model):  # autograd: the model's own forward, gradients flow
        model(input_ids=ids, cache=DynamicCache(), use_cache=True).logits.sum().backward()
    assert model.lm_head.weight.grad is not None


@torch.no_grad()
def test_other_inputs_take_the_models_own_forward():
    """A call the step does not compute (embeddings given: a prompt with its media) runs the model's own
    forward inside FusedForward; the next text forward continues its cache on the fused step."""
    model = tiny_lm("llama")
    ids = prompt(12, seed=8)
    embeds = model.get_input_embeddings()(ids)
    mine, theirs = DynamicCache(), DynamicCache()
    with fused.FusedForward(model):
        first = model(inputs_embeds=embeds, cache=mine, use_cache=True).logits
        token = prompt(1, seed=9)
        second = model(input_ids=token, cache=mine, use_cache=True).logits
    close(first, model(inputs_embeds=embeds, cache=theirs, use_cache=True).logits)
    close(second, model(input_ids=token, cache=theirs, use_cache=True).logits)


@torch.no_grad()
def test_a_changed_weight_rebuilds_the_step():
    """The packed copies follow the model: after an in-place change of a weight the step is built again and
    computes the changed model."""
    model = tiny_lm("llama")
    first = fused.fused_step(model)
    assert fused.fused_step(model) is first
    model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    ids = prompt(9, seed=12)
    assert fused.fused_step(model) is not first
    close(fused.fused_step(model)(ids, torch.arange(9)[None], DynamicCache())[0], own(model, ids, DynamicCache())[0])


@torch.no_grad()
def test_a_vlm_verifies_on_the_fused_step_and_generate_keeps_its_media():
    """LLaVA on a Llama decoder: flashmm's text forwards run the fused step (greedy equal to generate with the
    image), and generate inside FusedForward takes the image (its prompt on the model's own forward)."""
    from mm_models import make_inputs, tiny_llava  # noqa: PLC0415

    model, processor = tiny_llava("llava")
    inputs = make_inputs(processor, "llava", images=1)
    reference = model.generate(**inputs, do_sample=False, max_new_tokens=12)
    sm = flashmm.wrap(model, PromptLookup(), linear="onednn")
    assert sm.target.unfused is None
    assert torch.equal(sm.generate(**inputs, max_new_tokens=12), reference)
    with fused.FusedForward(model):
        assert torch.equal(model.generate(**inputs, do_sample=False, max_new_tokens=12), reference)


@torch.no_grad()
def test_a_vlm_prompt_runs_its_language_model_on_the_fused_step(monkeypatch):
    """A padded batch of LLaVA prompts with images: the model's own forward (vision tower, projector, merge,
    LM head) with its language model on the fused step gives the logits, the hidden states and the cache rows
    of the model's own forward at every real position."""
    from mm_models import make_inputs, tiny_llava  # noqa: PLC0415
    from flashmm.serve.collate import collate  # noqa: PLC0415

    model, processor = tiny_llava("llava")
    rows = [make_inputs(processor, "llava", images=1, text=text) for text in ("Describe it.", "What colour is it?")]
    batch = collate(rows, processor.tokenizer.pad_token_id)
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    calls, step = [], fused.FusedDecoder.__call__
    monkeypatch.setattr(fused.FusedDecoder, "__call__",
                        lambda self, *a, **k: calls.append(k.get("inputs_embeds") is not None) or step(self, *a, **k))
    mine, theirs = DynamicCache(), DynamicCache()
    with fused.FusedForward(model).language_model():
        got = model(**batch, position_ids=positions, cache=mine, use_cache=True, output_hidden_states=True)
    assert calls == [True]
    ref = model(**batch, position_ids=positions, cache=theirs, use_cache=True, output_hidden_states=True)
    real = mask.bool()
    close(got.logits[real], ref.logits[real])
    assert len(got.hidden_states) == len(ref.hidden_states)
    for a, b in zip(got.hidden_states, ref.hidden_states):
        close(a[real], b[real])
    for a, b in zip(mine.layers, theirs.layers):
        close(a.keys.transpose(1, 2)[real], b.keys.transpose(1, 2)[real])
        close(a.values.transpose(1, 2)[real], b.values.transpose(1, 2)[real])


@torch.no_grad()
def test_transformers_own_output_recorders_do_not_unfuse():
    """transformers installs output-recording hooks for good when hidden states are first asked for; those
    are not a user's hooks, and the model stays fused."""
    model = tiny_lm("llama")
    model(prompt(5), output_hidden_states=True)
    assert fused.supports(model, attention_layout(model.config)) is None


@torch.no_grad()
def test_folded_grouped_attention_is_attention():
    """``attend`` (a step's query heads folded onto their kv head) against attention written out in float64 with
    every kv head repeated per query head: masks of [n, S] and [B, 1, n, S], 1 to 20 positions, every grouping."""
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, n, batch in ((9, 3, 2, 4), (8, 2, 5, 1), (4, 4, 3, 2), (6, 1, 20, 3), (9, 3, 1, 2)):
        slots = 37
        q = torch.randn(batch, heads, n, 16, generator=gen)
        keys, values = torch.randn(2, batch, kv_heads, slots, 16, generator=gen)
        allowed = torch.rand(batch, 1, n, slots, generator=gen) > 0.4
        allowed[..., -1] = True  # every position sees at least itself
        for mask in (torch.zeros(batch, 1, n, slots).masked_fill_(~allowed, torch.finfo(torch.float32).min),
                     torch.zeros(n, slots).masked_fill_(~allowed[0, 0], torch.finfo(torch.float32).min)):
            group = heads // kv_heads
            scores = q.double() @ keys.double().repeat_interleave(group, 1).transpose(-1, -2) * 0.25
            reference = (scores + mask.double()).softmax(-1) @ values.double().repeat_interleave(group, 1)
            got = fused_attention.attend(q, keys, values, mask, False, 0.25)
            torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)
