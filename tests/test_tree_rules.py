"""Tree acceptance rules on context-free distributions: the first two emitted tokens must follow
the target's p at each depth; a rule that forgets the residual update must be caught."""
from __future__ import annotations

import pytest
import torch

from specc.speculation.sampling import RowParams, SamplingParams, sample
from specc.speculation.tree import (DraftTree, TreeShape, accept_tree_fixed, accept_tree_greedy, accept_tree_sampled,
                                   expand_level, rerank)

from stats_helpers import FAIL_P, PASS_P, chi2_pvalue

VOCAB, N = 6, 20_000


def _dists(seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, VOCAB, generator=g) * 1.5, -1)  # target at depth 0, 1, 2
    q = torch.softmax(torch.randn(2, VOCAB, generator=g) * 1.5, -1)  # draft at depth 0, 1
    return p, q, g


def _tree(q, g, root_children=3, grand_children=2) -> DraftTree:
    t = DraftTree([0])
    t.q[0] = q[0]
    for rank, tok in enumerate(torch.multinomial(q[0], root_children, replacement=True, generator=g).tolist()):
        child = t.add(0, tok, 0.0, rank)
        t.q[child] = q[1]
        for r2, tok2 in enumerate(torch.multinomial(q[1], grand_children, replacement=True, generator=g).tolist()):
            t.add(child, tok2, 0.0, r2)
    return t


def _emitted(rule, seed=0):
    p, q, g = _dists(seed)
    first, second = [], []
    for _ in range(N):
        t = _tree(q, g)
        probs = torch.stack([p[d] for d in t.depth])  # context-free: p depends on depth only
        path, nxt = rule(probs, t, torch.rand(t.size + 2, generator=g))
        toks = [t.tokens[n] for n in path[1:]] + [nxt]
        first.append(toks[0])
        if len(toks) > 1:
            second.append(toks[1])
    return p, first, second


def test_recursive_rejection_sampling_is_lossless():
    p, first, second = _emitted(accept_tree_sampled)
    assert chi2_pvalue(first, p[0]) > PASS_P
    assert chi2_pvalue(second, p[1]) > PASS_P


def test_rule_without_residual_update_is_caught(monkeypatch):
    def no_residual(p, tree, u):
        """Wrong: every sibling is tested against the original p, and the fallback draws from p."""
        path = [0]
        while True:
            node = path[-1]
            for c in tree.children.get(node, []):
                if u[c] * tree.q[node][tree.tokens[c]] < p[node][tree.tokens[c]]:
                    path.append(c)
                    break
            else:
                return path, int(sample(p[node][None], u[-1:])[0])

    p, first, second = _emitted(no_residual)
    assert min(chi2_pvalue(first, p[0]), chi2_pvalue(second, p[1])) < FAIL_P


def test_greedy_tree_follows_target_argmax():
    t = DraftTree([7])
    a = t.add(0, 3, 0.0, 0)
    b = t.add(0, 5, 0.0, 1)
    c = t.add(b, 1, 0.0, 0)
    logits = torch.zeros(4, 10)
    logits[0, 5] = logits[b, 1] = logits[c, 9] = 1.0  # target: after root 5, after 5 -> 1, after 1 -> 9
    logits[a, 2] = 1.0
    path, nxt = accept_tree_greedy(logits, t)
    assert path == [0, b, c] and nxt == 9


def test_tree_shape_validation():
    from specc.errors import RecipeError
    from specc.recipe import parse_recipe

    shape = TreeShape.from_recipe({"paths": [[0], [1], [0, 0]]})
    assert shape.size == 3 and shape.depth == 2 and shape.children_at_level(2) == {(0,): 1}
    with pytest.raises(ValueError, match=r"path \[1, 0\] has no parent path \[1\]"):
        TreeShape.from_recipe({"paths": [[0], [1, 0]]})
    with pytest.raises(ValueError, match="non-empty list"):
        TreeShape.from_recipe({"paths": [[]]})
    with pytest.raises(RecipeError, match=r"speculation.tree.paths.*has no parent path"):  # the recipe names the field
        parse_recipe({"target": {"model": "m"}, "draft": {"method": "model", "model": "d"},
                      "speculation": {"mode": "tree", "tree": {"paths": [[0], [1, 0]]}}})
    with pytest.raises(ValueError, match="depth 1..16"):
        TreeShape.parse("17,2,8")
    assert TreeShape.from_recipe({"paths": None, "depth": 3, "branching": 2, "max_nodes": 10}).size == 10
    assert TreeShape.parse("5,3,24,12") == TreeShape(None, 5, 3, 24, 12)
    with pytest.raises(ValueError, match="verify_nodes 1..max_nodes"):
        TreeShape.parse("3,2,8,9")
    with pytest.raises(RecipeError, match=r"speculation.tree.verify_nodes.*above max_nodes"):
        parse_recipe({"target": {"model": "m"}, "draft": {"method": "model", "model": "d"},
                      "speculation": {"mode": "tree", "tree": {"max_nodes": 6, "verify_nodes": 7}}})
    with pytest.raises(RecipeError, match=r"speculation.tree.verify_nodes.*static paths"):
        parse_recipe({"target": {"model": "m"}, "draft": {"method": "model", "model": "d"},
                      "speculation": {"mode": "tree", "tree": {"paths": [[0]], "verify_nodes": 1}}})


def test_rerank_keeps_the_most_likely_nodes_as_a_tree():
    """EAGLE-2's rerank: the n nodes of highest path score, in creation order, renumbered with their
    parents, depths, paths and candidate ranks; a tree of n nodes or fewer is kept as it is."""
    t = DraftTree([9])
    a = t.add(0, 1, -0.1, 0)   # score -0.1
    b = t.add(0, 2, -2.0, 1)   # -2.0
    c = t.add(a, 3, -0.2, 0)   # -0.3
    t.add(a, 4, -1.5, 1)       # -1.6
    t.add(b, 5, -0.1, 0)       # -2.1
    t.add(c, 6, -0.5, 0)       # -0.8
    out = rerank(t, 3)
    assert out.tokens == [9, 1, 3, 6] and out.parent == [-1, 0, 1, 2] and out.depth == [0, 1, 2, 3]
    assert out.path == [(), (0,), (0, 0), (0, 0, 0)] and out.children == {0: [1], 1: [2], 2: [3]}
    assert [round(x, 6) for x in out.score] == [0.0, -0.1, -0.3, -0.8]
    out = rerank(t, 5)  # -1.6 (token 4) before -2.0 (token 2): a's second child, then b
    assert out.tokens == [9, 1, 2, 3, 4, 6] and out.children == {0: [1, 2], 1: [3, 4], 3: [5]}
    assert out.path[4] == (0, 1) and out.path[2] == (1,)
    assert rerank(t, 6) is t


def test_eagle2_growth_expands_only_the_best_nodes_of_each_level():
    """With verify_nodes, a level grows only its `branching` most likely nodes (the budget alone would
    let more grow); without, every frontier node grows while the budget lasts."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 1e-9])).expand(1, 3, 4)  # [B, frontier, V]
    greedy = RowParams.of([SamplingParams(0.0)])
    for verify, grown in ((None, 3), (4, 2)):
        shape = TreeShape(None, depth=2, branching=2, max_nodes=12, verify_nodes=verify)
        t = DraftTree([0])
        frontier = [[t.add(0, tok, lq, r) for r, (tok, lq) in enumerate([(1, -0.1), (2, -0.5), (3, -0.9)])]]
        new = expand_level([t], frontier, logits, greedy, shape, 2, torch.zeros(1, 16))[0]
        assert len({t.parent[n] for n in new}) == grown and len(new) == 2 * grown



def _fixed_tree(g) -> DraftTree:
    """Distinct candidates chosen without the target's noise (as lookahead's n-grams are): 3 at the root, 2 below each."""
    t = DraftTree([0], fixed=True)
    for tok in torch.randperm(VOCAB, generator=g)[:3].tolist():
        child = t.add(0, tok, 0.0, len(t.children.get(0, [])))
        for tok2 in torch.randperm(VOCAB, generator=g)[:2].tolist():
            t.add(child, tok2, 0.0, len(t.children.get(child, [])))
    return t


def _emitted_fixed(rule, seed=0):
    p, _, g = _dists(seed)
    first, second = [], []
    for _ in range(N):
        t = _fixed_tree(g)
        path, nxt = rule(torch.stack([p[d] for d in t.depth]), t, torch.rand(t.size + 2, generator=g))
        toks = [t.tokens[n] for n in path[1:]] + [nxt]
        first.append(toks[0])
        if len(toks) > 1:
            second.append(toks[1])
    return p, first, second


def test_fixed_candidates_rule_is_lossless():
    p, first, second = _emitted_fixed(accept_tree_fixed)
    assert chi2_pvalue(first, p[0]) > PASS_P
    assert chi2_pvalue(second, p[1]) > PASS_P


def test_fixed_candidates_under_the_iid_rule_are_caught():
    """Wrong: the i.i.d. rule with q uniform over each node's candidates, as if they had been drawn from it."""
    def as_if_drawn(p, tree, u):
        for node, kids in tree.children.items():
            tree.q[node] = torch.zeros(VOCAB)
            tree.q[node][[tree.tokens[c] for c in kids]] = 1.0 / len(kids)
        return accept_tree_sampled(p, tree, u)

    p, first, second = _emitted_fixed(as_if_drawn)
    assert min(chi2_pvalue(first, p[0]), chi2_pvalue(second, p[1])) < FAIL_P
