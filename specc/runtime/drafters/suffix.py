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
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ...speculation.sampling import RowParams
from ...speculation.tree import DraftTree, TreeShape
from ..state import Batch, Request
from .base import DraftContext, DraftInfo, DraftPlan, Drafter, Proposal

ORDERS = (8, 4, 2, 1)  # n-gram lengths indexed, longest first: a draft uses the longest that occurs
MAX_MATCH = 32  # a match is measured back at most this far
MAX_OCCURRENCES = 16  # most recent occurrences counted per lookup and index
MIN_PROB = 0.1  # a draft token's estimated probability (count share along its path) must reach this
SPEC_FACTOR, SPEC_OFFSET = 1.0, 1.0  # drafts per round <= factor * match length + offset
MAX_DEPTH = 64  # longest continuation read from one occurrence
SOURCE = "suffix"  # Proposal.source of suffix rounds
# in front of a model, a row counts as found from a match this long: a one-token match drafts what the
# context happened to hold after that token, which a model drafts better
MIN_FRONT_MATCH = 2
_SEQ_SHIFT = 32  # an occurrence is one int: sequence id << 32 | position


class SuffixIndex:
    """Token sequences by id and, for every position, the n-grams (ORDERS) that end there.

    `index[ngram]` lists occurrences as ints (seq id << 32 | position of the n-gram's last token), oldest
    first. Removing a sequence leaves its occurrences in the lists (skipped on lookup) until they outnumber
    the live ones, when the index is rebuilt: memory stays within twice what the live tokens need."""

    def __init__(self, orders: tuple[int, ...] = ORDERS):
        self.orders = orders
        self.seqs: dict[int, list[int]] = {}
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.live = self.dead = 0  # occurrences of live and of removed sequences
        self.bytes = sys.getsizeof(self.index)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.seqs.values())

    def add(self, sid: int, tokens: Iterable[int]) -> None:
        """Append tokens to sequence sid (a new one if unknown)."""
        seq = self.seqs.setdefault(sid, [])
        start = len(seq)
        seq.extend(tokens)
        self._index(sid, seq, start)

    def _index(self, sid: int, seq: list[int], start: int) -> None:
        index, base = self.index, sid << _SEQ_SHIFT
        for i in range(start, len(seq)):
            for n in self.orders:
                if i + 1 >= n:
                    key = tuple(seq[i + 1 - n:i + 1])
                    hits = index.get(key)
                    if hits is None:
                        index[key] = hits = []
                        self.bytes += sys.getsizeof(key) + 56 + 8 * n
                    hits.append(base | i)
                    self.bytes += 40  # a list slot and the int it holds
                    self.live += 1
        self.bytes += 8 * (len(seq) - start)

    def remove(self, sid: int) -> None:
        seq = self.seqs.pop(sid, None)
        if seq is None:
            return
        gone = sum(max(0, len(seq) - n + 1) for n in self.orders)
        self.live -= gone
        self.dead += gone
        self.bytes -= 8 * len(seq)
        if self.dead > self.live:
            self._rebuild()

    def _rebuild(self) -> None:
        self.index, self.live, self.dead, self.bytes = {}, 0, 0, sys.getsizeof({})
        for sid, seq in self.seqs.items():
            self._index(sid, seq, 0)
            self.bytes -= 8 * len(seq)  # _index counted the tokens again
        self.bytes += 8 * self.tokens

    def occurrences(self, key: tuple[int, ...], skip: int | None = None) -> list[tuple[int, int]]:
        """Up to MAX_OCCURRENCES (seq id, position after the n-gram) with a continuation, latest first."""
        hits, out = self.index.get(key), []
        if not hits:
            return out
        mask = (1 << _SEQ_SHIFT) - 1
        for code in reversed(hits):
            sid, i = code >> _SEQ_SHIFT, code & mask
            seq = self.seqs.get(sid)
            if seq is None or sid == skip or i + 1 >= len(seq):
                continue
            out.append((sid, i + 1))
            if len(out) == MAX_OCCURRENCES:
                break
        return out


def _match_length(seq: list[int], end: int, context: list[int], n: int) -> int:
    """How many tokens before seq[end] equal the context's last ones (at least n, known; at most MAX_MATCH)."""
    m, top = n, min(MAX_MATCH, end + 1, len(context))
    while m < top and seq[end - m] == context[-m - 1]:
        m += 1
    return m


@dataclass
class Match:
    """What a lookup found for one row: the n-gram order matched (0: nothing), the longest match, and the
    continuations of its occurrences (token lists, most recent first)."""

    order: int = 0
    length: int = 0
    continuations: list[list[int]] | None = None

    def budget(self, most: int) -> int:
        """Drafts this match allows: factor * match length + offset, at most `most`."""
        if not self.order:
            return 0
        return max(0, min(most, int(SPEC_FACTOR * self.length + SPEC_OFFSET)))


class GlobalSuffixCache:
    """The outputs of a model's last requests (and warm-up texts), for every later request to draft from.

    Bounded by max_requests sequences and max_tokens tokens: adding past either evicts the least recently
    used sequence (a sequence is used when a draft matched it); a single sequence past max_tokens stops
    growing. Every method takes the lock: generate calls in threads and the server share one cache."""

    def __init__(self, max_requests: int, max_tokens: int, vocab_size: int | None = None, orders: tuple[int, ...] = ORDERS):
        self.max_requests, self.max_tokens, self.vocab_size = max_requests, max_tokens, vocab_size
        self.index = SuffixIndex(orders)
        self.lru: OrderedDict[int, int] = OrderedDict()  # seq id -> tokens held, least recently used first
        self.tokens = 0
        self.next_id = 1
        self.evicted = 0
        self.lock = threading.Lock()
        # drafting figures for the server's metrics (all requests since load)
        self.lookups = self.hits = self.match_tokens = 0
        self.rounds = self.drafted = self.accepted = 0
        self.warmed: list[list[int]] = []  # what warm() added, which reset() restores

    def open(self) -> int:
        """A new sequence id (a request's output, or a warm-up text)."""
        with self.lock:
            sid, self.next_id = self.next_id, self.next_id + 1
            return sid

    def add(self, sid: int, tokens: list[int]) -> None:
        """Append tokens to sequence sid, evicting the least recently used others past the limits."""
        if not tokens or not self.max_requests or not self.max_tokens:
            return
        with self.lock:
            if sid not in self.lru:
                self.lru[sid] = 0
                while len(self.lru) > self.max_requests:
                    self._evict_oldest(sid)
            room = self.max_tokens - self.lru[sid]
            tokens = tokens[:max(0, room)]
            while tokens and self.tokens + len(tokens) > self.max_tokens and self._evict_oldest(sid):
                pass
            tokens = tokens[:max(0, self.max_tokens - self.tokens)]
            if tokens:
                self.index.add(sid, tokens)
                self.lru[sid] += len(tokens)
                self.tokens += len(tokens)

    def _evict_oldest(self, keep: int) -> bool:
        for sid in self.lru:
            if sid != keep:
                self.tokens -= self.lru.pop(sid)
                self.index.remove(sid)
                self.evicted += 1
                return True
        return False

    def lookup(self, key: tuple[int, ...], skip: int | None) -> list[tuple[list[int], int]]:
        """(sequence, position) of the key's latest occurrences outside sequence `skip`; marks them used."""
        with self.lock:
            found = self.index.occurrences(key, skip)
            for sid, _ in found:
                self.lru.move_to_end(sid)
            # the lists are copied: a later eviction or append must not change a draft being read
            return [(self.index.seqs[sid][max(0, i - MAX_MATCH - 1):i + MAX_DEPTH], min(i, MAX_MATCH + 1))
                    for sid, i in found]

    def note(self, matches: list[Match], drafted: list[int]) -> None:
        with self.lock:
            self.lookups += len(matches)
            self.hits += sum(1 for m in matches if m.order)
            self.match_tokens += sum(m.length for m in matches if m.order)
            self.rounds += sum(1 for d in drafted if d)
            self.drafted += sum(drafted)

    def note_accepted(self, n: int) -> None:
        with self.lock:
            self.accepted += n

    def metrics(self) -> dict:
        """Figures for /metrics: the cache's size, and how drafting from it went since load."""
        with self.lock:
            return {"requests": len(self.lru), "tokens": self.tokens, "bytes": self.index.bytes,
                    "max_requests": self.max_requests, "max_tokens": self.max_tokens, "evicted": self.evicted,
                    "lookups": self.lookups, "hits": self.hits,
                    "mean_match_length": self.match_tokens / self.hits if self.hits else 0.0,
                    "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                    "tokens_per_pass": (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0}

    def warm(self, texts: list[list[int]]) -> int:
        """Add earlier outputs (token lists), each as its own sequence; returns the tokens added. Ids outside
        the vocabulary are dropped: a tokenizer may know ids the model has no embedding for, and drafted they
        would fail the target pass."""
        before, vocab = self.tokens, self.vocab_size
        for tokens in texts:
            tokens = [int(t) for t in tokens if vocab is None or 0 <= t < vocab]
            self.warmed.append(tokens)
            self.add(self.open(), tokens)
        return self.tokens - before

    def reset(self) -> None:
        """Forget every request's output, keeping what warm() added (a benchmark runs each system on a cache
        that has not seen the same prompts' outputs)."""
        with self.lock:
            self.index, self.lru, self.tokens = SuffixIndex(self.index.orders), OrderedDict(), 0
        for tokens in self.warmed:
            self.add(self.open(), tokens)


class RowSuffix:
    """What the drafter keeps for one request (on `Request.draft_memo`): its own index over prompt and
    output, its sequence in the global cache, and how much of each it has taken in."""

    def __init__(self, cache: GlobalSuffixCache):
        self.local = SuffixIndex()
        self.sid = cache.open()
        self.taken = 0  # tokens of the request in the local index
        self.shared = 0  # output tokens in the global cache

    def sync(self, seq: Request, cache: GlobalSuffixCache) -> None:
        tokens = seq.tokens
        if len(tokens) > self.taken:
            self.local.add(0, tokens[self.taken:])
            self.taken = len(tokens)
        if len(seq.out) > self.shared:
            cache.add(self.sid, seq.out[self.shared:])
            self.shared = len(seq.out)


class SuffixDrafter(Drafter):
    """Drafts from the request's own suffix index and the model's global cache (recipe draft.method suffix)."""

    kind = "suffix"
    cost = "lookup"

    def __init__(self, cache: GlobalSuffixCache, vocab_size: int):
        self.cache, self.vocab_size = cache, vocab_size
        self.source = SOURCE

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
                length = max(length, _match_length(seq_tokens, i - 1, context, n))
                conts.append(seq_tokens[i:i + MAX_DEPTH])
            return Match(n, length, conts)
        return Match()

    def finds(self, batch: Batch) -> list[int]:
        """Per row the n-gram order matched where the match drafts at least one token, else 0."""
        return [m.order if m.order and best_path(m.continuations, 1) else 0 for m in map(self.match, batch.seqs)]

    def sure(self, batch: Batch) -> bool:
        """Every row has a match of at least MIN_FRONT_MATCH tokens that drafts: the suffix drafter takes
        the round in front of a model."""
        return all(m.length >= MIN_FRONT_MATCH and best_path(m.continuations, 1) for m in map(self.match, batch.seqs))

    # -- chains --------------------------------------------------------------------------------
    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        matches = [self.match(s) for s in batch.seqs]
        drafts = [best_path(m.continuations, m.budget(plan.k)) if m.order else [] for m in matches]
        self.cache.note(matches, [len(d) for d in drafts])
        return one_hot_proposal(drafts, [m.order if d else 0 for m, d in zip(matches, drafts)], params,
                                self.vocab_size, batch.cache.lengths.device, self.source)

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
                tree = path_tree(seq.out[-1], best_path(m.continuations or [], budget), self.vocab_size,
                                 batch.cache.lengths.device)
            trees.append(tree)
            drafted.append(tree.size)
        self.cache.note(matches, drafted)
        return trees

    def after_verify(self, batch: Batch, verdict) -> None:
        self.cache.note_accepted(int(verdict.n_accepted.sum()))

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
    if not continuations or budget <= 0:
        return []
    node, prob, out = _trie(continuations, budget), 1.0, []
    while node.kids and len(out) < budget:
        token, kid = max(node.kids.items(), key=lambda kv: kv[1].count)  # ties: the most recent occurrence's
        prob *= kid.count / node.count
        if prob < MIN_PROB:
            break
        out.append(token)
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


def path_tree(root: int, path: list[int], vocab: int, device) -> DraftTree:
    """A tree that is one path, each node's q the point mass at its only child: exact under the sampled tree rule."""
    tree, node = DraftTree([root]), 0
    for token in path:
        tree.q[node] = torch.zeros(vocab, device=device)
        tree.q[node][token] = 1.0
        node = tree.add(node, token, 0.0, 0)
    return tree


def one_hot_proposal(drafts: list[list[int]], classes: list[int], params: RowParams, vocab: int, device,
                     source: str) -> Proposal:
    """Rows' drafts as a Proposal: tokens right-padded, one-hot q for sampled rows, each row's class."""
    width = max((len(d) for d in drafts), default=0)
    tokens = torch.zeros(len(drafts), width, dtype=torch.long, device=device)
    for b, d in enumerate(drafts):
        tokens[b, :len(d)] = torch.tensor(d, dtype=torch.long)
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=device)
    q = None
    if not params.all_greedy:
        q = torch.zeros(len(drafts), width, vocab, device=device).scatter_(-1, tokens[..., None], 1.0)
    return Proposal(tokens, q, lengths, source, DraftInfo(classes=classes))


class SuffixFirstDrafter(Drafter):
    """The suffix drafter first, another drafter (a draft model, early exit, EAGLE) where it finds nothing
    (recipe draft.suffix: true), as prompt lookup in front of one (`LookupFirstDrafter`).

    A round in which every row finds a continuation from a match of at least MIN_FRONT_MATCH tokens is
    drafted from the suffix indexes alone; otherwise the other drafter drafts for the whole batch. The choice depends only on the contexts and the indexes,
    never on this round's noise, and each round's q is what its drafts were drawn from: exact."""

    def __init__(self, suffix: SuffixDrafter, model: Drafter):
        self.suffix, self.model = suffix, model
        self.kind, self.method, self.lazy_prefill = model.kind, model.method, model.lazy_prefill
        self.cache = suffix.cache

    @property
    def arms(self) -> dict[str, Drafter]:
        """"model": the other drafter for every row; "suffix": the suffix drafter alone (rows it misses get
        no drafts, no model call)."""
        return {"model": self.model, SOURCE: self.suffix}

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor, verdict) -> None:
        self.model.prefill(batch, ids, lengths, verdict)

    def behind(self, batch: Batch) -> list[int]:
        if self.suffix.sure(batch):
            return [0] * len(batch.seqs)
        return self.model.behind(batch)

    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        if self.suffix.sure(batch):
            return self.suffix.propose(batch, params, plan)
        return self.model.propose(batch, params, plan)

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        if self.suffix.sure(batch):
            return self.suffix.propose_tree(batch, shape, params)
        return self.model.propose_tree(batch, shape, params)

    def after_verify(self, batch: Batch, verdict) -> None:
        self.model.after_verify(batch, verdict)

    def finished(self, seq: Request) -> None:
        self.suffix.finished(seq)
        self.model.finished(seq)

    def close(self) -> None:
        self.model.close()


def suffix_cache_of(drafter: Drafter | None) -> GlobalSuffixCache | None:
    """The global suffix cache a model's drafter drafts from, if it has one."""
    return getattr(drafter, "cache", None) if isinstance(drafter, (SuffixDrafter, SuffixFirstDrafter)) else None


__all__ = ["GlobalSuffixCache", "SuffixDrafter", "SuffixFirstDrafter", "SuffixIndex", "suffix_cache_of"]
