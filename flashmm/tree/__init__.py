"""Token trees and the one tree planner: what turns a drafter's hypotheses into the tree to verify.

``token_tree`` (TokenTree: node 0 the root, parents in BFS order, masks, positions, paths), ``draft``
(Draft: the tokens, tree and draft probabilities the target verifies), ``shapes`` (Sequoia and DySpec
tree shapes from positional acceptance rates), ``trie`` (hypotheses merged into one tree, the
best-paying prefix, best-first paths, TreeSizer: how many merged nodes pay), ``cost`` (the cost
model: the measured verify cost as the planner reads it, the draft length that pays, pricing for a
batch), ``dynamic`` (EAGLE-2 trees grown node by node), ``scheme_trees`` and ``gumbel`` (the trees a
draft model samples under each drafting scheme, and sampling without replacement).
"""
