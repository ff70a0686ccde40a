"""Prometheus metrics of `specc serve` (prometheus_client, one registry per server).

Names follow vLLM's with the prefix `specc:` instead of `vllm:`, so dashboards written for
vLLM work after a prefix swap; the speculation counters are vLLM's spec_decode_* counters.
"""
from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..runtime.record import RoundRecord

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
RATE_WINDOW_S = 10.0
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self, k_max: int, max_batch: int):
        r = self.registry = CollectorRegistry()
        self.request_latency = Histogram("specc:e2e_request_latency_seconds", "time from request to its last token",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specc:time_to_first_token_seconds", "time from request to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specc:inter_token_latency_seconds", "time between a request's successive tokens "
                             "(a round that yields several tokens counts its time once per token)",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specc:prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("specc:generation_tokens", "tokens generated", registry=r)
        self.tokens_per_second = Gauge("specc:generation_tokens_per_second",
                                       "tokens generated per second over the last 10 seconds", registry=r)
        self.waiting = Gauge("specc:num_requests_waiting", "sequences queued for a batch row", registry=r)
        self.running = Gauge("specc:num_requests_running", "sequences in the running batch", registry=r)
        self.batch_size = Histogram("specc:batch_size", "rows in each decode round",
                                    buckets=sorted({1, 2, 4, 8, 16, 32, 64, 128, max_batch}), registry=r)
        self.success = Counter("specc:request_success", "finished requests", ["finished_reason"], registry=r)
        self.errors = Counter("specc:request_errors", "requests answered with an error", ["status"], registry=r)
        self.drafts = Counter("specc:spec_decode_num_drafts", "rows that were given drafts to verify", registry=r)
        self.draft_tokens = Counter("specc:spec_decode_num_draft_tokens", "draft tokens verified", registry=r)
        self.accepted_tokens = Counter("specc:spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("specc:spec_decode_num_accepted_tokens_per_pos",
                                        "draft tokens accepted at each draft position (0 = first)", ["position"],
                                        registry=r)
        for pos in range(k_max):  # every position exported from the start, at 0 (k auto may not draft at first)
            self.accepted_per_pos.labels(position=str(pos))
        self.k = Histogram("specc:spec_decode_k", "draft tokens asked for per round (0: plain decoding)",
                           buckets=tuple(range(k_max + 1)), registry=r)
        self.prefix_queries = Counter("specc:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("specc:prefix_cache_hits", "prompt tokens found in the prefix cache (their "
                                   "prefill skipped)", registry=r)
        self.prefix_bytes = Gauge("specc:prefix_cache_bytes", "bytes of KV the prefix cache holds", registry=r)
        self.prefix_budget = Gauge("specc:prefix_cache_budget_bytes", "the prefix cache's budget (--prefix-cache-mb)",
                                   registry=r)
        self._prefix_seen: tuple[int, int, int] = (0, 0, 0)  # (cache id, queries, hits) already counted
        self._window: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def watch_suffix(self, cache) -> None:
        """Export a suffix drafter's global cache (runtime/drafters/suffix.py `GlobalSuffixCache`): its size
        and how drafting from it went since the model loaded, read at each scrape."""
        for key, name, doc in (
            ("tokens", "specc:suffix_cache_tokens", "tokens of earlier outputs held in the suffix cache"),
            ("bytes", "specc:suffix_cache_bytes", "estimated memory of the suffix cache's index"),
            ("requests", "specc:suffix_cache_requests", "earlier outputs (requests, warm-up texts) in the suffix cache"),
            ("evicted", "specc:suffix_cache_evicted", "outputs evicted from the suffix cache (least recently matched)"),
            ("lookups", "specc:suffix_lookups", "row lookups of the suffix drafter"),
            ("hits", "specc:suffix_hits", "row lookups that found a continuation"),
            ("mean_match_length", "specc:suffix_mean_match_length", "mean length of the matched context, in tokens"),
            ("drafted", "specc:suffix_draft_tokens", "tokens the suffix drafter proposed"),
            ("tokens_per_pass", "specc:suffix_tokens_per_pass",
             "tokens per target pass of rows the suffix drafter drafted for (accepted drafts + 1)"),
        ):
            Gauge(name, doc, registry=self.registry).set_function(lambda key=key: cache.metrics()[key])

    def observe_round(self, record: RoundRecord, waiting: int) -> None:
        """One decode round of the engine (engine thread)."""
        self.batch_size.observe(len(record.rows))
        self.running.set(len(record.rows))
        self.waiting.set(waiting)
        self.k.observe(record.k)
        for d, n in zip(record.drafted, record.accepted):
            if d:
                self.drafts.inc()
                self.draft_tokens.inc(d)
                self.accepted_tokens.inc(n)
                for pos in range(n):
                    self.accepted_per_pos.labels(position=str(pos)).inc()

    def observe_prefix_cache(self, cache) -> None:
        """Bring the prefix-cache counters up to the cache's own (engine thread; a new cache starts from 0)."""
        seen_id, queries, hits = self._prefix_seen
        if seen_id != id(cache):
            queries = hits = 0
        self.prefix_queries.inc(max(0, cache.queries - queries))
        self.prefix_hits.inc(max(0, cache.hits - hits))
        self._prefix_seen = (id(cache), cache.queries, cache.hits)
        self.prefix_bytes.set(cache.bytes)
        self.prefix_budget.set(cache.budget_bytes)

    def observe_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)
        self._rate(n)

    def idle(self, waiting: int) -> None:
        self.running.set(0)
        self.waiting.set(waiting)
        self._rate(0)

    def _rate(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            if n:
                self._window.append((now, n))
            while self._window and self._window[0][0] < now - RATE_WINDOW_S:
                self._window.popleft()
            self.tokens_per_second.set(sum(c for _, c in self._window) / RATE_WINDOW_S)
