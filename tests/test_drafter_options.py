"""Drafting options have one spelling per meaning: the old spellings of the draft size are refused
wherever a user can give them (flashmm.wrap, flashmm.drafters.load, a registered name, a drafter.json
section), each error naming the old option and its new name."""
import json

import pytest
import torch

import flashmm
from flashmm.drafters import DrafterFileError, load, make_drafter
from flashmm.drafters.files import RENAMED_OPTIONS, check_section
from flashmm.drafters.head_base import save_heads
from flashmm.drafters.nets.medusa_net import MedusaHeads


@pytest.mark.parametrize("old,new", [("max_nodes", "max_draft_tokens"), ("tree_nodes", "tree='static'"),
                                     ("max_lookup_tokens", "lookup_tokens"), ("max_first_tokens", "first_tokens")])
def test_wrap_refuses_old_spellings(old, new):
    with pytest.raises(TypeError, match=f"flashmm.wrap: option '{old}' was renamed: use {new}"):
        flashmm.wrap(torch.nn.Linear(2, 2), "prompt_lookup", **{old: 4})


def test_load_refuses_old_spellings_before_reading_the_folder(tmp_path):
    with pytest.raises(TypeError, match=r"flashmm.drafters.load\(.*\): option 'max_nodes' was renamed: use max_draft_tokens"):
        load(tmp_path, max_nodes=4)


def test_registered_name_refuses_old_spellings():
    with pytest.raises(TypeError, match="drafter 'vertical_cascade': option 'max_lookup_tokens' was renamed: use lookup_tokens"):
        make_drafter("vertical_cascade", max_lookup_tokens=4)


def test_drafter_json_with_an_old_spelling_is_refused_naming_the_file(tmp_path):
    heads = MedusaHeads(8, 2)
    folder = save_heads(tmp_path / "medusa", "medusa", heads, heads.config(), None,
                        {"method": "medusa", "target": "tiny", "drafting": {"tree_nodes": 4}})
    with pytest.raises(DrafterFileError, match=r"drafter.json: 'drafting': option 'tree_nodes' was renamed: use tree='static' "
                                               r"with max_draft_tokens=N"):
        load(folder)
    info = json.loads((folder / "drafter.json").read_text())
    info["drafting"] = {"tree": "static", "max_draft_tokens": 4}
    (folder / "drafter.json").write_text(json.dumps(info))
    drafter = load(folder)
    assert (drafter.tree, drafter.max_draft_tokens) == ("static", 4)


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

