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


def exact_joint(target) -> torch.Tensor:
    params = SamplingParams(**SAMPLING)
    with torch.no_grad():
        first = warp_logits(target(PROMPT).logits[0, -1].double(), params).softmax(-1)
        ext = torch.cat([PROMPT.expand(V, -1), torch.arange(V)[:, None]], dim=1)
        second = warp_logits(target(ext).logits[:, -1].double(), params).softmax(-1)
    return first[:, None] * second  # [V, V]


def histogram(sm) -> torch.Tensor:
    counts = torch.zeros(V, V)
    g = torch.Generator().manual_seed(1234)
    for _ in range(TRIALS):
        out = sm.generate(PROMPT, max_new_tokens=2, generator=g, **SAMPLING)
        a, b = out[0, -2:].tolist()
        counts[a, b] += 1
    return counts


@pytest.mark.parametrize("make", [
    lambda t, d: DraftModel(d, max_draft_tokens=2, adaptive=False),               # chain, q given
    lambda t, d: DraftModel(d, max_draft_tokens=4, tree_width=2, adaptive=False),  # i.i.d. siblings
    lambda t, d: PromptLookup(),                                                   # deterministic, q None
    lambda t, d: FlashDrafter.from_target(t, num_queries=2, tokens_per_step=2, seed=0, top_k=2, max_nodes=3,
                                          lookup_tokens=3),                        # FLASH tree + lookup path
], ids=["draft_chain", "draft_tree", "prompt_lookup", "flash_lookup"])
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
