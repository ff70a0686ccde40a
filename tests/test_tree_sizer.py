"""TreeSizer: a tree round verifies as many of the drafted nodes as its measured cost pays for."""
from __future__ import annotations

import math

import torch

from specc.runtime.drafters.suffix import frequency_tree, path_tree
from specc.runtime.planning import TreeSizer, cut_path
from specc.runtime.record import RoundRecord

CONTINUATIONS = [[1, 2, 3, 4, 5, 6]] * 6 + [[1, 2, 9]] * 2 + [[7]]  # a strong path with weaker branches


def sized(sizer: TreeSizer, rows: int = 1) -> list[int]:
    trees = [frequency_tree(0, CONTINUATIONS, 8) for _ in range(rows)]
    return [t.size for t in sizer.size(trees, [True] * rows)[0]]


def observe(sizer: TreeSizer, width: int, seconds: float, accepted: int, promise: float = 0.0) -> None:
    """A finished round of `width` verified nodes whose cut promised `promise` accepted nodes."""
    sizer.observe(RoundRecord(k=width, accepted=[accepted], seconds=seconds, cut=promise))


def test_cheap_verify_passes_keep_the_whole_tree_and_dear_ones_keep_none():
    cheap = TreeSizer(8)
    for width in (0, 4, 8):
        observe(cheap, width, 0.10 + 0.001 * width, accepted=0)
    cheap.accepted = cheap.promised = 1.0
    assert sized(cheap) == [8]
    dear = TreeSizer(8)
    for width in (0, 4, 8):
        observe(dear, width, 0.10 + 0.2 * width, accepted=0)
    dear.accepted = dear.promised = 1.0
    assert sized(dear) == [0]  # each node costs twice a plain pass: no draft pays


def test_in_between_the_most_probable_nodes_are_kept():
    sizer = TreeSizer(8)
    for width in (0, 4, 8):
        observe(sizer, width, 0.10 + 0.03 * width, accepted=0)
    sizer.accepted = sizer.promised = 1.0
    (n,) = sized(sizer)
    assert 0 < n < 8
    tree = sizer.size([frequency_tree(0, CONTINUATIONS, 8)], [True])[0][0]
    kept = sorted(math.exp(s) for s in tree.score[1:])
    dropped = frequency_tree(0, CONTINUATIONS, 8)
    assert min(kept) >= max(sorted(math.exp(s) for s in dropped.score[1:])[: 8 - n])  # the best n, parents included
    assert all(p in range(len(tree.tokens)) for p in tree.parent[1:])


def test_estimates_that_are_never_accepted_shrink_the_trees():
    sizer = TreeSizer(8)
    for width in (0, 4, 8):
        observe(sizer, width, 0.10 + 0.02 * width, accepted=0)
    sizer.accepted = sizer.promised = 1.0
    before = sized(sizer)[0]
    for _ in range(30):  # what the estimates promised was never accepted
        _, promise = sizer.size([frequency_tree(0, CONTINUATIONS, 8)], [True])
        observe(sizer, before, 0.10 + 0.02 * before, accepted=0, promise=promise)
    assert sized(sizer)[0] < before


def test_a_sampled_path_is_cut_with_its_point_masses():
    path = path_tree(0, [(5, 0.9), (6, 0.8), (7, 0.5)], vocab=10, device="cpu")
    cut = cut_path(path, 2)
    assert cut.tokens == [0, 5, 6] and cut.size == 2 and set(cut.q) == {0, 1}
    assert torch.equal(cut.q[1], path.q[1]) and cut.children == {0: [1], 1: [2]}
    assert cut_path(path, 5) is path
