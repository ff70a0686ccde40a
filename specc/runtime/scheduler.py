"""The Scheduler: continuous batching over speculative rounds.

One chain round:  draft k → verify k+1 in one target pass → accept a prefix → commit its KV.
One tree round:   draft a token tree per row → verify every node in one pass → commit the accepted path.
Requests wait in a queue and join the running batch between rounds.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import RequestError
from ..limits import MAX_K
from ..speculation.sampling import probs_from_logits
from ..speculation.tree import TreeShape, accept_tree_greedy, accept_tree_sampled, tree_tensors
from .kv_cache import KVCache
from .state import Batch, Request
from .stats import RunStats
from .step import pad_right

if TYPE_CHECKING:
    from .model import SpecModel


@dataclass
class StreamEvent:
    index: int  # which request
    text: str  # newly released text
    token_ids: list[int]  # newly generated tokens
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    stats: dict | None = None  # the request's speculation stats, on its last event


class Scheduler:
    """Continuous batching: requests wait in a queue and join the running batch between rounds.

    `submit` may be called from any thread; `step` from one thread at a time. Each step
    prefills the waiting requests that fit in max_batch, then runs one round over the batch.
    """

    def __init__(self, model: "SpecModel", speculative: bool = True, k: int | None = None, tree: TreeShape | None = None):
        self.model, self.target, self.drafter = model, model.target, model.drafter
        self.speculative = speculative and model.can_speculate
        if k is not None and tree is not None:
            raise RequestError("give k (chain speculation) or tree, not both")
        if tree is not None and not model.target.step.has_tree_mask:
            raise RequestError("this bundle was compiled for chain speculation; trees need speculation.mode tree in the recipe")
        if tree is not None and not model.drafter.supports_tree:
            raise RequestError(f"{model.draft_label} drafting proposes chains, not trees")
        default_tree = model.tree if k is None else None
        self.tree = (tree or default_tree) if self.speculative else None
        self.k = (model.k if k is None else k) if self.speculative and self.tree is None else 0
        if self.k and not (isinstance(self.k, int) and not isinstance(self.k, bool) and 1 <= self.k <= MAX_K):
            raise RequestError(f"k must be in [1, {MAX_K}] (an integer), got {self.k!r}")
        self.waiting: deque[Request] = deque()
        self.batch: Batch | None = None
        self.stats = RunStats()
        self._lock = threading.Lock()

    def submit(self, request: Request) -> None:
        with self._lock:
            self.waiting.append(request)
            self.stats.requests += 1

    @property
    def lookahead(self) -> int:
        """Most drafted tokens a round adds to a row's cache beyond its pending token."""
        return self.tree.size if self.tree is not None else self.k

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.batch is not None

    def step(self) -> list[StreamEvent]:
        """Admit waiting requests, run one round, return what it generated."""
        start = time.perf_counter()
        events = self._admit()
        if self.batch is not None:
            if self.tree is not None:
                new_tokens = self._tree_round(self.batch)
            elif self.speculative:
                new_tokens = self._speculative_round(self.batch)
            else:
                new_tokens = self._target_round(self.batch)
            events += self._advance(self.batch, new_tokens)
            if not self.batch.seqs:
                self.batch = None
        self.stats.seconds += time.perf_counter() - start
        return events

    @contextmanager
    def _timed(self, what: str):
        start = time.perf_counter()
        yield
        setattr(self.stats, what, getattr(self.stats, what) + time.perf_counter() - start)

    # -- the rounds -----------------------------------------------------------------------
    def prefill(self, requests: list[Request]) -> tuple[Batch, list[list[int]]]:
        """Run the prompts through the target (and drafter); returns their batch and each row's first token."""
        with self._timed("prefill_seconds"):
            ids, lengths = pad_right([r.prompt for r in requests], self.model.device)
            cache = KVCache(self.target.dims, len(requests), self.model.max_context, self.model.device)
            cache.ensure(int(lengths.max()) + self.lookahead + 1)
            batch = Batch(requests, cache)
            verdict = self.target.decide(cache, ids, (lengths - 1)[:, None], batch.params, batch.noise(1)[:, 0])
            cache.commit(verdict.new_k, verdict.new_v, lengths)
            if self.speculative:
                self.drafter.prefill(batch, ids, lengths)
        return batch, [[t] for t in verdict.next_token.tolist()]

    def _target_round(self, batch: Batch) -> list[list[int]]:
        """The baseline: one target pass per token."""
        cache = batch.cache
        cache.ensure(int(cache.lengths.max()) + 1)
        with self._timed("target_seconds"):
            first = torch.zeros_like(cache.lengths)[:, None]
            verdict = self.target.decide(cache, batch.pending[:, None], first, batch.params, batch.noise(1)[:, 0])
        cache.commit(verdict.new_k, verdict.new_v, torch.ones_like(cache.lengths))
        return [[t] for t in verdict.next_token.tolist()]

    def _speculative_round(self, batch: Batch) -> list[list[int]]:
        """Draft k, verify k+1 in one target pass, accept a prefix, commit its KV."""
        k, cache = self.k, batch.cache
        with self._timed("draft_seconds"):
            proposal = self.drafter.propose(batch, k, batch.params)  # may propose fewer than k
        with self._timed("target_seconds"):
            width = proposal.tokens.shape[1]
            cache.ensure(int(cache.lengths.max()) + width + 1)
            ids = torch.cat([batch.pending[:, None], proposal.tokens], dim=1)
            rows = torch.arange(width + 1, device=ids.device).expand(ids.shape[0], -1)
            u = batch.noise(k + 1)  # always k + 1 draws, so a row's noise stream does not depend on the batch
            verdict = self.target.decide(cache, ids, rows, batch.params, u[:, k], proposal, u[:, :width])
        cache.commit(verdict.new_k, verdict.new_v, verdict.n_accepted + 1)
        self.drafter.after_verify(batch, verdict)
        out = []
        for seq, n, d, t, drafted in zip(batch.seqs, verdict.n_accepted.tolist(), proposal.lengths.tolist(),
                                         verdict.next_token.tolist(), proposal.tokens.tolist()):
            seq.stats.record(d, n, proposal.source)
            out.append(drafted[:n] + [t])
        return out

    def _tree_round(self, batch: Batch) -> list[list[int]]:
        """Draft a token tree per row, verify all its nodes in one target pass, commit the accepted path."""
        params, shape, cache = batch.params, self.tree, batch.cache
        with self._timed("draft_seconds"):
            trees = self.drafter.propose_tree(batch, shape, params)
        with self._timed("target_seconds"):
            ids, depth, mask = tree_tensors(trees, first=0, device=cache.lengths.device)
            cache.ensure(int(cache.lengths.max()) + ids.shape[1])
            rows = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
            logits, new_k, new_v = self.target.logits(ids, cache, rows, positions=cache.lengths[:, None] + depth,
                                                      tree_mask=mask)
        u = batch.noise(shape.size + 2)
        probs = None if params.all_greedy else probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
        paths, out = [], []
        for b, tree in enumerate(trees):
            n = tree.size + 1
            if params.greedy[b]:
                path, nxt = accept_tree_greedy(logits[b, :n], tree)
            else:
                path, nxt = accept_tree_sampled(probs[b, :n], tree, u[b])
            paths.append(path)
            batch.seqs[b].stats.record(max(tree.depth), len(path) - 1)
            out.append([tree.tokens[node] for node in path[1:]] + [nxt])
        index, counts = pad_right(paths, cache.lengths.device)
        cache.commit(new_k, new_v, counts, index=index)
        self.drafter.after_verify(batch, None)
        return out

    # -- joining and leaving ----------------------------------------------------------------
    def _admit(self) -> list[StreamEvent]:
        """Prefill waiting requests into free rows; emit their first tokens."""
        with self._lock:
            room = self.model.max_batch - (len(self.batch.seqs) if self.batch else 0)
            requests = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        if not requests:
            return []
        batch, first = self.prefill(requests)
        events = self._advance(batch, first)
        if batch.seqs:
            if self.batch is None:
                self.batch = batch
            else:
                self.batch.extend(batch)
        return events

    def _advance(self, batch: Batch, new_tokens: list[list[int]]) -> list[StreamEvent]:
        """Append each row's new tokens, stop rows at EOS / length / stop strings, emit text."""
        events, keep = [], []
        for b, (seq, toks) in enumerate(zip(batch.seqs, new_tokens)):
            taken = []
            for t in toks:
                if t in self.model.eos_ids:
                    seq.finish_reason = "stop"
                    break
                taken.append(t)
                if len(seq.out) + len(taken) >= seq.max_new_tokens:
                    seq.finish_reason = "length"
                    break
            seq.out.extend(taken)
            self.stats.new_tokens += len(taken)
            text, hit_stop = seq.text.update(seq.out, final=seq.finish_reason is not None)
            if hit_stop:
                seq.finish_reason = "stop"
            done = seq.finish_reason is not None
            if text or taken or done:
                events.append(StreamEvent(seq.index, text, taken, done, seq.finish_reason,
                                          seq.stats.to_dict() if done else None))
            if done:
                self.stats.speculation.merge(seq.stats)
            else:
                keep.append(b)
        if len(keep) < len(batch.seqs):
            batch.keep_rows(keep)
        return events
