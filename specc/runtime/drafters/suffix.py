"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): drafts from the request's own context and from the
outputs of earlier requests, by frequency, no model.

Two indexes of the same kind (`SuffixIndex`): one per request over its prompt and output, and one shared
by every request of a loaded model (`GlobalSuffixCache`) over the outputs of the last requests, bounded in
requests and tokens and evicted least recently used. An index maps every n-gram of a few orders (ORDERS)
to where it occurred; a draft takes the longest order at which the row's last tokens occur (in either
index), extends each occurrence's match backwards to measure it, and counts the continuations of all
occurrences in a small trie. A chain follows the most frequent child while the path's estimated
probability (the product of child count over parent count) stays above MIN_PROB; a tree takes the most
probable nodes first (the paper's scoring) up to the tree's node budget. Either is at most
`factor * match length + offset` tokens long, so a short match drafts little and no match drafts nothing.

Lossless as prompt lookup: the drafts are a function of the context and of the indexes, never of this
round's noise, so each draft is a point mass (one-hot q) and sampled rows accept a draft d with probability
p(d). What other requests put in the global index changes which tokens are drafted, never which are kept.
Sampled rows get a single path even in tree rounds: speculation/tree.py's sampled rule takes a node's
children as i.i.d. draws from one q, which several distinct deterministic children are not.

Thread safety: a request's own index is touched only by the scheduler running it; the global cache is
shared by every generate call and server request of the model, behind one lock.
"""
from __future__ import annotations

import heapq
import math
from typing import Callable

import torch

from ...speculation.sampling import RowParams
from ...speculation.tree import DraftTree, TreeShape
from ..state import Batch, Request
from ..record import DraftPlan
from .base import DraftContext, Drafter, Proposal, one_hot_proposal
from .suffix_index import (MAX_DEPTH, MIN_FRONT_MATCH, MIN_PROB, SOURCE, GlobalSuffixCache, Match, RowSuffix, SuffixIndex,
                           match_length)

class SuffixDrafter(Drafter):
    """Drafts from the request's own suffix index and the model's global cache (recipe draft.method suffix)."""

    def __init__(self, cache: GlobalSuffixCache, vocab_size: int):
        self.cache, self.vocab_size = cache, vocab_size

    @property
    def suffix_cache(self) -> GlobalSuffixCache:
        return self.cache

    @classmethod
    def build(cls, ctx: DraftContext) -> "SuffixDrafter":
        s = ctx.settings
        return cls(GlobalSuffixCache(s.get("suffix_requests", 256), s.get("suffix_tokens", 262144), ctx.vocab_size),
                   ctx.vocab_size)

    # -- the request's state -------------------------------------------------------------------
    def row(self, seq: Request) -> RowSuffix:
        state = seq.draft_memo.get(SOURCE)
        if state is None:
            state = seq.draft_memo[SOURCE] = RowSuffix(self.cache)
        state.sync(seq, self.cache)
        return state

    def finished(self, seq: Request) -> None:
        """The request's last tokens go to the global cache; its own index is dropped with it."""
        state = seq.draft_memo.pop(SOURCE, None)
        if state is not None:
            state.sync(seq, self.cache)

    # -- lookups -------------------------------------------------------------------------------
    def match(self, seq: Request) -> Match:
        """The longest n-gram order at which the row's last tokens occur, in its own context or the cache,
        and the continuations of those occurrences."""
        state = self.row(seq)
        context = seq.tokens
        for n in self.cache.index.orders:
            if len(context) < n:
                continue
            key = tuple(context[-n:])
            found = [(state.local.seqs[0], i) for _, i in state.local.occurrences(key)]
            found += self.cache.lookup(key, skip=state.sid)
            if not found:
                continue
            conts, length = [], n
            for seq_tokens, i in found:
                length = max(length, match_length(seq_tokens, i - 1, context, n))
                conts.append(seq_tokens[i:i + MAX_DEPTH])
            return Match(n, length, conts)
        return Match()

    def finds(self, batch: Batch) -> list[int]:
        """Per row the n-gram order matched where the match drafts at least one token, else 0."""
        return [m.order if m.order and best_path(m.continuations, 1) else 0 for m in map(self.match, batch.seqs)]

    def covers(self, batch: Batch) -> bool:
        """Every row has a match of at least MIN_FRONT_MATCH tokens that drafts: in front of a model, the
        suffix drafter drafts the round."""
        return all(m.length >= MIN_FRONT_MATCH and best_path(m.continuations, 1) for m in map(self.match, batch.seqs))

    # -- chains --------------------------------------------------------------------------------
    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        matches = [self.match(s) for s in batch.seqs]
        drafts = [best_path(m.continuations, m.budget(plan.k)) if m.order else [] for m in matches]
        self.cache.note(matches, [len(d) for d in drafts])
        self.mark_drafted(batch)
        return one_hot_proposal(drafts, [m.order if d else 0 for m, d in zip(matches, drafts)], params,
                                self.vocab_size, batch.cache.lengths.device)

    # -- trees ---------------------------------------------------------------------------------
    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        trees, matches, drafted = [], [], []
        for b, seq in enumerate(batch.seqs):
            m = self.match(seq)
            matches.append(m)
            budget = m.budget(shape.size)
            if params.greedy[b]:
                tree = frequency_tree(seq.out[-1], m.continuations or [], budget)
            else:
                tree = path_tree(seq.out[-1], scored_path(m.continuations or [], budget), self.vocab_size,
                                 batch.cache.lengths.device)
            trees.append(tree)
            drafted.append(tree.size)
        self.cache.note(matches, drafted)
        self.mark_drafted(batch)
        return trees

    def mark_drafted(self, batch: Batch) -> None:
        """This round's drafts are the suffix drafter's, for every row (what `after_verify` counts)."""
        for seq in batch.seqs:
            seq.draft_memo[SOURCE].drafted_at = len(seq.tokens)

    def after_verify(self, batch: Batch, verdict) -> None:
        """Counts the drafts accepted in rows it drafted this round: in front of a model (`FrontDrafter`) the
        verdicts of the model's rounds reach it too, and those drafts are not the suffix cache's."""
        accepted = 0
        for seq, n in zip(batch.seqs, verdict.n_accepted.tolist()):
            state = seq.draft_memo.get(SOURCE)
            if state is not None and state.drafted_at == len(seq.tokens):  # the row has not moved on since
                accepted += n
        self.cache.note_accepted(accepted)

    def probe(self, batch: Batch, k: int) -> Callable[[], object]:
        seq = batch.seqs[0]
        return lambda: self.match(seq)


# -- drafts from continuations --------------------------------------------------------------------
class _Trie:
    __slots__ = ("count", "kids")

    def __init__(self):
        self.count, self.kids = 0, {}


def _trie(continuations: list[list[int]], depth: int) -> _Trie:
    root = _Trie()
    for cont in continuations:
        node = root
        node.count += 1
        for t in cont[:depth]:
            kid = node.kids.get(t)
            if kid is None:
                kid = node.kids[t] = _Trie()
            kid.count += 1
            node = kid
    return root


def best_path(continuations: list[list[int]] | None, budget: int) -> list[int]:
    """The most frequent continuation, token by token, while its estimated probability stays >= MIN_PROB."""
    return [token for token, _ in scored_path(continuations, budget)]


def scored_path(continuations: list[list[int]] | None, budget: int) -> list[tuple[int, float]]:
    """`best_path` with each token's estimated probability given the ones before (child over parent count)."""
    if not continuations or budget <= 0:
        return []
    node, prob, out = _trie(continuations, budget), 1.0, []
    while node.kids and len(out) < budget:
        token, kid = max(node.kids.items(), key=lambda kv: kv[1].count)  # ties: the most recent occurrence's
        prob *= kid.count / node.count
        if prob < MIN_PROB:
            break
        out.append((token, kid.count / node.count))
        node = kid
    return out


def frequency_tree(root: int, continuations: list[list[int]], budget: int) -> DraftTree:
    """The continuation tree of at most `budget` nodes, most probable nodes first (SuffixDecoding's
    scoring: a node's probability is the product of child count over parent count along its path)."""
    tree = DraftTree([root])
    if not continuations or budget <= 0:
        return tree
    trie = _trie(continuations, budget)
    heap = [(-kid.count / trie.count, i, 0, token, kid) for i, (token, kid) in enumerate(trie.kids.items())]
    heapq.heapify(heap)
    order = len(heap)
    while heap and tree.size < budget:
        neg, _, parent, token, node = heapq.heappop(heap)
        prob = -neg
        if prob < MIN_PROB:
            break
        rank = len(tree.children.get(parent, []))
        here = tree.add(parent, token, math.log(prob) - tree.score[parent], rank)
        for t, kid in node.kids.items():
            order += 1
            heapq.heappush(heap, (-prob * kid.count / node.count, order, here, t, kid))
    return tree


def path_tree(root: int, path: list[tuple[int, float]], vocab: int, device) -> DraftTree:
    """A tree that is one path, each node's q the point mass at its only child: exact under the sampled tree rule.
    Node scores are the path's estimated log-probabilities (what sizes the tree, never what is accepted)."""
    tree, node = DraftTree([root]), 0
    for token, prob in path:
        tree.q[node] = torch.zeros(vocab, device=device)
        tree.q[node][token] = 1.0
        node = tree.add(node, token, math.log(prob), 0)
    return tree


__all__ = ["GlobalSuffixCache", "SuffixDrafter", "SuffixIndex"]
