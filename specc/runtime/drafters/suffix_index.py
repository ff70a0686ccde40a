"""The indexes suffix decoding drafts from (runtime/drafters/suffix.py): n-grams of a few orders mapped to
where they occurred, per request (`SuffixIndex`, `RowSuffix`) and shared by a model's requests
(`GlobalSuffixCache`, bounded in requests and tokens, least recently matched evicted first, behind one lock)."""
from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

from ..state import Request

ORDERS = (8, 4, 2, 1)  # n-gram lengths indexed, longest first: a draft uses the longest that occurs
MAX_MATCH = 32  # a match is measured back at most this far
MAX_OCCURRENCES = 16  # most recent occurrences counted per lookup and index
MIN_PROB = 0.1  # a draft token's estimated probability (count share along its path) must reach this
SPEC_FACTOR, SPEC_OFFSET = 1.0, 1.0  # drafts per round <= factor * match length + offset
MAX_DEPTH = 64  # longest continuation read from one occurrence
SOURCE = "suffix"  # its Request.draft_memo key
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


def match_length(seq: list[int], end: int, context: list[int], n: int) -> int:
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
        self.drafted_at = -1  # the request's length when the drafter last drafted for it (whose verdict is its own)

    def sync(self, seq: Request, cache: GlobalSuffixCache) -> None:
        tokens = seq.tokens
        if len(tokens) > self.taken:
            self.local.add(0, tokens[self.taken:])
            self.taken = len(tokens)
        if len(seq.out) > self.shared:
            cache.add(self.sid, seq.out[self.shared:])
            self.shared = len(seq.out)
