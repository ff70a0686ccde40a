"""Token trees: drafting shape, target inputs, and the lossless tree acceptance rules.

Node 0 of every tree is the root: the row's pending token (generated, not yet in the
target cache). Drafted nodes follow in creation order, level by level. A node's children
at one parent are its candidates, tried in order at verification:

- greedy: the candidates are the draft's top tokens; a child is accepted when its token
  is the target's argmax at the parent.
- sampling: the candidates are i.i.d. draws from the draft distribution q at the parent,
  and verification is recursive rejection sampling (SpecInfer, Miao et al. 2024): child x
  is accepted with probability min(1, r(x)/q(x)) where r starts as the target's p at the
  parent and becomes norm(max(0, r - q)) after each rejection; if no child is accepted the
  next token is drawn from r. Each step is a standard speculative-sampling step with target
  r, so the output is distributed exactly as p.
- sampling over fixed candidates (`DraftTree.fixed`: distinct tokens chosen from the context, such as
  lookahead decoding's n-grams, not draws): the same recursive rule with candidate x's draft
  distribution the point mass at x (`accept_tree_fixed`). Child x is accepted with probability r(x),
  and a rejection removes x from r; so a node emits exactly a draw from p, and follows the child
  that draw names when there is one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..limits import MAX_TREE_BRANCHING, MAX_TREE_CHILD_INDEX, MAX_TREE_DEPTH, MAX_TREE_NODES
from .sampling import RowParams, probs_from_logits, sample


@dataclass(frozen=True)
class TreeShape:
    """Static paths (Medusa-style choices) or a dynamic top-k expansion (depth, branching, max_nodes).

    With verify_nodes (EAGLE-2), a dynamic tree expands only each level's `branching` most likely nodes,
    up to max_nodes drafted, and greedy rows verify only their verify_nodes most likely nodes (`rerank`)."""

    paths: tuple[tuple[int, ...], ...] | None = None
    depth: int = 4
    branching: int = 2
    max_nodes: int = 16
    verify_nodes: int | None = None
    name: str | None = None  # a drafter that lays out its own tree (lookahead): what its label says

    @classmethod
    def from_recipe(cls, tree: dict) -> "TreeShape":
        """From the recipe's speculation.tree mapping; ValueError says what is wrong with static paths."""
        paths = tree.get("paths")
        if paths is None:
            verify = tree.get("verify_nodes")
            if verify is not None and verify > tree["max_nodes"]:
                raise ValueError(f"verify_nodes {verify} is above max_nodes {tree['max_nodes']} (the nodes drafted); "
                                 "allowed: 1..max_nodes")
            return cls(None, tree["depth"], tree["branching"], tree["max_nodes"], verify)
        if tree.get("verify_nodes") is not None:
            raise ValueError("verify_nodes reranks a dynamic tree (depth, branching, max_nodes); static paths are verified whole")
        if not isinstance(paths, list) or not paths or not all(
            isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool)
                                              and 0 <= i <= MAX_TREE_CHILD_INDEX for i in p) for p in paths
        ):
            raise ValueError(f"must be a non-empty list of non-empty lists of child indices 0..{MAX_TREE_CHILD_INDEX}, "
                             "e.g. [[0], [1], [0, 0]]")
        norm = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        for p in norm:
            if len(p) > 1 and p[:-1] not in norm:
                raise ValueError(f"path {list(p)} has no parent path {list(p[:-1])}; every prefix must be listed")
        if len(norm) > MAX_TREE_NODES:
            raise ValueError(f"{len(norm)} nodes; at most {MAX_TREE_NODES}")
        return cls(tuple(norm), max(len(p) for p in norm), max(p[-1] for p in norm) + 1, len(norm))

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.paths:
            return f"tree static {len(self.paths)} nodes, depth {self.depth}"
        rerank = f", best {self.verify_nodes} verified" if self.verify_nodes else ""
        return f"tree depth {self.depth} x {self.branching}, <= {self.max_nodes} nodes{rerank}"

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """`DEPTH,BRANCHING,MAX_NODES[,VERIFY_NODES]` (the CLI's --tree); ValueError says what is allowed."""
        try:
            numbers = [int(x) for x in text.split(",")]
            if len(numbers) not in (3, 4):
                raise ValueError
        except ValueError:
            raise ValueError(f"{text!r} is not DEPTH,BRANCHING,MAX_NODES[,VERIFY_NODES] (e.g. 3,2,8 or 5,3,24,12)") from None
        depth, branching, max_nodes = numbers[:3]
        verify = numbers[3] if len(numbers) == 4 else None
        if not (1 <= depth <= MAX_TREE_DEPTH and 1 <= branching <= MAX_TREE_BRANCHING and 1 <= max_nodes <= MAX_TREE_NODES
                and (verify is None or 1 <= verify <= max_nodes)):
            raise ValueError(f"{text!r}: depth 1..{MAX_TREE_DEPTH}, branching 1..{MAX_TREE_BRANCHING}, "
                             f"max_nodes 1..{MAX_TREE_NODES}, verify_nodes 1..max_nodes")
        return cls(None, depth, branching, max_nodes, verify)

    @property
    def size(self) -> int:
        """Most drafted nodes per tree (target verifies 1 + size tokens)."""
        return len(self.paths) if self.paths else self.max_nodes

    def children_at_level(self, level: int) -> dict[tuple[int, ...], int] | None:
        """Static trees: {parent path: number of candidates} for nodes at this level (1-based)."""
        if self.paths is None:
            return None
        out: dict[tuple[int, ...], int] = {}
        for p in self.paths:
            if len(p) == level:
                out[p[:-1]] = max(out.get(p[:-1], 0), p[-1] + 1)
        return out


@dataclass
class DraftTree:
    """One row's tree. Lists are indexed by node; node 0 is the root."""

    tokens: list[int]
    parent: list[int] = field(default_factory=lambda: [-1])
    depth: list[int] = field(default_factory=lambda: [0])
    score: list[float] = field(default_factory=lambda: [0.0])  # draft log-prob of the path
    path: list[tuple[int, ...]] = field(default_factory=lambda: [()])  # candidate indices from the root
    children: dict[int, list[int]] = field(default_factory=dict)
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # draft distribution used for a node's children
    fixed: bool = False  # children are distinct tokens chosen from the context, not draws from q (accept_tree_fixed)

    def add(self, parent: int, token: int, logq: float, rank: int) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.score.append(self.score[parent] + logq)
        self.path.append(self.path[parent] + (rank,))
        self.children.setdefault(parent, []).append(node)
        return node

    def insert(self, parent: int, tokens: list[int]) -> int:
        """Add `tokens` as a path below `parent`, sharing the nodes of an equal prefix already there (a trie, so
        siblings stay distinct); returns the path's last node."""
        node = parent
        for token in tokens:
            kids = self.children.get(node, [])
            same = [c for c in kids if self.tokens[c] == token]
            node = same[0] if same else self.add(node, token, 0.0, len(kids))
        return node

    def ancestors(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = self.parent[node]
        return out

    @property
    def size(self) -> int:
        return len(self.tokens) - 1


def expand_level(trees: list[DraftTree], frontier: list[list[int]], logits: torch.Tensor, params: RowParams,
                 shape: TreeShape, level: int, noise: torch.Tensor) -> list[list[int]]:
    """Give this level's frontier nodes their children; returns each row's new nodes.

    logits [B, F, V]: the draft's logits at row b's frontier nodes, in frontier order; F is 1
    when all of a row's nodes share one distribution (a Medusa head). noise [B, nodes + 1].
    """
    probs = None if params.all_greedy else probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
    logq = torch.log_softmax(logits.float(), -1)
    out = []
    for b, tree in enumerate(trees):
        n = len(frontier[b])
        rows = (lambda x: x.expand(n, -1)) if logits.shape[1] == 1 else (lambda x: x)
        out.append(_expand_node(tree, frontier[b], None if params.greedy[b] else rows(probs[b]), rows(logq[b]),
                                shape, level, noise[b]))
    return out


def _expand_node(tree: DraftTree, frontier: list[int], probs: torch.Tensor | None, logq: torch.Tensor,
                 shape: TreeShape, level: int, noise: torch.Tensor) -> list[int]:
    """Add children to this level's frontier nodes; returns the new nodes.

    probs [F, V]: the draft distribution at each frontier node (sampled rows), None for greedy
    rows; logq [F, V]: draft log-probabilities. Greedy candidates are the top tokens; sampled
    candidates are i.i.d. draws from q, whose values never decide how many candidates a node gets.
    """
    wanted = shape.children_at_level(level)
    if wanted is None:  # dynamic: expand the most likely paths first, within the node budget
        order = sorted(range(len(frontier)), key=lambda i: -tree.score[frontier[i]])
        if shape.verify_nodes is not None:  # EAGLE-2: only the level's `branching` best nodes grow
            order = order[:shape.branching]
        counts = {}
        for i in order:
            if tree.size + sum(counts.values()) + shape.branching <= shape.max_nodes:
                counts[i] = shape.branching
    else:
        counts = {i: wanted.get(tree.path[node], 0) for i, node in enumerate(frontier)}
    new = []
    for i, node in enumerate(frontier):
        m = counts.get(i, 0)
        if m == 0:
            continue
        if probs is None:
            top = torch.topk(logq[i], m)
            for rank, (tok, lq) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
                new.append(tree.add(node, tok, lq, rank))
        else:
            q = probs[i]
            tree.q[node] = q
            for rank in range(m):
                slot = tree.size + 1  # the index the new node gets: one noise value per node
                tok = int(sample(q[None], noise[slot:slot + 1])[0])
                new.append(tree.add(node, tok, float(torch.log(q[tok])), rank))
    return new


def rerank(tree: DraftTree, n: int) -> DraftTree:
    """The tree of the n drafted nodes with the highest path scores (EAGLE-2's rerank; ties go to the
    earlier node). A node's score is at most its parent's, so every kept node's parent is kept.

    For greedy rows only: pruning sampled candidates by their own draft probabilities would leave
    candidates that are no longer i.i.d. draws from q, and the sampled acceptance rule needs them to be."""
    if tree.size <= n:
        return tree
    keep = set(sorted(range(1, len(tree.tokens)), key=lambda node: (-tree.score[node], node))[:n])  # parents sort first
    out, new = DraftTree([tree.tokens[0]]), {0: 0}
    for node in range(1, len(tree.tokens)):
        if node in keep:
            parent = tree.parent[node]
            rank = len(out.children.get(new[parent], []))
            new[node] = out.add(new[parent], tree.tokens[node], tree.score[node] - tree.score[parent], rank)
    return out


def tree_tensors(trees: list[DraftTree], first: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, depth offsets and ancestor mask [B, N, N] for nodes first.. of each tree, padded.

    A node sees itself and its ancestors among these nodes; padding nodes see only themselves.
    """
    n = max(t.size + 1 - first for t in trees)
    ids = torch.zeros(len(trees), n, dtype=torch.long)
    depth = torch.zeros(len(trees), n, dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)
    for b, t in enumerate(trees):
        for i, node in enumerate(range(first, len(t.tokens))):
            ids[b, i] = t.tokens[node]
            depth[b, i] = t.depth[node]
            for a in t.ancestors(node):
                if a >= first:
                    mask[b, i, a - first] = True
    return ids.to(device), depth.to(device), mask.to(device)


def accept_tree_greedy(logits: torch.Tensor, tree: DraftTree) -> tuple[list[int], int]:
    """Accepted path of nodes (root first) and the next token. logits [1 + N, V] for this row's nodes."""
    best = logits.argmax(-1).tolist()
    path = [0]
    while True:
        node = path[-1]
        match = next((c for c in tree.children.get(node, []) if tree.tokens[c] == best[node]), None)
        if match is None:
            return path, best[node]
        path.append(match)


def accept_tree_fixed(p: torch.Tensor, tree: DraftTree, u: torch.Tensor) -> tuple[list[int], int]:
    """Recursive rejection sampling over fixed, distinct candidates: each child's draft distribution is the
    point mass at its token, so it is accepted with probability r(x) and a rejection zeroes x in r.
    p [1 + N, V] target probs per node; u [2 + N] uniforms (u[c] decides child c, u[-1] the final draw)."""
    path = [0]
    while True:
        r = p[path[-1]]
        for c in tree.children.get(path[-1], []):
            x = tree.tokens[c]
            if u[c] < r[x]:
                path.append(c)
                break
            rest = r.clone()
            rest[x] = 0.0
            mass = rest.sum()
            r = rest / mass if mass > 1e-12 else r
        else:
            return path, int(sample(r[None], u[-1:])[0])


def accept_tree_sampled(p: torch.Tensor, tree: DraftTree, u: torch.Tensor) -> tuple[list[int], int]:
    """Recursive rejection sampling down the tree. p [1 + N, V] target probs per node; u [2 + N]
    uniforms (u[c] decides child c, u[-1] the final draw)."""
    path = [0]
    while True:
        node = path[-1]
        r = p[node]
        moved = False
        for c in tree.children.get(node, []):
            q = tree.q[node]
            x = tree.tokens[c]
            if u[c] * q[x] < r[x]:
                path.append(c)
                moved = True
                break
            residual = torch.clamp(r - q, min=0.0)
            mass = residual.sum()
            r = residual / mass if mass > 1e-12 else r
        if not moved:
            return path, int(sample(r[None], u[-1:])[0])
