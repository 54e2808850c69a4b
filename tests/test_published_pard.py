"""AMD's published PARD drafts (flashmm.drafters.published_pard): tiny transformers causal LMs saved with
save_pretrained plus config.json's ``pard_token``, as AMD-AGI/PARD's pard_train.py saves them. Checked: the
drafting forward against a float64 forward of the saved model on [committed + (K − 1) × pard_token] (what
pard/pard_infer.py feeds), greedy output identical to the target's generate, sampled output against the exact
two-token joint (and a wrong q caught), and the refusals (another tokenizer, pickles, files that do not match
their config, PARD-2)."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import flashmm
from flashmm.config import SamplingParams
from flashmm.drafters import Pard, load
from flashmm.drafters.files import DrafterFileError
from flashmm.drafters.formats import published_format
from flashmm.drafters.published import UnsupportedDrafterFormat
from flashmm.drafters.published_pard import DEFAULT_DEPTH, PublishedPard
from flashmm.sampling import warp_logits
from flashmm.targets import CausalLMTarget

from stats_utils import chi_square_pvalue
from text_models import VOCAB, prompt, tiny_lm


@pytest.fixture(scope="module")
def target():
    return tiny_lm("llama", seed=0)


def save_pard(folder, lm, pard_token: int, **save):
    """``lm`` saved as AMD publishes a PARD draft: save_pretrained (safetensors) with ``pard_token`` in config.json."""
    lm.config.pard_token = pard_token
    lm.save_pretrained(folder, safe_serialization=True, **save)
    return folder


def target_twin(target):
    """The target itself with one more row (VOCAB, its pard_token) beyond the target's vocabulary, whose LM-head
    row is large: drafted at every mask position if rows past the target's vocabulary were not excluded."""
    twin = tiny_lm("llama", seed=0, vocab_size=VOCAB + 1)
    with torch.no_grad():
        for mine, theirs in zip(twin.model.parameters(), target.model.parameters()):
            if mine.shape == theirs.shape:
                mine.copy_(theirs)
        twin.model.embed_tokens.weight[:VOCAB] = target.model.embed_tokens.weight
        twin.lm_head.weight[:VOCAB] = target.lm_head.weight
        twin.lm_head.weight[VOCAB:] = 5 * target.lm_head.weight[:1].abs()
    return twin


@pytest.fixture(scope="module")
def folders(target, tmp_path_factory):
    """name -> (folder, the saved model): the target's twin (pard_token past the target's vocabulary), and an
    unrelated Qwen2 draft with tied embeddings, biases and pard_token inside the vocabulary (as Llama 3's
    reserved ids are), saved in shards with an index."""
    root = tmp_path_factory.mktemp("pard")
    twin = target_twin(target)
    qwen = tiny_lm("qwen2", seed=5, tie_word_embeddings=True)
    return {"twin": (save_pard(root / "twin", twin, VOCAB), twin),
            "qwen2_sharded": (save_pard(root / "qwen2", qwen, 5, max_shard_size="40KB"), qwen)}


@pytest.mark.parametrize("name", ["twin", "qwen2_sharded"])
def test_drafting_logits_equal_a_float64_forward_with_pard_tokens(target, folders, name):
    folder, lm = folders[name]
    if name == "qwen2_sharded":
        assert (folder / "model.safetensors.index.json").is_file()
    assert published_format(folder) == "pard"
    drafter = load(folder)
    assert isinstance(drafter, PublishedPard) and drafter.depth == DEFAULT_DEPTH
    drafter.bind(CausalLMTarget(target))
    pard, k = lm.config.pard_token, 4
    reference = copy.deepcopy(lm).double()
    ids = prompt(9, seed=3)[0].tolist()
    for committed in (ids[:6], ids):  # the second call reuses the cache the first one left
        with torch.no_grad():
            got = drafter.logits_with_masks(committed, k, "cpu")                           # [k, VOCAB]
            want = reference(torch.tensor([committed + [pard] * (k - 1)])).logits[0, -k:]  # [k, rows]
        assert got.shape == (k, VOCAB)
        torch.testing.assert_close(got.double(), want[:, :VOCAB], atol=1e-4, rtol=1e-4)
        assert drafter._cache.get_seq_length() == len(committed)  # the masks left nothing behind


def test_greedy_wrap_is_exact_and_the_twin_drafts_the_targets_tokens(target, folders):
    folder, _ = folders["twin"]
    ids = prompt(8, seed=1)
    want = target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert torch.equal(flashmm.wrap(target, str(folder)).generate(ids, max_new_tokens=16, eos_token_id=[]), want)
    drafter = load(folder, depth=4, max_draft_tokens=4, adaptive=False)
    sm = flashmm.wrap(target, drafter)
    assert torch.equal(sm.generate(ids, max_new_tokens=16, eos_token_id=[]), want)
    assert sm.last_stats.tau >= 2  # the first drafted token is the target's own: every step accepts it
    drafter.reset_cache()
    draft = drafter.propose(ids, 4, SamplingParams(), None)
    drafted = draft.tokens[0, 1:].tolist()
    assert len(drafted) == 4 and max(drafted) < VOCAB  # the large pard row past the target's vocabulary: never
    assert drafted[0] == int(want[0, ids.shape[1]])


V = 8
SAMPLING = dict(do_sample=True, temperature=0.9)
PROMPT = torch.tensor([[3, 7, 3, 7, 3]])
TRIALS = 300


def exact_second_third(target) -> torch.Tensor:
    """Exact joint [V, V] of the 2nd and 3rd new tokens under SAMPLING (float64): the 1st comes from the
    prefill, the 2nd and 3rd are drafted from q_0 and q_1 of one PARD forward."""
    params = SamplingParams(**SAMPLING)

    def probs(ids: torch.Tensor) -> torch.Tensor:  # [B, V] after each row of ids [B, T]
        return warp_logits(target(ids).logits[:, -1].double(), params).softmax(-1)

    joint = torch.zeros(V, V, dtype=torch.float64)
    with torch.no_grad():
        first = probs(PROMPT)[0]
        for a in range(V):
            after_a = torch.cat([PROMPT, torch.tensor([[a]])], dim=1)
            second = probs(after_a)[0]
            third = probs(torch.cat([after_a.expand(V, -1), torch.arange(V)[:, None]], dim=1))  # [b, c]
            joint += first[a] * second[:, None] * third
    return joint


def second_third_histogram(sm) -> torch.Tensor:
    counts, generator = torch.zeros(V, V), torch.Generator().manual_seed(1234)
    for _ in range(TRIALS):
        b, c = sm.generate(PROMPT, max_new_tokens=3, generator=generator, **SAMPLING)[0, -2:].tolist()
        counts[b, c] += 1
    return counts


def test_sampling_is_exact_and_a_wrong_q_is_detected(tmp_path, monkeypatch):
    """New tokens 2 and 3, drafted from q_0 and q_1 of one forward (q_1 at a pard_token position), follow the
    target exactly; verifying the 3rd with q_0 is caught."""
    small = dict(vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = tiny_lm("llama", seed=1, **small)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.15)  # soft: many cells have mass
    draft = tiny_lm("llama", seed=3, **{**small, "vocab_size": V + 1})
    with torch.no_grad():  # a distinctive mask input: q_1 far from q_0 (total variation ~0.7), so the wrong q shows
        draft.model.embed_tokens.weight[V] *= 10
    folder = save_pard(tmp_path / "pard", draft, V)
    sm = flashmm.wrap(target, load(folder, depth=2, max_draft_tokens=2, adaptive=False))
    exact = exact_second_third(target)
    p = chi_square_pvalue(second_third_histogram(sm), exact)
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    original = Pard.propose

    def biased(self, committed, max_tokens, sampling, generator):
        draft = original(self, committed, max_tokens, sampling, generator)
        if draft.q_probs is not None and draft.tree.num_nodes > 2:
            draft.q_probs[0, 1] = draft.q_probs[0, 0]  # claims q_0 for a token drawn from q_1
        return draft

    monkeypatch.setattr(Pard, "propose", biased)
    p = chi_square_pvalue(second_third_histogram(sm), exact)
    assert p < 1e-3, f"verifying with the wrong position's q must bias the output (p = {p:.2e})"


@pytest.mark.parametrize("change, named", [
    (dict(vocab_size=4096), ["4096", str(VOCAB)]),
    (dict(eos_token_id=7), ["eos_token_id 7 vs 2"]),
])
def test_a_draft_with_another_tokenizer_is_refused(target, tmp_path, change, named):
    folder = save_pard(tmp_path / "other", tiny_lm("llama", seed=1, **change), 3)
    with pytest.raises(ValueError) as err:
        flashmm.wrap(target, str(folder))
    message = str(err.value)
    assert str(folder) in message and "tokenizer" in message and all(n in message for n in named), message


class NotATensor:
    """A class a pickle would have to import and build: weights_only loading refuses it."""


def test_weights_that_do_not_match_or_are_not_tensors_are_refused(tmp_path, folders):
    source, lm = folders["twin"]
    state = load_file(source / "model.safetensors")

    def folder_with(name: str, config: dict | None = None):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config or json.loads((source / "config.json").read_text())))
        return path

    plain = folder_with("bin")  # plain tensors in a pytorch_model.bin load
    torch.save(state, plain / "pytorch_model.bin")
    assert isinstance(load(plain), PublishedPard)
    pickled = folder_with("pickled")
    torch.save({**state, "lm_head.weight": NotATensor()}, pickled / "pytorch_model.bin")
    with pytest.raises(DrafterFileError, match="weights_only"):
        load(pickled)
    for name, tensors, words in [
        ("missing", {k: v for k, v in state.items() if k != "model.norm.weight"}, "missing ['model.norm.weight']"),
        ("unexpected", {**state, "model.extra.weight": torch.zeros(2)}, "unexpected ['model.extra.weight']"),
    ]:
        path = folder_with(name)
        save_file(tensors, str(path / "model.safetensors"))
        with pytest.raises(DrafterFileError, match=words.replace("[", r"\[")) as err:
            load(path)
        assert str(path / "model.safetensors") in str(err.value)
    config = json.loads((source / "config.json").read_text())
    for name, changes, error, words in [
        ("pard2", dict(spd_type="pard2", pard2=True), UnsupportedDrafterFormat, "target_proj"),
        ("text_token", dict(pard_token="<pard>"), DrafterFileError, "'pard_token' should be an integer"),
        ("beyond", dict(pard_token=VOCAB + 1), DrafterFileError, "not a row"),
    ]:
        path = folder_with(name, {**config, **changes})
        save_file(state, str(path / "model.safetensors"))
        with pytest.raises(error, match=words) as err:
            load(path)
        assert str(path / "config.json") in str(err.value)
