"""The target protocol keeps a sequence's state in the SequenceCache its prefill returns, not on the target:
two sequences decoded through one target with their steps interleaved each equal the model's own greedy
generate, and a generate call leaves no cache on the target."""
import warnings

import pytest
import torch
from transformers import DynamicCache

import flashmm
from flashmm.targets import make_target
from flashmm.tree.token_tree import TokenTree
from test_hybrid import HYBRIDS
from text_models import prompt, tiny_causal_lm, tiny_lm

NEW = 6


def interleaved_greedy(target, prompts: list[torch.Tensor]) -> list[list[int]]:
    """Greedy decoding of every prompt through one target, one token per step, the sequences' steps taken in
    turn: prefill all, then step each sequence once per round (a chain of its root, then the root kept)."""
    seqs, tokens = [], []
    with torch.no_grad():
        for ids in prompts:
            out, seq = target.prefill(ids, None, False)
            seqs.append(seq)
            tokens.append([int(out.logits[0, -1].argmax())])
        for _ in range(NEW - 1):
            for seq, emitted in zip(seqs, tokens):
                prefix = seq.length
                root = torch.tensor([[emitted[-1]]])
                logits = target.forward_tree(seq, root, TokenTree.chain(0), False).logits
                target.commit(seq, torch.zeros(1, 1, dtype=torch.long), prefix)
                emitted.append(int(logits[0, -1].argmax()))
    return tokens


def own_greedy(model, ids: torch.Tensor) -> list[int]:
    out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kind", ["llama", "mamba2"])
def test_interleaved_sequences_each_equal_generate(kind):
    if kind == "llama":
        model = tiny_lm("llama")
    else:
        model = tiny_causal_lm(kind, **HYBRIDS[kind])
    model.generation_config.eos_token_id = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = make_target(model)
    prompts = [prompt(9, seed=1), prompt(14, seed=2), prompt(5, seed=3)]
    got = interleaved_greedy(target, prompts)
    assert got == [own_greedy(model, ids) for ids in prompts]


def test_generate_leaves_no_cache_on_the_target():
    model = tiny_lm("llama")
    sm = flashmm.wrap(model, "prompt_lookup")
    sm.generate(prompt(12, seed=4), max_new_tokens=8, do_sample=False)
    kept = {name: type(value).__name__ for name, value in vars(sm.target).items()
            if isinstance(value, DynamicCache) or type(value).__name__.endswith(("Cache", "Verification"))}
    assert kept == {}
