"""Sampled speculative output has the target's distribution, end to end through flashmm.generate.

Target: a tiny random Llama with a 8-token vocabulary, so the exact joint distribution of the
first two sampled tokens (after temperature / top-k / top-p) is enumerable: p(a | x) p(b | x, a)
from float64 softmaxes of the model's own logits. Each method generates 2 tokens in many seeded
trials; a χ² test compares the 64-cell histogram with the exact joint. The lossy typical
verifier must fail the same test (the test can tell a biased method apart).
"""
import pytest
import torch

import flashmm
from flashmm.config import SamplingParams
from flashmm.drafters import DraftModel, FlashDrafter, PromptLookup
from flashmm.sampling import warp_logits

from stats_utils import chi_square_pvalue
from text_models import tiny_lm

V = 8
TRIALS = 1000
SAMPLING = dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95)


@pytest.fixture(scope="module")
def models():
    target = tiny_lm("llama", seed=1, vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    draft = tiny_lm("llama", seed=2, vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():  # soften both so many cells have mass
        for m in (target, draft):
            m.get_output_embeddings().weight.mul_(0.15)
    return target, draft


PROMPT = torch.tensor([[3, 7, 3, 7, 3]])


def padded(draft, rows: int):
    """draft with its output layer padded to ``rows`` rows; the extra rows would dominate if drafted."""
    twin = tiny_lm("llama", seed=2, vocab_size=rows, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        for mine, theirs in zip(twin.model.parameters(), draft.model.parameters()):
            if mine.shape == theirs.shape:
                mine.copy_(theirs)
        twin.model.embed_tokens.weight[:V] = draft.model.embed_tokens.weight
        twin.lm_head.weight[:V] = draft.lm_head.weight
        twin.lm_head.weight[V:] = 3 * draft.lm_head.weight[:1].abs()
    return twin


def exact_joint(target, prompt: torch.Tensor = PROMPT) -> torch.Tensor:
    params = SamplingParams(**SAMPLING)
    with torch.no_grad():
        first = warp_logits(target(prompt).logits[0, -1].double(), params).softmax(-1)
        ext = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], dim=1)
        second = warp_logits(target(ext).logits[:, -1].double(), params).softmax(-1)
    return first[:, None] * second  # [V, V]


def histogram(sm, prompt: torch.Tensor = PROMPT) -> torch.Tensor:
    counts = torch.zeros(V, V)
    g = torch.Generator().manual_seed(1234)
    for _ in range(TRIALS):
        out = sm.generate(prompt, max_new_tokens=2, generator=g, **SAMPLING)
        a, b = out[0, -2:].tolist()
        counts[a, b] += 1
    return counts


@pytest.mark.parametrize("make", [
    lambda t, d: DraftModel(d, max_draft_tokens=2, adaptive=False),               # chain, q given
    lambda t, d: DraftModel(d, max_draft_tokens=4, tree_width=2, adaptive=False),  # i.i.d. siblings
    lambda t, d: DraftModel(padded(d, V + 4), max_draft_tokens=2, adaptive=False),  # padded LM head
    lambda t, d: PromptLookup(),                                                   # deterministic, q None
    lambda t, d: FlashDrafter.from_target(t, num_queries=2, tokens_per_step=2, seed=0, top_k=2, max_draft_tokens=3,
                                          lookup_tokens=3),                        # FLASH tree + lookup path
    lambda t, d: FlashDrafter.from_target(t, num_queries=2, tokens_per_step=2, seed=0, top_k=2, max_draft_tokens=3,
                                          lookup_tokens=3, lookup="suffix"),       # ... from the suffix tries
], ids=["draft_chain", "draft_tree", "draft_padded_vocab", "prompt_lookup", "flash_lookup", "flash_suffix_lookup"])
def test_lossless(models, make):
    target, draft = models
    sm = flashmm.wrap(target, make(target, draft))
    p = chi_square_pvalue(histogram(sm), exact_joint(target))
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"


def test_lossy_typical_is_detected(models):
    target, draft = models
    sm = flashmm.wrap(target, DraftModel(draft, max_draft_tokens=3, adaptive=False), verifier="typical_lossy",
                      typical_epsilon=0.05, typical_delta=0.05)
    p = chi_square_pvalue(histogram(sm), exact_joint(target))
    assert p < 1e-3, "the lossy typical verifier should be distinguishable from the target"


# --- processors beyond the warpers: repetition penalty (reads each position's prefix) and min_p ---
PENALTY, MIN_P, TEMP = 3.0, 0.05, 0.9
PROC_TRIALS = 800  # the root-prefix bug reads p < 1e-30 here, PARD's wrong-q bug p ~ 1e-18


def processed_probs(logits: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    """float64 reference of transformers' repetition penalty → temperature → min_p, by hand."""
    x = logits.double().clone()
    for t in set(prefix):
        x[t] = x[t] * PENALTY if x[t] < 0 else x[t] / PENALTY
    p = (x / TEMP).softmax(-1)
    return torch.where(p >= MIN_P * p.max(), p, torch.zeros_like(p)) / p[p >= MIN_P * p.max()].sum()


@pytest.fixture(scope="module")
def sharp_target():
    target = tiny_lm("llama", seed=3, vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.6)
    return target


def exact_second_third(target) -> torch.Tensor:
    """Exact joint [V, V] of the 2nd and 3rd new tokens (the 3rd is drafted at depth 1 when the
    2nd was drafted and accepted, so a wrong per-node prefix shows up here)."""
    joint = torch.zeros(V, V, dtype=torch.float64)
    base = PROMPT[0].tolist()
    with torch.no_grad():
        first = processed_probs(target(PROMPT).logits[0, -1], base)
        for a in range(V):
            ctx_a = base + [a]
            second = processed_probs(target(torch.tensor([ctx_a])).logits[0, -1], ctx_a)
            ctx = torch.tensor([ctx_a + [b] for b in range(V)])
            logits = target(ctx).logits[:, -1]
            for b in range(V):
                joint[b] += first[a] * second[b] * processed_probs(logits[b], ctx_a + [b])
    return joint


def second_third_histogram(sm) -> torch.Tensor:
    counts = torch.zeros(V, V)
    g = torch.Generator().manual_seed(99)
    for _ in range(PROC_TRIALS):
        out = sm.generate(PROMPT, max_new_tokens=3, generator=g, do_sample=True, temperature=TEMP,
                          repetition_penalty=PENALTY, min_p=MIN_P)
        b, c = out[0, -2:].tolist()
        counts[b, c] += 1
    return counts


def test_processors_lossless_and_bias_detected(sharp_target, monkeypatch):
    """repetition_penalty + min_p: flashmm's sampled tokens follow the processed target exactly; a
    variant that scores every tree node with the root's prefix (the natural bug) is detected."""
    exact = exact_second_third(sharp_target)
    sm = flashmm.wrap(sharp_target, DraftModel(sharp_target, max_draft_tokens=2, adaptive=False))
    p = chi_square_pvalue(second_third_histogram(sm), exact)
    assert p > 1e-3, f"sampled output deviates from the processed target distribution (p = {p:.2e})"

    import flashmm.engine.loop as engine

    def root_prefix_only(sampling, logits, tokens, tree, committed):
        n = tree.num_nodes
        return sampling.scores(logits[0], [committed[0]] * n)[None]
    monkeypatch.setattr(engine, "node_scores", root_prefix_only)
    p = chi_square_pvalue(second_third_histogram(sm), exact)
    assert p < 1e-3, f"scoring drafted nodes with the root's prefix should be detectable (p = {p:.2e})"
