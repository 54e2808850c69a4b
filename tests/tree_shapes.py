"""Tree shapes for kernel tests: chains, stars and random trees."""
import torch

from flashmm.tree.token_tree import TokenTree


def make_tree(kind: str, n: int, gen: torch.Generator) -> TokenTree:
    if kind == "chain":
        return TokenTree.chain(n - 1)
    if kind == "star":
        return TokenTree.from_parents([-1] + [0] * (n - 1))
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return TokenTree.from_parents(parents)
