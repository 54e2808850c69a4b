"""Bad drafter files get one clear error naming the file and what is wrong (DrafterFileError), a
planted pickle is refused without running, and a damaged REST suffix-array cache is rebuilt.

Every folder here is written by the project's own save code, then a copy is damaged the way a
disk, a copy or a hand edit damages one: a truncated safetensors file, JSON that does not parse,
a key deleted, a value of the wrong type, a key no loader knows."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import flashmm
from flashmm import disk_cache
from flashmm.drafters import DrafterFileError, FlashDrafter, Rest, load
from flashmm.drafters import rest as rest_module
from flashmm.drafters.eagle3 import save_head
from flashmm.drafters.fastdraft import save_reduced_lm
from flashmm.drafters.nets.reduced_vocab import ReducedVocabLM, build_lm
from flashmm.drafters.head_base import save_heads
from flashmm.drafters.nets.medusa_net import MedusaHeads
from flashmm.drafters.nets.eagle3_net import Eagle3Config, Eagle3Net
from flashmm.train import draft_lm

from text_models import VOCAB, tiny_lm

TARGET_INFO = {"name": "tiny", "vocab_size": VOCAB, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def target():
    return tiny_lm("llama", seed=0)


@pytest.fixture(scope="module")
def folders(target, tmp_path_factory):
    """{kind: a folder the project's save code wrote for ``target``}."""
    root = tmp_path_factory.mktemp("saved")
    flash = root / "flash"
    FlashDrafter.from_target(target, num_queries=4, tokens_per_step=2, seed=0).save_pretrained(flash)
    # the record a reference build leaves beside the drafter: wrap() accepts it as trained
    (flash / "flash_build_info.json").write_text(json.dumps({"epoch_losses": [1.0]}))
    heads = MedusaHeads(target.config.hidden_size, 2)
    save_heads(root / "medusa", "medusa", heads, heads.config(), None,
               {"method": "medusa", "target": TARGET_INFO, "drafting": {"tree": "static", "max_draft_tokens": 3}})
    torch.manual_seed(0)
    net = Eagle3Net(Eagle3Config.for_target(target.config, 64, (1, 1, 0)))
    net.set_vocab(torch.arange(VOCAB - 64, VOCAB))
    save_head(root / "eagle3", net, {"method": "eagle3", "target": TARGET_INFO}, dict(tree="dynamic", depth=3, top_k=2))
    lm_config = draft_lm.draft_lm_config(target.config, 64, hidden=32, layers=1, heads=2, intermediate=64)
    save_reduced_lm(root / "fastdraft", ReducedVocabLM(build_lm(lm_config), torch.arange(3, 67), VOCAB),
                    {"method": "fastdraft", "target": TARGET_INFO})
    return {"flash": flash, "medusa": root / "medusa", "eagle3": root / "eagle3", "fastdraft": root / "fastdraft"}


CONFIG = {"flash": "flash_config.json", "medusa": "drafter.json", "eagle3": "drafter.json", "fastdraft": "drafter.json"}
WEIGHTS = {"flash": "flash_model.safetensors", "medusa": "model.safetensors", "eagle3": "model.safetensors",
           "fastdraft": "model.safetensors"}
# (section, key) each kind's loader needs: deleted for "missing key"
REQUIRED = {"flash": ("config", "hidden_size"), "medusa": ("heads", "hidden_size"),
            "eagle3": ("eagle3_config", "vocab_size"), "fastdraft": (None, "lm_config")}
# (section, key, a value of the wrong type): a string where a number belongs
MISTYPED = {"flash": ("drafting", "top_k", "8"), "medusa": ("heads", "num_heads", "2"),
            "eagle3": ("drafting", "depth", "3"), "fastdraft": ("target", "vocab_size", "128")}
# (section, key) no loader knows (a drafter.json's top level is free provenance: a section is not)
UNKNOWN = {"flash": ("drafting", "top_kk"), "medusa": ("heads", "hidden"), "eagle3": ("eagle3_config", "head_dims")}


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def damage(folder: Path, kind: str, case: str) -> tuple[Path, str]:
    """Damage ``folder`` (a copy) as ``case`` says; returns (the damaged file, what the error must say)."""
    config, weights = folder / CONFIG[kind], folder / WEIGHTS[kind]
    if case == "truncated safetensors":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return weights, "truncated or corrupt safetensors"
    if case == "corrupt safetensors header":
        data = bytearray(weights.read_bytes())
        data[8:16] = b"\xff" * 8                                  # the header's JSON no longer parses
        weights.write_bytes(bytes(data))
        return weights, "truncated or corrupt safetensors"
    if case == "invalid JSON":
        config.write_text(config.read_text()[:-20] + "}, oops")
        return config, "invalid JSON"
    if case == "missing key":
        section, key = REQUIRED[kind]
        edit_json(config, lambda d: (d[section] if section else d).pop(key))
        return config, rf"lacks the required key \['{key}'\]"
    if case == "wrong type":
        section, key, value = MISTYPED[kind]
        edit_json(config, lambda d: d[section].__setitem__(key, value))
        return config, rf"\['{key}'\] should be an integer.*got string"
    if case == "unknown key":
        section, key = UNKNOWN[kind]
        edit_json(config, lambda d: d[section].__setitem__(key, 1))
        return config, rf"unknown key \['{key}'\]"
    raise AssertionError(case)


CASES = ["truncated safetensors", "corrupt safetensors header", "invalid JSON", "missing key", "wrong type",
         "unknown key"]


def loaders(kind: str, target):
    """Every public way to read a folder of ``kind``."""
    readers = [lambda folder: flashmm.wrap(target, str(folder))]
    if kind == "flash":
        readers += [FlashDrafter.from_pretrained, lambda folder: FlashDrafter(folder)]
    else:
        readers.append(load)
    return readers


@pytest.mark.parametrize("kind", ["flash", "medusa", "eagle3", "fastdraft"])
def test_every_saved_folder_loads_before_it_is_damaged(kind, folders, target):
    """The control: the undamaged folders load through every reader (the errors below are the damage's)."""
    for read in loaders(kind, target):
        read(folders[kind])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["flash", "medusa", "eagle3", "fastdraft"])
def test_a_damaged_folder_is_refused_naming_the_file(kind, case, folders, target, tmp_path):
    if case == "unknown key" and kind not in UNKNOWN:
        pytest.skip(f"{kind}'s sections are a transformers config and provenance: both take any key")
    folder = tmp_path / kind
    shutil.copytree(folders[kind], folder)
    damaged, problem = damage(folder, kind, case)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for read in loaders(kind, target):
        with pytest.raises(DrafterFileError, match=problem) as caught:
            read(folder)
        assert str(damaged) in str(caught.value) and caught.value.path == damaged
        assert isinstance(caught.value, ValueError)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before     # nothing written, nothing lost


def test_a_value_out_of_range_names_the_file(folders, tmp_path):
    """A value of the right type the constructor refuses (top_k = 0) is reported against the file too."""
    folder = tmp_path / "flash"
    shutil.copytree(folders["flash"], folder)
    edit_json(folder / "flash_config.json", lambda d: d["drafting"].__setitem__("top_k", 0))
    with pytest.raises(DrafterFileError, match="top_k must be >= 1") as caught:
        FlashDrafter.from_pretrained(folder)
    assert caught.value.path == folder / "flash_config.json"


def test_weights_of_another_size_name_the_weights_file(folders, tmp_path):
    folder = tmp_path / "medusa"
    shutil.copytree(folders["medusa"], folder)
    edit_json(folder / "drafter.json", lambda d: d["heads"].__setitem__("num_heads", 3))
    with pytest.raises(DrafterFileError, match="does not match its config") as caught:
        load(folder)
    assert caught.value.path == folder / "model.safetensors"


# ------------------------------------------------------------------------------------- REST
class Planted:
    """Unpickling this runs Path.touch(marker): what a planted file would do with a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.mark.parametrize("suffix", [".pt", ".npy"])
def test_a_planted_pickle_token_file_is_refused_without_running(tmp_path, suffix):
    marker, planted = tmp_path / "ran", tmp_path / f"tokens{suffix}"
    if suffix == ".pt":
        torch.save(Planted(marker), planted)
    else:
        np.save(planted, np.array([Planted(marker)], dtype=object), allow_pickle=True)
    # the file really runs code when unpickled without care, so the refusal below is a real one
    if suffix == ".pt":
        torch.load(planted, weights_only=False)
    else:
        np.load(planted, allow_pickle=True)
    assert marker.exists()
    marker.unlink()
    for read in (lambda: Rest.from_corpus([planted]), lambda: Rest(datastore=str(planted)),
                 lambda: rest_module.read_documents(planted)):
        with pytest.raises(DrafterFileError, match="refused") as caught:
            read()
        assert caught.value.path == planted
    assert not marker.exists()
    torch.save(torch.tensor([5, 6, -1, 7]), tmp_path / "plain.pt")            # a plain tensor still reads
    assert rest_module.read_documents(tmp_path / "plain.pt") == [[5, 6], [7]]


def test_a_truncated_datastore_names_the_file(tmp_path):
    store = rest_module.Datastore(np.array([1, 2, 3, -1, 1, 2, 4, -1]))
    store.save(tmp_path / "store.safetensors")
    data = (tmp_path / "store.safetensors").read_bytes()
    (tmp_path / "store.safetensors").write_bytes(data[: len(data) - 9])
    with pytest.raises(DrafterFileError, match="truncated or corrupt safetensors") as caught:
        Rest(datastore=tmp_path / "store.safetensors")
    assert caught.value.path == tmp_path / "store.safetensors"
    shuffled = rest_module.Datastore(store.tokens, store.array[::-1].copy())     # a suffix array out of order
    shuffled.save(tmp_path / "shuffled.safetensors")
    with pytest.raises(DrafterFileError, match="out of order"):
        Rest(datastore=tmp_path / "shuffled.safetensors")


def compact_store(tmp_path, monkeypatch):
    """(a compact datastore file, the full Datastore it holds, the cache directory)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLASHMM_CACHE_DIR", str(cache))
    rng = np.random.default_rng(0)
    flat = [t for _ in range(60) for t in rng.integers(0, 6, size=int(rng.integers(1, 9))).tolist() + [-1]]
    full = rest_module.Datastore(np.array(flat))
    Rest(full).save(tmp_path / "compact.safetensors", compact=True)
    return tmp_path / "compact.safetensors", full, cache


def drafted(rest: Rest) -> list:
    """What REST drafts after a few contexts: the grown trees."""
    return [rest.grow(context, 12) for context in ([1, 2], [3, 4, 5], [0, 0], [5, 1, 2, 3])]


@pytest.mark.parametrize("harm", ["truncated", "flipped bytes", "not a zip"])
def test_a_damaged_suffix_array_cache_is_rebuilt(tmp_path, monkeypatch, harm):
    path, full, cache = compact_store(tmp_path, monkeypatch)
    first = Rest(datastore=path)
    (entry,) = cache.glob("suffix_array_*.npz")
    want = drafted(first)
    data = bytearray(entry.read_bytes())
    if harm == "truncated":
        data = data[: len(data) // 2]
    elif harm == "flipped bytes":       # inside the array's bytes: the zip still opens, the checksum catches it
        start = data.index(np.ascontiguousarray(full.array.astype(np.int32)).tobytes()[:64])
        data[start + 8: start + 16] = b"\x01" * 8
    else:
        data = b"garbage" * 10
    entry.write_bytes(bytes(data))
    builds = []
    real = rest_module.suffix_array
    monkeypatch.setattr(rest_module, "suffix_array", lambda tokens: builds.append(1) or real(tokens))
    with pytest.warns(RuntimeWarning, match=f"{entry}.*damaged.*rebuilding"):
        again = Rest(datastore=path)
    assert builds == [1] and np.array_equal(again.datastore.array, full.array) and drafted(again) == want
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # the rebuilt entry is read back with no warning
        third = Rest(datastore=path)
    assert builds == [1] and drafted(third) == want


def test_an_unwritable_cache_directory_leaves_rest_running(tmp_path, monkeypatch):
    """A cache directory that cannot be written (simulated: tests run as root) costs one warning
    naming it, not an error; REST drafts as with the cache."""
    path, full, cache = compact_store(tmp_path, monkeypatch)
    want = drafted(Rest(rest_module.Datastore(full.tokens)))

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(cache))
    monkeypatch.setattr(disk_cache.tempfile, "mkstemp", refuse)
    monkeypatch.setattr(disk_cache, "_warned", set())
    with pytest.warns(RuntimeWarning, match=f"{cache} cannot be written") as caught:
        first = Rest(datastore=path)
        second = Rest(datastore=path)
    assert sum("cannot be written" in str(w.message) for w in caught) == 1
    assert drafted(first) == drafted(second) == want and not list(cache.glob("suffix_array_*"))
