"""Lookahead decoding (Fu et al. 2024, arXiv 2402.02057): the target guesses future tokens itself by Jacobi
iteration and keeps the n-grams its guesses produce; no draft model, head or training.

One target pass per round carries two branches as one token tree (the tree mask and depth positions every
tree round uses), laid out as TensorRT-LLM's `LookaheadAlgorithm` lays them out:

- the lookahead branch: a window of W lanes, each N - 1 guessed tokens at consecutive positions. Lane i's
  first token sits i positions past the pending token and sees the first tokens of the lanes before it
  (the window's oldest level, a chain from the pending token); its later tokens see the lane's earlier ones.
  The target's choice after a lane's last token is the lane's next guess: the lane slides by one and the
  n-gram it completes (the lane and that guess) enters the pool. The window fills level by level over its
  first N - 2 rounds, behind filler tokens that keep every lane at the positions it will have once full.
- the verification branch: up to G n-grams of the pool that start with the pending token.

Every node is at its depth's position and sees exactly its ancestors, so every path of the tree is a real
continuation whose logits the pass computes: the round accepts the longest path the target agrees with,
verification n-gram or lane, and commits it like any tree path. Nodes with the same path are merged (a
trie), so a node's children are distinct tokens.

Lossless: the tokens are chosen from the context, the pool and earlier passes, never from this round's noise.
Greedy rows accept a child equal to the target's argmax. Sampled rows take the recursive rejection rule with
each candidate's draft distribution the point mass at it (`speculation.tree.accept_tree_fixed`): a node emits
exactly a draw from the target's distribution. How the lanes guess (the target's argmax) changes what is
drafted, never what is kept.

The pool is per request: seeded with the prompt's n-grams, then every n-gram of the output and of the lanes,
at most G per first token (the oldest dropped, as TensorRT-LLM's pool) and at most POOL_KEYS first tokens
(the least recently used dropped).
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

from ...speculation.sampling import RowParams
from ...speculation.tree import DraftTree, TreeShape
from ..state import Batch, Request
from .base import DraftContext, Drafter

SOURCE = "lookahead"  # its Request.draft_memo key
POOL_KEYS = 4096  # first tokens a request's pool keeps n-grams for


class NgramPool:
    """N-grams by their first token: at most `per_key` tails of N - 1 tokens each (newest last, the oldest dropped),
    for at most `keys` first tokens (the least recently used dropped)."""

    def __init__(self, n: int, per_key: int, keys: int = POOL_KEYS):
        self.n, self.per_key, self.keys = n, per_key, keys
        self.tails: OrderedDict[int, list[tuple[int, ...]]] = OrderedDict()

    def add(self, gram: list[int]) -> None:
        """Keep an n-gram of n tokens (a repeat moves to the newest place)."""
        key, tail = gram[0], tuple(gram[1:])
        tails = self.tails.setdefault(key, [])
        if tail in tails:
            tails.remove(tail)
        tails.append(tail)
        del tails[:-self.per_key]
        self.tails.move_to_end(key)
        if len(self.tails) > self.keys:
            self.tails.popitem(last=False)

    def guesses(self, key: int) -> list[tuple[int, ...]]:
        """The newest `per_key` tails after `key`, newest first."""
        tails = self.tails.get(key)
        if not tails:
            return []
        self.tails.move_to_end(key)
        return tails[::-1]

    @property
    def size(self) -> int:
        return sum(map(len, self.tails.values()))


@dataclass
class LookaheadTree(DraftTree):
    """A lookahead round's tree: nodes 1..`guesses` are the verification branch (inserted first, so they form a
    tree of their own), the rest the lanes' nodes not shared with it; `lane_ends`: each lane's last node."""

    guesses: int = 0
    lane_ends: list[int] = field(default_factory=list)


class LookaheadRow:
    """One request's lookahead state: its pool, its window of lanes and how far the pool has read its tokens."""

    def __init__(self, seq: Request, window: int, ngram: int, verify_ngrams: int):
        self.n, self.g = ngram, verify_ngrams
        self.pool = NgramPool(ngram, max(verify_ngrams, 1))
        self.read = 0  # n-grams of seq.tokens starting before this index are in the pool
        # the first guesses are the prompt's own tokens, drawn the same way for the same prompt
        source = seq.tokens
        rng = random.Random(hash(tuple(source)))
        self.lanes = [[rng.choice(source)] for _ in range(window)]
        self.fillers = [rng.choice(source) for _ in range(max(ngram - 2, 0))]
        self.fill = 1 if ngram > 1 else 0  # levels of the window filled
        self.last: LookaheadTree | None = None  # the tree of this row's last lookahead round

    def sync(self, tokens: list[int]) -> None:
        """Add the n-grams of the context not read yet (the prompt's at first, then the output's)."""
        for i in range(self.read, len(tokens) - self.n + 1):
            self.pool.add(tokens[i:i + self.n])
        self.read = max(self.read, len(tokens) - self.n + 1)

    @property
    def full(self) -> bool:
        return self.fill >= self.n - 1

    def lane_paths(self) -> list[list[int]]:
        """Each lane's tokens below the pending token: the fillers while the window fills, the first tokens of the
        lanes before it (the pending token stands for lane 0's once the window is full), then its own."""
        firsts = [lane[0] for lane in self.lanes]
        head, start = (self.fillers[self.fill:], 0) if not self.full else ([], 1)
        return [head + firsts[start:i + 1] + lane[1:] for i, lane in enumerate(self.lanes)]

    def tree(self, root: int) -> LookaheadTree:
        """The round's tree: the pool's n-grams after `root` first, then the window's lanes."""
        tree = LookaheadTree([root], fixed=True)
        for tail in self.pool.guesses(root)[:self.g]:
            tree.insert(0, list(tail))
        tree.guesses = tree.size
        tree.lane_ends = [tree.insert(0, path) for path in self.lane_paths()]
        self.last = tree
        return tree

    def advance(self, root: int, guessed: list[int]) -> None:
        """After a pass over this row's last tree: guessed[node] is the target's choice after each node. Each
        lane takes its next guess; once the window is full, it slides and its n-gram enters the pool."""
        nexts = [guessed[end] for end in self.last.lane_ends]
        if not self.full:
            for lane, nxt in zip(self.lanes, nexts):
                lane.append(nxt)
            self.fill += 1
            return
        for i, (lane, nxt) in enumerate(zip(self.lanes, nexts)):
            self.pool.add([root if i == 0 else lane[0]] + lane[1:] + [nxt])
            lane[:] = lane[1:] + [nxt]


class LookaheadDrafter(Drafter):
    """Drafts lookahead decoding's two branches as one token tree per row (recipe draft.method lookahead)."""


    def __init__(self, window: int, ngram: int, verify_ngrams: int):
        self.window, self.ngram, self.verify_ngrams = window, ngram, verify_ngrams

    @classmethod
    def build(cls, ctx: DraftContext) -> "LookaheadDrafter":
        s = ctx.settings
        return cls(s["window"], s["ngram"], s["verify_ngrams"])

    def row(self, seq: Request) -> LookaheadRow:
        state = seq.draft_memo.get(SOURCE)
        if state is None:
            state = seq.draft_memo[SOURCE] = LookaheadRow(seq, self.window, self.ngram, self.verify_ngrams)
        state.sync(seq.tokens)
        return state

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        return [self.row(s).tree(s.tokens[-1]) for s in batch.seqs]

    def after_verify(self, batch: Batch, verdict) -> None:
        """Rows whose verified tree was their last lookahead tree advance their window (a round drafted by
        another drafter in front, or cut by k auto's gate to its verification branch or a plain step, leaves it
        as it was)."""
        trees = verdict.trees or []
        for seq, tree, guessed in zip(batch.seqs, trees, verdict.tree_argmax or []):
            state = seq.draft_memo.get(SOURCE)
            if state is not None and state.last is tree:
                state.advance(tree.tokens[0], guessed)
            if state is not None:
                state.last = None


__all__ = ["LookaheadDrafter", "LookaheadRow", "LookaheadTree", "NgramPool"]
