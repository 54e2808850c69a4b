"""Drafting options have one spelling per meaning: the old spellings of the draft size are refused
wherever a user can give them (flashmm.wrap, flashmm.drafters.load, a registered name, a drafter.json
section), each error naming the old option and its new name."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import flashmm
from flashmm.drafters import DrafterFileError, load, make_drafter
from flashmm.drafters.files import RENAMED_OPTIONS, check_section
from flashmm.drafters.head_base import save_heads
from flashmm.drafters.nets.medusa_net import MedusaHeads


@pytest.mark.parametrize("old,new", [("max_nodes", "max_draft_tokens"), ("tree_nodes", "tree='static'"),
                                     ("max_lookup_tokens", "lookup_tokens"), ("max_first_tokens", "first_tokens"),
                                     ("budget", "pricing")])
def test_wrap_refuses_old_spellings(old, new):
    with pytest.raises(TypeError, match=f"flashmm.wrap: option '{old}' was renamed: use {new}"):
        flashmm.wrap(torch.nn.Linear(2, 2), "prompt_lookup", **{old: 4})


def test_load_refuses_old_spellings_before_reading_the_folder(tmp_path):
    with pytest.raises(TypeError, match=r"drafters.load\(.*\): option 'max_nodes' was renamed: use max_draft_tokens"):
        load(tmp_path, max_nodes=4)


def test_registered_name_refuses_old_spellings():
    with pytest.raises(TypeError, match="'vertical_cascade': option 'max_lookup_tokens' was renamed: use lookup_"):
        make_drafter("vertical_cascade", max_lookup_tokens=4)


def test_drafter_json_with_an_old_spelling_is_refused_naming_the_file(tmp_path):
    heads = MedusaHeads(8, 2)
    folder = save_heads(tmp_path / "medusa", "medusa", heads, heads.config(), None,
                        {"method": "medusa", "target": "tiny", "drafting": {"tree_nodes": 4}})
    with pytest.raises(DrafterFileError, match=r"drafter.json: 'drafting': option 'tree_nodes' was renamed: use "
                                               r"tree='static' with max_draft_tokens=N"):
        load(folder)
    info = json.loads((folder / "drafter.json").read_text())
    info["drafting"] = {"tree": "static", "max_draft_tokens": 4}
    (folder / "drafter.json").write_text(json.dumps(info))
    drafter = load(folder)
    assert (drafter.tree, drafter.max_draft_tokens) == ("static", 4)


def test_budget_is_refused_naming_pricing_where_it_was_an_option():
    """``budget`` ("auto" / "constants"; FLASH's "fixed" / "auto") is now ``pricing`` ("measured" / "constants";
    FLASH's "none" / "measured"): the old name is refused, naming the new one and its values, by every drafter
    that took it; the old values under the new name are refused naming their new spelling."""
    from flashmm.drafters import DraftModel, FlashDrafter
    from flashmm.drafters.cascade import HorizontalCascade, VerticalCascade
    from text_models import tiny_lm

    lm = tiny_lm("llama", seed=0)
    renamed = r"option 'budget' was renamed: use pricing \(budget='auto' is pricing='measured', 'constants' stays"
    with pytest.raises(TypeError, match=f"flashmm.wrap: {renamed}"):
        flashmm.wrap(lm, DraftModel(lm), budget="auto")
    for make, owner in ((lambda **o: DraftModel(lm, **o), "DraftModel"),
                        (lambda **o: VerticalCascade(DraftModel(lm), **o), "VerticalCascade"),
                        (lambda **o: HorizontalCascade(DraftModel(lm), **o), "HorizontalCascade"),
                        (lambda **o: FlashDrafter(None, **o), "FlashDrafter")):
        with pytest.raises(TypeError, match=f"{owner}: {renamed}"):
            make(budget="constants")
    with pytest.raises(TypeError, match="FlashDrafter: option 'budget' was renamed: .*FLASH's budget='fixed' is "
                                        "pricing='none'"):
        FlashDrafter(None, budget="fixed")
    with pytest.raises(ValueError, match=r"pricing must be one of \['measured', 'constants'\], got 'auto' "
                                         r"\(budget='auto' is now pricing='measured'\)"):
        DraftModel(lm, pricing="auto")
    with pytest.raises(ValueError, match=r"pricing must be one of \['none', 'measured'\], got 'fixed' "
                                         r"\(budget='fixed' is now pricing='none'\)"):
        FlashDrafter(None, pricing="fixed")
    assert DraftModel(lm, pricing="constants").pricing == "constants" and DraftModel(lm).pricing == "measured"
    assert FlashDrafter(None).pricing == "measured" and FlashDrafter(None, pricing="none").pricing == "none"


def test_flash_config_with_budget_is_refused_naming_pricing(tmp_path):
    """A FLASH folder whose flash_config.json 'drafting' section still says ``budget`` is refused, naming the
    file and ``pricing``; the same folder with ``pricing`` loads with it."""
    from flashmm.drafters import FlashDrafter
    from text_models import tiny_lm

    folder = tmp_path / "flash"
    FlashDrafter.from_target(tiny_lm("llama", seed=0), num_queries=4, tokens_per_step=5, seed=0,
                             pricing="measured").save_pretrained(folder)
    config = folder / "flash_config.json"
    meta = json.loads(config.read_text())
    assert meta["drafting"]["pricing"] == "measured" and "budget" not in meta["drafting"]
    meta["drafting"]["budget"] = meta["drafting"].pop("pricing").replace("measured", "auto")
    config.write_text(json.dumps(meta))
    with pytest.raises(DrafterFileError, match=r"flash_config.json: 'drafting': option 'budget' was renamed: use pricing"):
        load(folder)
    with pytest.raises(DrafterFileError, match="option 'budget' was renamed: use pricing"):
        FlashDrafter.from_pretrained(folder)
    meta["drafting"]["pricing"] = "measured" if meta["drafting"].pop("budget") == "auto" else "none"
    config.write_text(json.dumps(meta))
    assert load(folder).pricing == "measured" and load(folder, pricing="none").pricing == "none"


def test_old_spellings_are_refused_even_where_unknown_keys_pass(tmp_path):
    """A section read with unknown_ok (provenance keys let through) must not ignore a renamed option."""
    for old in RENAMED_OPTIONS:
        with pytest.raises(DrafterFileError, match=f"'{old}' was renamed"):
            check_section(tmp_path / "drafter.json", "'options'", {old: 3}, {"max_draft_tokens": int}, unknown_ok=True)


def test_shipped_folders_use_the_new_spellings():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "assets"
    files = sorted(root.rglob("drafter.json")) + sorted(root.rglob("flash_config.json"))
    assert files
    for path in files:
        info = json.loads(path.read_text())
        sections = [info, info.get("drafting", {}), info.get("options", {})]
        used = {key for section in sections if isinstance(section, dict) for key in section}
        assert not used & set(RENAMED_OPTIONS), (path, used & set(RENAMED_OPTIONS))


# ------------------------------------------------------------------ options as frozen dataclasses
def _options_cases():
    from flashmm.drafters import (DFlash, DraftModel, DSpark, Eagle3Drafter, FlashDrafter, Medusa, PEagle, PromptLookup,
                                  SuffixDecoding)
    from flashmm.drafters.cascade import HorizontalCascade, HorizontalCascadeOptions, VerticalCascade, VerticalCascadeOptions
    from flashmm.drafters.dflash import DFlashOptions
    from flashmm.drafters.dflash2 import DFlash2, DFlash2Options
    from flashmm.drafters.nets.dflash2_net import CandidateSelector, DFlash2Net
    from flashmm.drafters.draft_model import DraftModelOptions
    from flashmm.drafters.dspark import DSparkOptions
    from flashmm.drafters.eagle3 import Eagle3Options
    from flashmm.drafters.flash import FlashOptions
    from flashmm.drafters.head_base import HeadOptions
    from flashmm.drafters.kangaroo import Kangaroo, KangarooOptions
    from flashmm.drafters.layerskip import LayerSkip, LayerSkipOptions
    from flashmm.drafters.lookahead import Lookahead, LookaheadOptions
    from flashmm.drafters.native_mtp import NativeMTP, NativeMTPOptions
    from flashmm.drafters.nets.dflash_net import DFlashConfig, DFlashNet
    from flashmm.drafters.nets.dspark_net import DSparkConfig, DSparkNet
    from flashmm.drafters.nets.eagle3_net import Eagle3Config, Eagle3Net
    from flashmm.drafters.nets.peagle_net import PEagleNet
    from flashmm.drafters.peagle import PEagleOptions
    from flashmm.drafters.prompt_lookup import PromptLookupOptions
    from flashmm.drafters.rest import Rest, RestOptions
    from flashmm.drafters.speculators_mtp import SpeculatorsMTP, SpeculatorsMTPOptions, layer_config, read_module
    from flashmm.drafters.suffix import SuffixOptions
    from flashmm.drafters.swift import Swift, SwiftOptions
    from flashmm.drafters.token_recycling import TokenRecycling, TokenRecyclingOptions
    from text_models import tiny_lm

    lm = tiny_lm("llama", seed=0)
    eagle3_net = Eagle3Net(Eagle3Config.for_target(lm.config, 64, (1, 1, 0)))
    block = DFlashConfig(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         intermediate_size=64, feature_layers=(0, 1), draft_vocab_size=8, block_size=3,
                         mask_token_id=7, rms_norm_eps=1e-6, rope_theta=10000.0)
    mtp_folder = Path(__file__).parent / "fixtures" / "speculators" / "mtp"
    mtp_config = layer_config(mtp_folder / "config.json", json.loads((mtp_folder / "config.json").read_text()))
    mtp_module = read_module(mtp_folder, mtp_config)
    dspark_heads = DSparkConfig(vocab_size=8, markov_rank=4, markov_head_type="rnn", confidence=True,
                                confidence_with_markov=True, sample_from_anchor=True)
    cases = [  # (make(**options), its options class, a valid option and value[, the options it requires])
        (lambda **o: PromptLookup(**o), PromptLookupOptions, ("max_ngram", 2)),
        (lambda **o: SuffixDecoding(**o), SuffixOptions, ("merge", False)),
        (lambda **o: DraftModel(lm, **o), DraftModelOptions, ("tree_width", 2)),
        (lambda **o: Medusa(MedusaHeads(lm.config.hidden_size, 2), **o), HeadOptions, ("tree", "static")),
        (lambda **o: Eagle3Drafter(eagle3_net, **o), Eagle3Options, ("top_k", 4)),
        (lambda **o: FlashDrafter(None, **o), FlashOptions, ("top_k", 4)),
        (lambda **o: DFlash(DFlashNet(block), **o), DFlashOptions, ("max_draft_tokens", 2)),
        (lambda **o: DFlash2(DFlash2Net(DFlashNet(replace(block, conv_kernel_size=2)), CandidateSelector(8, 64, 4, 2)),
                             **o), DFlash2Options, ("max_draft_tokens", 2)),
        (lambda **o: DSpark(DSparkNet(DFlashNet(block), dspark_heads), **o),
         DSparkOptions, ("confidence_threshold", 0.5)),
        (lambda **o: PEagle(PEagleNet(Eagle3Net(Eagle3Config.for_target(lm.config, 64, (0, 1))), 63), **o),
         PEagleOptions, ("max_draft_tokens", 2), {"max_draft_tokens": 3}),
        (lambda **o: NativeMTP(**o), NativeMTPOptions, ("max_draft_tokens", 2)),
        (lambda **o: SpeculatorsMTP(mtp_module, mtp_config, **o), SpeculatorsMTPOptions, ("max_draft_tokens", 2)),
        (lambda **o: TokenRecycling(**o), TokenRecyclingOptions, ("template", ((0,), (1,), (0, 0)))),
        (lambda **o: Lookahead(**o), LookaheadOptions, ("always_window", True)),
        (lambda **o: Rest(**o), RestOptions, ("min_match", 1)),
        (lambda **o: VerticalCascade(DraftModel(lm), **o), VerticalCascadeOptions, ("lookup_tokens", 4)),
        (lambda **o: HorizontalCascade(DraftModel(lm), **o), HorizontalCascadeOptions, ("first_tokens", 2)),
        (lambda **o: LayerSkip(**o), LayerSkipOptions, ("exit_layer", 1)),
        (lambda **o: Swift(**o), SwiftOptions, ("skip_ratio", 0.3)),
        (lambda **o: Kangaroo({}, **o), KangarooOptions, ("exit_layer", 1)),
    ]
    return [case if len(case) == 4 else (*case, {}) for case in cases]


@pytest.fixture(scope="module")
def options_cases():
    return _options_cases()


def test_each_drafter_keeps_its_frozen_options(options_cases):
    import dataclasses

    for make, options_class, (name, value), required in options_cases:
        drafter = make(**{**required, name: value})
        assert isinstance(drafter.options, options_class), options_class
        assert getattr(drafter.options, name) == value
        assert drafter.options == options_class(**{**required, name: value})  # defaults: the class's own
        assert make(**required).options == options_class(**required)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(drafter.options, name, value)
        with pytest.raises(AttributeError):
            drafter.options = options_class(**required)                   # read-only on the drafter
        # a built options object is taken as it is; with keyword options too it is refused
        assert make(options=options_class(**{**required, name: value})).options == drafter.options
        with pytest.raises(TypeError, match="not both"):
            make(options=options_class(**required), **{name: value})


def test_unknown_and_ill_typed_options_fail_in_one_place_naming_them(options_cases):
    import dataclasses

    for make, options_class, (name, value), required in options_cases:
        valid = [f.name for f in dataclasses.fields(options_class)]
        with pytest.raises(TypeError, match=r"unknown option \['no_such_option'\]; its options are") as caught:
            make(**required, no_such_option=1)
        assert str(valid) in str(caught.value)
        with pytest.raises(TypeError, match=f"option '{name}' should be"):
            make(**{**required, name: object()})


def test_drafting_section_is_checked_against_the_options_class(tmp_path):
    heads = MedusaHeads(8, 2)
    folder = save_heads(tmp_path / "medusa", "medusa", heads, heads.config(), None,
                        {"method": "medusa", "target": "tiny", "drafting": {"tree": "static", "top_s": "4"}})
    with pytest.raises(DrafterFileError, match=r"'drafting'\['top_s'\] should be an integer"):
        load(folder)
    info = json.loads((folder / "drafter.json").read_text())
    info["drafting"] = {"tree": "static", "lookahead": 3}
    (folder / "drafter.json").write_text(json.dumps(info))
    with pytest.raises(DrafterFileError, match=r"'drafting' has unknown key \['lookahead'\]"):
        load(folder)
