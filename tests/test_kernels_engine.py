"""The whole engine on the Triton path (tree attention + kernel verification + KV compaction).

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest), so this is the same code a
GPU runs, checked against the model's own generate; on a CUDA machine the models move to the GPU
and the compiled kernels run.
"""
import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel

from text_models import prompt, tiny_lm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_triton_path_greedy_exact(arch):
    target = tiny_lm(arch).to(DEVICE)
    previous = target.config._attn_implementation
    ids = prompt(30, seed=4).to(DEVICE)
    sm = flashmm.wrap(target, DraftModel(target, max_draft_tokens=6, tree_width=2, adaptive=False),
                      attention="triton")
    assert sm.target.backend == "triton"
    out = sm.generate(ids, max_new_tokens=10)
    assert target.config._attn_implementation == previous  # the user's model is given back unchanged
    assert torch.equal(out, target.generate(ids, max_new_tokens=10, do_sample=False))
    assert sm.last_stats.tau > 2


def test_triton_path_sampling_runs_the_kernel_verifier():
    target = tiny_lm("llama").to(DEVICE)
    ids = prompt(12, seed=5).to(DEVICE)
    sm = flashmm.wrap(target, DraftModel(tiny_lm("llama", seed=9).to(DEVICE), max_draft_tokens=8, tree_width=2,
                                         adaptive=False), attention="triton")
    out = sm.generate(ids, max_new_tokens=6, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 18)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU default")
def test_auto_is_torch_on_cpu():
    assert flashmm.wrap(tiny_lm("llama"), "prompt_lookup").target.backend == "torch"
