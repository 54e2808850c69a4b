"""Hydra's published MLP heads (zankner/Hydra's layout, flashmm.drafters.published_hydra): tiny random checkpoints
saved as Hydra's train.py saves them (``torch.save(HydraMLP.state_dict())`` beside HydraConfig's config.json),
checked against a float64 forward written here from hydra/model/hydra_heads/mlp_head.py, greedy output identical
to the target's own generate (one row and a ragged batch), sampled output keeping the target's distribution
(χ², the lossy typical verifier failing the same test), and the variants flashmm does not run refused."""
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import flashmm
from flashmm.config import SamplingParams
from flashmm.drafters import load
from flashmm.drafters.base import SequenceStart
from flashmm.drafters.files import DrafterFileError
from flashmm.drafters.formats import published_format
from flashmm.drafters.published import UnsupportedDrafterFormat
from flashmm.drafters.published_hydra import PublishedHydra
from flashmm.sampling import warp_logits
from flashmm.targets import CausalLMTarget

from stats_utils import chi_square_pvalue
from text_models import assert_decodes_as_generate, tiny_lm

D, V = 64, 128


@pytest.fixture(scope="module")
def target():
    """tests/test_published_layouts.py's target: the verify cost the first wrap times is cached for both."""
    return tiny_lm("llama", num_hidden_layers=7)


class ResBlock(nn.Module):
    """mlp_head.py's ResBlock: res_connection(x) + SiLU(linear(x)); res_connection a Linear when x is wider."""

    def __init__(self, d: int, num_condition: int = 0):
        super().__init__()
        self.linear = nn.Linear(d * (num_condition + 1), d)
        self.res_connection = nn.Linear(d * (num_condition + 1), d) if num_condition else nn.Identity()


class HydraMLPModules(nn.Module):
    """The modules of mlp_head.py's HydraMLP, under its attribute names, with its ``[ResBlock(d)] * n`` (one
    block repeated) and the embedding module it is handed (registered, so saved)."""

    def __init__(self, heads: int, layers: int, grounded: bool, embedding: torch.Tensor, vocab: int):
        super().__init__()
        d = embedding.shape[1]
        if grounded:
            self.hydra_mlp = nn.ModuleList(nn.Sequential(ResBlock(d, k + 1), *([ResBlock(d)] * (layers - 1)))
                                           for k in range(heads))
        else:
            self.hydra_mlp = nn.ModuleList(nn.Sequential(*([ResBlock(d)] * layers)) for _ in range(heads))
        self.hydra_lm_head = nn.ModuleList(nn.Linear(d, vocab) for _ in range(heads))
        self.input_embed_fn = nn.Embedding.from_pretrained(embedding.clone())


def hydra_state(target, heads: int, layers: int, grounded: bool, seed: int, scale: float = 0.15):
    """HydraMLP.state_dict() with random weights (Hydra zero-initialises ``linear``: randomised here so every
    part of the head shows in its output)."""
    torch.manual_seed(seed)
    embedding = target.get_input_embeddings().weight.detach()
    modules = HydraMLPModules(heads, layers, grounded, embedding, embedding.shape[0])
    with torch.no_grad():
        for name, p in modules.named_parameters():
            if not name.startswith("input_embed_fn"):
                p.normal_(0.0, 0.6 if name.startswith("hydra_lm_head") else scale)
    return {k: v.detach().clone() for k, v in modules.state_dict().items()}


def write_hydra(folder, state, heads: int, layers: int, grounded: bool, safetensors: bool = False, **changes):
    """As train.py writes a run: HydraConfig.save_pretrained's config.json and hydra_lm_head.pt; with
    ``safetensors``, a conversion to hydra_lm_head.safetensors that kept one copy of each repeated block."""
    folder.mkdir(parents=True)
    config = {"hydra_num_heads": heads, "hydra_num_layers": layers, "hydra_head_arch": "mlp",
              "base_model_name_or_path": "tiny-llama", "grounded_heads": grounded, "hidden_state_offset": 0,
              "transformers_version": "4.35.2", **changes}
    (folder / "config.json").write_text(json.dumps(config))
    if safetensors:
        first = 1 if grounded else 0
        kept = {k: v.contiguous() for k, v in state.items()
                if not (k.startswith("hydra_mlp.") and int(k.split(".")[2]) > first)}
        save_file(kept, str(folder / "hydra_lm_head.safetensors"))
    else:
        torch.save(state, folder / "hydra_lm_head.pt")
    return folder


def hydra_reference(state, k: int, layers: int, grounded: bool, h, path_embeds) -> torch.Tensor:
    """float64 logits [V] of head k (0-based) at h [D], after the root and the drafted tokens path_embeds
    [k + 1, D] (root first), as HydraMLP computes them: ``forward``'s head input cat(h, E(x_{t+1}) ..
    E(x_{t+k+1})), its Sequential of ResBlocks (each key of the state its own), its biased LM head."""
    s = {key: v.double() for key, v in state.items()}

    def res_block(x, prefix):
        a = x @ s[f"{prefix}.linear.weight"].T + s[f"{prefix}.linear.bias"]
        skip = x @ s[f"{prefix}.res_connection.weight"].T + s[f"{prefix}.res_connection.bias"] \
            if f"{prefix}.res_connection.weight" in s else x
        return skip + a * torch.sigmoid(a)

    x = torch.cat([h.double(), path_embeds.double().flatten()]) if grounded else h.double()
    for j in range(layers):
        x = res_block(x, f"hydra_mlp.{k}.{j}")
    return x @ s[f"hydra_lm_head.{k}.weight"].T + s[f"hydra_lm_head.{k}.bias"]


CASES = {  # name: (heads, layers, grounded, safetensors)
    "grounded": (3, 1, True, False),
    "grounded_deep_safetensors": (3, 3, True, True),
    "ungrounded": (2, 2, False, False),
}


@pytest.fixture(scope="module")
def folders(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("hydra")
    out = {}
    for i, (name, (heads, layers, grounded, st)) in enumerate(CASES.items()):
        state = hydra_state(target, heads, layers, grounded, seed=20 + i)
        out[name] = (write_hydra(root / name, state, heads, layers, grounded, safetensors=st), state)
    return out


def final_states(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's final normed states [1, T, D] (what Hydra's heads read: LlamaModel's outputs[0])."""
    with torch.no_grad():
        return target(ids, output_hidden_states=True).hidden_states[-1]


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_chain_equal_a_float64_forward(target, folders, name):
    """Every head's logits on a random path, and a drafted chain (each head on the path its predecessors drew)."""
    folder, state = folders[name]
    heads, layers, grounded, _ = CASES[name]
    assert published_format(folder) == "hydra"
    drafter = load(folder, tree="chain", adaptive=False)
    assert isinstance(drafter, PublishedHydra) and drafter.heads.num_heads == heads
    drafter.bind(CausalLMTarget(target))
    table = target.get_input_embeddings().weight.detach()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (1, 9), generator=g)
    h = final_states(target, ids)[0, -1]
    path = torch.randint(3, V, (heads,), generator=g)
    with torch.no_grad():
        for k in range(heads):
            want = hydra_reference(state, k, layers, grounded, h, table[path[:k + 1]])
            got = drafter.heads.head_logits(k, drafter.heads.head(k, h, table[path[:k + 1]]))
            torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)
    root = int(path[0])
    chain = [root]
    for k in range(heads):
        chain.append(int(hydra_reference(state, k, layers, grounded, h, table[torch.tensor(chain)]).argmax()))
    drafter.begin(SequenceStart(input_ids=ids, hidden_states=final_states(target, ids)))
    draft = drafter.propose(torch.cat([ids, torch.tensor([[root]])], 1), heads, SamplingParams(), None)
    assert draft.tokens[0].tolist() == chain


@pytest.mark.parametrize("name", ["grounded", "ungrounded"])
def test_wrap_generates_exactly(target, folders, name):
    folder, _ = folders[name]
    assert_decodes_as_generate(target, folder, load(folder, tree="static", max_draft_tokens=6, adaptive=False), V,
                               seed=4, padding=3)


SMALL_V = 8
SAMPLING = dict(do_sample=True, temperature=0.9)
PROMPT = torch.tensor([[3, 7, 3, 7, 3]])
TRIALS = 150


def exact_second_third(target) -> torch.Tensor:
    """Exact joint [SMALL_V * SMALL_V] of the 2nd and 3rd new tokens under SAMPLING (float64): the 1st comes
    from the prefill (the root), the 2nd and 3rd are drafted by heads 0 and 1 and verified."""
    params = SamplingParams(**SAMPLING)

    def probs(ids: torch.Tensor) -> torch.Tensor:  # [B, V] after each row of ids [B, T]
        return warp_logits(target(ids).logits[:, -1].double(), params).softmax(-1)

    joint = torch.zeros(SMALL_V, SMALL_V, dtype=torch.float64)
    with torch.no_grad():
        first = probs(PROMPT)[0]
        for a in range(SMALL_V):
            after_a = torch.cat([PROMPT, torch.tensor([[a]])], dim=1)
            second = probs(after_a)[0]
            third = probs(torch.cat([after_a.expand(SMALL_V, -1), torch.arange(SMALL_V)[:, None]], dim=1))
            joint += first[a] * second[:, None] * third
    return joint.flatten()


def second_third_histogram(sm) -> torch.Tensor:
    counts, generator = torch.zeros(SMALL_V, SMALL_V), torch.Generator().manual_seed(1234)
    for _ in range(TRIALS):
        b, c = sm.generate(PROMPT, max_new_tokens=3, generator=generator, **SAMPLING)[0, -2:].tolist()
        counts[b, c] += 1
    return counts.flatten()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(a target of SMALL_V tokens, the folder of grounded Hydra heads for it): its drafts are often right. The
    config of tests/test_published_pard.py's and test_eagle12.py's sampling targets: one verify cost timing."""
    target = tiny_lm("llama", seed=1, vocab_size=SMALL_V, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        # soft enough that drafts are often rejected, sharp enough that 150 trials leave 7 cells of >= 5
        # expected counts (χ² pools the rest)
        target.get_output_embeddings().weight.mul_(0.5)
    state = hydra_state(target, 2, 1, True, seed=5)
    return target, write_hydra(tmp_path_factory.mktemp("small") / "hydra", state, 2, 1, True)


def test_greedy_decoding_through_accepted_drafts_is_exact(small):
    """Heads over 8 tokens are often right: steps after accepted nodes read those nodes' states."""
    target, folder = small
    ids = torch.tensor([[3, 7, 3, 7, 3], [0, 0, 5, 1, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    want = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    sm = flashmm.wrap(target, load(folder, tree="static", max_draft_tokens=4, adaptive=False))
    one = target.generate(ids[:1], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(sm.generate(ids[:1], max_new_tokens=24, eos_token_id=[], pad_token_id=0), one)
    assert sm.last_stats.accepted_tokens > 0
    assert torch.equal(sm.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[], pad_token_id=0),
                       want)
    assert sm.last_stats.accepted_tokens > 0


def test_sampling_keeps_the_targets_distribution_and_typical_acceptance_does_not(small):
    """Tokens 2 and 3, drafted by grounded heads 0 and 1 and verified by rejection sampling, follow the target
    exactly; Hydra's own typical acceptance (``typical_lossy``) is caught by the same test."""
    target, folder = small
    exact = exact_second_third(target)
    sm = flashmm.wrap(target, load(folder, tree="chain", adaptive=False))
    p = chi_square_pvalue(second_third_histogram(sm), exact)
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    assert sm.last_stats.drafted_tokens > 0
    lossy = flashmm.wrap(target, load(folder, tree="chain", adaptive=False), verifier="typical_lossy",
                         typical_epsilon=0.05, typical_delta=0.05)
    p = chi_square_pvalue(second_third_histogram(lossy), exact)
    assert p < 1e-3, f"typical acceptance must bias the output (p = {p:.2e})"


def test_a_target_of_another_width_or_vocabulary_is_refused(folders):
    folder, _ = folders["grounded"]
    with pytest.raises(ValueError) as err:
        flashmm.wrap(tiny_lm("llama", vocab_size=256), str(folder))
    assert str(folder) in str(err.value) and "vocabulary: drafter 128, target 256" in str(err.value)
    with pytest.raises(ValueError) as err:
        flashmm.wrap(tiny_lm("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1), str(folder))
    assert str(folder) in str(err.value) and "hidden size: drafter 64, target 32" in str(err.value)


class NotATensor:
    """A class a pickle would have to import and build: weights_only loading refuses it."""


def test_variants_and_malformed_files_are_refused_naming_the_file(tmp_path, target, folders):
    _, state = folders["grounded"]
    offset = write_hydra(tmp_path / "offset", state, 3, 1, True, hidden_state_offset=1)
    with pytest.raises(UnsupportedDrafterFormat, match="hidden_state_offset 1") as err:
        load(offset)
    assert str(offset / "config.json") in str(err.value)
    more = write_hydra(tmp_path / "more", state, 4, 1, True)
    with pytest.raises(DrafterFileError, match=r"holds 3 heads .*config.json names 4") as err:
        load(more)
    assert str(more / "hydra_lm_head.pt") in str(err.value)
    fewer = load(write_hydra(tmp_path / "fewer", state, 2, 1, True))  # from_pretrained builds the config's K
    assert fewer.heads.num_heads == 2
    ungrounded = write_hydra(tmp_path / "ungrounded", state, 3, 1, False)
    with pytest.raises(DrafterFileError, match=r"unexpected \['hydra_mlp.0.0.res_connection.bias'"):
        load(ungrounded)
    deep = hydra_state(target, 2, 3, True, seed=9)
    deep["hydra_mlp.1.2.linear.weight"] = deep["hydra_mlp.1.2.linear.weight"] + 1.0
    differ = r"head 1's square ResBlocks differ \(hydra_mlp.1.1.linear.weight, hydra_mlp.1.2.linear.weight\)"
    with pytest.raises(UnsupportedDrafterFormat, match=differ):
        load(write_hydra(tmp_path / "differ", deep, 2, 3, True))
    pickled = write_hydra(tmp_path / "pickled", state, 3, 1, True)
    torch.save({"hydra_lm_head.0.weight": NotATensor()}, pickled / "hydra_lm_head.pt")
    with pytest.raises(DrafterFileError, match="weights_only"):
        load(pickled)
