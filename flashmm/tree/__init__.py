"""Token trees and the planning of the tree to verify.

``token_tree`` (TokenTree: node 0 the root, parents in BFS order, masks, positions, paths) and
``shapes`` (Sequoia and DySpec tree shapes from positional acceptance rates).
"""
