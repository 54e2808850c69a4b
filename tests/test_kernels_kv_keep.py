"""kv_keep kernel vs an explicit gather-then-assign, for lists of layers and stacked tensors."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashmm.kernels.compaction import kv_keep, kv_keep_ref  # noqa: E402
from flashmm.tree.token_tree import TokenTree  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def accepted_paths(tree: TokenTree, bsz: int, gen: torch.Generator) -> torch.Tensor:
    """path [B, max_depth + 1]: a random root-first prefix of a random root-to-leaf path, -1 padded."""
    path = torch.full((bsz, tree.max_depth + 1), -1, dtype=torch.long)
    for b in range(bsz):
        nodes = tree.paths[int(torch.randint(0, len(tree.paths), (1,), generator=gen))]
        keep = int(torch.randint(1, len(nodes) + 1, (1,), generator=gen))
        path[b, :keep] = torch.tensor(nodes[:keep])
    return path


def expected_rows(before: torch.Tensor, prefix: int, path: torch.Tensor) -> torch.Tensor:
    """Independent expectation built out of place: [B, H, T, D]."""
    after = before.clone()
    for b in range(path.shape[0]):
        for i, node in enumerate(path[b].tolist()):
            if node >= 0:
                after[b, :, prefix + i] = before[b, :, prefix + node]
    return after


CASES = [  # (N, prefix, batch, heads, dim, layers, dtype, tree kind)
    (1, 0, 1, 2, 16, 2, torch.float32, "chain"),
    (3, 1, 3, 1, 20, 4, torch.float16, "star"),
    (31, 517, 2, 2, 16, 3, torch.float32, "random"),
    (32, 0, 3, 4, 24, 2, torch.float16, "chain"),
    (33, 1, 2, 2, 32, 2, torch.float32, "random"),
    (100, 517, 1, 2, 16, 2, torch.float16, "random"),
]


def make_tree(kind, n, gen):
    if kind == "chain":
        return TokenTree.chain(n - 1)
    if kind == "star":
        return TokenTree.from_parents([-1] + [0] * (n - 1))
    return TokenTree.from_parents([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])


@pytest.mark.parametrize("n,prefix,bsz,heads,dim,layers,dtype,kind", CASES)
def test_list_of_layers(n, prefix, bsz, heads, dim, layers, dtype, kind):
    gen = torch.Generator().manual_seed(n + prefix)
    tree = make_tree(kind, n, gen)
    path = accepted_paths(tree, bsz, gen)
    kv = [torch.randn(bsz, heads, prefix + n + 3, dim, generator=gen).to(dtype).to(DEVICE)
          for _ in range(2 * layers)]   # +3 spare rows past the tree stay untouched
    expected = [expected_rows(t, prefix, path) for t in kv]
    reference = [t.clone() for t in kv]
    kv_keep_ref(reference, prefix, path)
    kv_keep(kv, prefix, path.to(DEVICE))
    for got, want, ref in zip(kv, expected, reference):
        assert torch.equal(got, want)
        assert torch.equal(ref, want)


def test_stacked_tensor_and_overlapping_moves():
    """Destinations that are sources of later rows (dst 1 <- 2, dst 2 <- 3, dst 3 <- 5)."""
    gen = torch.Generator().manual_seed(0)
    stacked = torch.randn(6, 2, 3, 4 + 8, 16, generator=gen).to(DEVICE)   # [S, B, H, T, D]
    path = torch.tensor([[0, 2, 3, 5, 7], [0, 1, 2, 3, 4]])               # row 1: nothing moves
    expected = torch.stack([expected_rows(t, 4, path) for t in stacked.cpu()])
    kv_keep(stacked, 4, path.to(DEVICE))
    assert torch.equal(stacked.cpu(), expected)


def test_dynamic_cache_layers():
    """The tensors a transformers DynamicCache holds (one launch for keys and values of all layers)."""
    from transformers import DynamicCache
    gen = torch.Generator().manual_seed(1)
    cache = DynamicCache()
    for layer in range(3):
        cache.update(torch.randn(2, 2, 15, 16, generator=gen).to(DEVICE),
                     torch.randn(2, 2, 15, 16, generator=gen).to(DEVICE), layer)
    path = torch.tensor([[0, 3, 4, -1], [0, 1, 5, 9]])
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    expected = [expected_rows(t.cpu(), 5, path) for t in tensors]
    kv_keep(tensors, 5, path.to(DEVICE))
    for got, want in zip(tensors, expected):
        assert torch.equal(got.cpu(), want)


def test_keep_rows_torch_path_in_place():
    """flashmm.targets.cache.keep_rows (the PyTorch path): prefix untouched, overlapping moves safe, cropped."""
    from transformers import DynamicCache

    from flashmm.targets.cache import keep_rows
    gen = torch.Generator().manual_seed(2)
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.randn(1, 2, 4 + 8, 16, generator=gen), torch.randn(1, 2, 4 + 8, 16, generator=gen), layer)
    before = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
    path = torch.tensor([[0, 2, 3, 5, 7]])
    keep_rows(cache, 4, path)
    after = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    for got, old in zip(after, before):
        assert got.shape[2] == 4 + 5
        assert torch.equal(got, expected_rows(old, 4, path)[:, :, : 4 + 5])


def test_input_validation():
    a = torch.zeros(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        kv_keep([a, torch.zeros(1, 2, 9, 16, device=DEVICE)], 2, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="B = 1"):
        kv_keep([a], 2, torch.tensor([[0, 1], [0, 1]]))
    with pytest.raises(ValueError, match="cannot keep"):
        kv_keep([a], 6, torch.tensor([[0, 1, 2]]))
