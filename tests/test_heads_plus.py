"""MTP trees and Hydra++'s prefix attention (issue 20).

MTP trees: every node's children equal the ranked tokens of a plain causal forward of modules
1..j+1 over the committed text followed by that node's own path (the chain computation with the
node's path as the chain), and greedy decoding stays token-identical to model.generate.
Hydra++: the prefix layer's cached output at every position equals transformers' own
LlamaDecoderLayer run over the whole prefix at once; decoding is exact; folders round-trip and the
shipped plain-Hydra folder still loads as plain Hydra."""
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import flashmm
from flashmm.drafters import MTP, Hydra, load
from flashmm.drafters.base import SequenceStart, StepResult
from flashmm.drafters.head_base import save_heads
from flashmm.sampling import SamplingParams
from flashmm.train import head_replay as R
from flashmm.train import heads as H

from test_heads import corpus, tools  # noqa: F401 (fixture)
from text_models import chat_prompt, prompt

BRANCHY = [[0.6, 0.3, 0.2, 0.1]] * 3          # an accuracy table whose tree branches at every depth


@pytest.fixture(scope="module")
def trained_plus(corpus):  # noqa: F811 (fixture)
    """Tiny MTP modules and Hydra++ heads (distill objective + prefix layer), briefly trained."""
    target, data, held = corpus
    lm, embeds, vocab = tools(target)
    torch.manual_seed(0)
    mtp = H.build_heads("mtp", target.config, 3, 96)
    H.train_heads(mtp, data, lm, embeds, vocab, steps=30, batch=4, lr=3e-3, loss_vocab="reduced", log=lambda m: None)
    torch.manual_seed(0)
    hydra_pp = H.build_heads("hydra", target.config, 3, 96, prefix_layer=True)
    before = H.head_accuracy(hydra_pp, held, lm, embeds, vocab, ranks=4)
    H.train_heads(hydra_pp, data, lm, embeds, vocab, steps=60, batch=64, lr=1e-2, loss_vocab="reduced",
                  objective="distill", log=lambda m: None)
    after = H.head_accuracy(hydra_pp, held, lm, embeds, vocab, ranks=4)
    return {"mtp": mtp, "hydra_pp": hydra_pp, "hydra_pp_accuracy": (before, after)}


def node_path(tree, node):
    """Drafted nodes from the root's first child down to ``node``."""
    out = []
    while node:
        out.append(node)
        node = int(tree.parents[node])
    return out[::-1]


def test_mtp_tree_children_follow_each_nodes_own_path(corpus, trained_plus):  # noqa: F811
    target, data, _ = corpus
    modules = trained_plus["mtp"]
    drafter = MTP(modules, adaptive=False, accuracy=BRANCHY, tree="static", max_draft_tokens=14)
    drafter.bind(R.ModelFacts(target))
    _, embeds, _ = tools(target)
    lm = target.get_output_embeddings().weight.detach()
    a = int(data.starts[1])
    ids, h = data.ids[a:a + 30], data.hidden[a:a + 30].float()
    drafter.begin(SequenceStart(input_ids=ids[None, :11], hidden_states=h[None, :11]))
    drafter.observe(StepResult(committed=ids[None, :14], accepted_len=2, path=torch.tensor([[0, 1, 2]]),
                               hidden_states=h[None, 11:14]))
    root = 13
    draft = drafter.propose(ids[None, :root + 1], 16, SamplingParams(), None)
    tree, tokens = draft.tree, draft.tokens[0].tolist()
    assert tree.num_nodes == 15 and tree.max_depth == 3
    branching = [n for n in range(1, tree.num_nodes) if len(tree.children[n]) > 1]
    assert branching, "the tree must branch below the root for this test to mean anything"
    checked = 0
    with torch.no_grad():
        for node in range(tree.num_nodes):
            if not tree.children[node]:
                continue
            path = [tokens[n] for n in node_path(tree, node)]
            text = ids[:root + 1].tolist() + path
            prev = h[None, :root]                                              # h^0 at positions 0..R-1
            for k in range(len(path) + 1):                                     # modules 1..j+1, full causal forwards
                prev, _ = modules.run(k, prev, embeds[torch.tensor(text[k + 1:k + 1 + root])][None])
            ranked = (modules.output(len(path), prev[0, -1]) @ lm.T).topk(4).indices.tolist()
            for child in tree.children[node]:
                assert tokens[child] == ranked[int(tree.ranks[child])], (node, child)
                checked += 1
    assert checked == tree.num_nodes - 1


def test_mtp_catches_up_after_steps_without_drafts(corpus, trained_plus, monkeypatch):  # noqa: F811
    """Steps that draft nothing skip the modules' upkeep; the next drafting step catches every module
    up in one run and drafts what a drafter that kept up step by step drafts."""
    target, data, _ = corpus
    a = int(data.starts[1])
    ids, h = data.ids[a:a + 30], data.hidden[a:a + 30].float()

    def drafts(skip_first: bool):
        drafter = MTP(trained_plus["mtp"], adaptive=False, accuracy=BRANCHY, tree="static", max_draft_tokens=6)
        drafter.bind(R.ModelFacts(target))
        drafter.begin(SequenceStart(input_ids=ids[None, :11], hidden_states=h[None, :11]))
        planned = drafter.planned_tree
        if skip_first:
            monkeypatch.setattr(drafter, "planned_tree", lambda n: None)
        first = drafter.propose(ids[None, :11], 8, SamplingParams(), None)
        monkeypatch.setattr(drafter, "planned_tree", planned)
        fed = list(drafter._fed)
        drafter.observe(StepResult(committed=ids[None, :14], accepted_len=2, path=torch.tensor([[0, 1, 2]]),
                                   hidden_states=h[None, 11:14]))
        second = drafter.propose(ids[None, :14], 8, SamplingParams(), None)
        return first, fed, second

    skipped, fed, caught_up = drafts(skip_first=True)
    assert skipped.tree.num_nodes == 1 and fed == [0, 0, 0]  # no draft, no module ran
    _, _, kept_up = drafts(skip_first=False)
    assert caught_up.tokens.tolist() == kept_up.tokens.tolist()


@pytest.mark.parametrize("shape", [{"tree": "chain"}, {"tree": "static", "max_draft_tokens": 6},
                                   {"tree": "static", "max_draft_tokens": 14}])
def test_mtp_tree_greedy_identical_to_generate(corpus, trained_plus, shape):  # noqa: F811
    target, data, _ = corpus
    for s in range(3):
        ids = data.ids[int(data.starts[s]):int(data.starts[s]) + 8][None]
        sm = flashmm.wrap(target, MTP(trained_plus["mtp"], adaptive=False, accuracy=BRANCHY, **shape))
        out = sm.generate(ids, max_new_tokens=30, eos_token_id=[])
        assert torch.equal(out, target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None))
    assert sm.last_stats.tau > 1.1
    ids = prompt(2, seed=5)  # a prompt shorter than the tree's depth: drafting waits until the text is long enough
    out = flashmm.wrap(target, MTP(trained_plus["mtp"], adaptive=False, accuracy=BRANCHY, **shape)) \
        .generate(ids, max_new_tokens=10, eos_token_id=[])
    assert torch.equal(out, target.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None))


def test_prefix_layer_cache_equals_a_whole_prefix_forward_of_llamas_layer(corpus, trained_plus):  # noqa: F811
    """After begin and every observe, the feature is transformers' LlamaDecoderLayer (same weights)
    over all target states so far, taken at the last position."""
    target, data, _ = corpus
    heads = trained_plus["hydra_pp"]
    cfg = LlamaConfig(hidden_size=heads.hidden_size, intermediate_size=heads.prefix_config["intermediate_size"],
                      num_attention_heads=heads.prefix_config["num_attention_heads"],
                      num_key_value_heads=heads.prefix_config["num_key_value_heads"],
                      rms_norm_eps=heads.prefix_config["rms_norm_eps"],
                      rope_parameters={"rope_type": "default", "rope_theta": heads.prefix_config["rope_theta"]})
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0).eval()
    layer.load_state_dict(heads.prefix_layer.block.state_dict())
    rope = LlamaRotaryEmbedding(cfg)
    drafter = Hydra(heads, adaptive=False)
    drafter.bind(R.ModelFacts(target))
    a = int(data.starts[2])
    h = data.hidden[a:a + 30].float()
    drafter.begin(SequenceStart(input_ids=data.ids[None, a:a + 9], hidden_states=h[None, :9]))
    fed, seen = 9, []
    for accepted in (0, 3, 1, 2, 0, 4):
        drafter.observe(StepResult(committed=data.ids[None, a:a + fed + accepted + 1], accepted_len=accepted,
                                   path=torch.arange(accepted + 1)[None], hidden_states=h[None, fed:fed + accepted + 1]))
        fed += accepted + 1
        seen.append((fed, drafter._feature.clone()))
    with torch.no_grad():
        for length, feature in seen:
            x = h[None, :length]
            positions = torch.arange(length)[None]
            out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope(x, positions))
            out = out[0] if isinstance(out, tuple) else out
            torch.testing.assert_close(feature, out[0, -1], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(seen[-1][1], h[fed - 1], atol=1e-3)  # trained: the layer is not the identity


def test_hydra_pp_trains_and_decodes_exactly(corpus, trained_plus):  # noqa: F811
    target, data, _ = corpus
    before, after = trained_plus["hydra_pp_accuracy"]
    assert after[0][0] > before[0][0] + 0.05 and after[0][0] > 0.1, (before[0][0], after[0][0])
    heads = trained_plus["hydra_pp"]
    for shape in ({"tree": "chain"}, {"tree": "static", "max_draft_tokens": 8}):
        for s in range(2):
            ids = data.ids[int(data.starts[s]):int(data.starts[s]) + 8][None]
            sm = flashmm.wrap(target, Hydra(heads, adaptive=False, accuracy=after, **shape))
            out = sm.generate(ids, max_new_tokens=30, eos_token_id=[])
            assert torch.equal(out, target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None))
            # the offline replay (no target forward) reproduces the engine's steps exactly
            one = H.HeadData(**{k: getattr(data, k) for k in ("hidden", "ids", "topk_ids", "topk_logits", "lse")},
                             starts=data.starts[s:s + 2], prompt_lens=data.prompt_lens[s:s + 1])
            replay = Hydra(heads, adaptive=False, accuracy=after, **shape)
            replay.bind(R.ModelFacts(target))
            got = R.replay_tau(replay, one, max_new_tokens=30)
            assert got["steps"] == sm.last_stats.verify_steps and got["tau"] == pytest.approx(sm.last_stats.tau)
    ids = torch.cat([prompt(10, seed=1), prompt(10, seed=2)])
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = flashmm.wrap(target, Hydra(heads, adaptive=False, accuracy=after, tree="static", max_draft_tokens=8)).generate(
        ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[], pad_token_id=0)
    assert torch.equal(out, ref)


def test_hydra_pp_folder_round_trip(tmp_path, corpus, trained_plus):  # noqa: F811
    target, data, _ = corpus
    heads = trained_plus["hydra_pp"]
    save_heads(tmp_path / "pp", "hydra", heads, heads.config(), None,
               {"method": "hydra", "target": {"vocab_size": 128}, "drafting": {"tree": "static", "max_draft_tokens": 6}})
    drafter = load(tmp_path / "pp", adaptive=False)
    assert isinstance(drafter, Hydra) and drafter.heads.prefix_layer is not None and drafter.max_draft_tokens == 6
    saved = {k: v.half().float() for k, v in heads.state_dict().items()}  # the folder holds fp16
    for name, value in drafter.heads.state_dict().items():
        assert torch.equal(value, saved[name]), name
    ids = data.ids[:8][None]
    out = flashmm.wrap(target, drafter).generate(ids, max_new_tokens=20, eos_token_id=[])
    assert torch.equal(out, target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))


SHIPPED = Path(__file__).resolve().parents[1] / "assets/text_drafters/smollm2"


@pytest.mark.parametrize("name,options", [("mtp", {}), ("mtp", {"tree": "chain"}), ("hydra", {}),
                                          ("hydra_pp", {})])
def test_shipped_folders_on_smollm2(request, name, options):
    """The shipped MTP folder drafts its 16-node tree by default and chains on request; the plain
    Hydra folder loads without a prefix layer, Hydra++ with one; all exact."""
    if not (SHIPPED / name / "drafter.json").exists():
        pytest.skip(f"{name} is not built (its drafter.json command: python -m flashmm.train ...)")
    model, tokenizer = request.getfixturevalue("smollm2")
    drafter = load(SHIPPED / name, adaptive=False, **options)
    if name == "mtp":
        assert drafter.tree == options.get("tree", drafter.info["drafting"]["tree"])
    else:
        assert (drafter.heads.prefix_layer is not None) == (name == "hydra_pp")
    ids = chat_prompt(tokenizer, "List three primary colours.")
    sm = flashmm.wrap(model, drafter)
    out = sm.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, model.generate(ids, max_new_tokens=24, do_sample=False))
    assert sm.last_stats.accepted_tokens > 0  # drafts get accepted (the accepted paths are exercised)
