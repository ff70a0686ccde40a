"""The Scheduler: continuous batching over speculative rounds.

Requests wait in a queue and join the running batch between rounds. Each step prefills one chunk
of admitted requests (runtime/prefill.py; the prefix cache, runtime/prefix_cache.py, supplies what
it already holds of their prompts) and runs one round over the batch (runtime/rounds.py: plain,
chain or tree), as the planner (runtime/planning.py) decides, then emits each row's new text and
drops rows that finished.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..errors import RequestError
from ..limits import MAX_K, is_probability
from ..speculation.tree import TreeShape
from .engine import Engine
from .host_threads import torch_threads
from .kv_cache import KVCache
from .pacing import Pacing
from .planning import LookaheadGate, Planner, TreeSizer, make_planner
from .prefill import Prefill
from .prefix_cache import BLOCK as PREFIX_BLOCK, copy_blocks
from .record import RoundRecord
from .rounds import chain_round, plain_round, tree_round
from .rules import RowFailure, row_failure
from .state import Batch, Request
from .stats import RunStats


@dataclass
class StreamEvent:
    index: int  # which request
    text: str  # newly released text
    token_ids: list[int]  # newly generated tokens
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "cancelled" (Scheduler.cancel), "error"
    stats: dict | None = None  # the request's speculation stats, on its last event
    logprobs: list | None = None  # per token of token_ids: (token, logprob, [(alternative, logprob)]) when asked
    prompt_logprobs: list | None = None  # on the first event, when asked: the prompt's (the first token's logprob None)
    cached_tokens: int | None = None  # prompt tokens the prefix cache supplied, on the request's first event
    error: RowFailure | None = None  # why the request failed alone (finish_reason "error"): its input or its own
    # processing (runtime/rules.py), not the batch


class Scheduler:
    """Continuous batching: requests wait in a queue and join the running batch between rounds.

    `submit` may be called from any thread; `step` from one thread at a time. Each step
    prefills a chunk of the requests admitted into free rows (up to max_batch), then runs one round
    over the batch.
    """

    def __init__(self, engine: Engine, speculative: bool = True, k: int | str | None = None,
                 tree: TreeShape | None = None, max_batch: int | None = None, stop_below: float | None = None):
        """k: chain length, or "auto" (runtime/adaptive.py picks 0..k_max each round); max_batch: at most
        this many rows (default and upper bound: the bundle's limits.max_batch); stop_below: a row's chain
        ends after a draft the drafter gave a probability below this (default: the recipe's draft.stop_below;
        under k auto, above 0 it turns on early stops at the policy's threshold: a row's chain ends once the
        product of its drafts' probabilities is below what one more draft costs, `AdaptiveK.stop_threshold`)."""
        self.engine, self.target, self.drafter, self.verifier = engine, engine.target, engine.drafter, engine.verifier
        self.max_batch = engine.max_batch if max_batch is None else max_batch
        if not (isinstance(self.max_batch, int) and 1 <= self.max_batch <= engine.max_batch):
            raise RequestError(f"max_batch must be in [1, {engine.max_batch}] (the bundle's limits.max_batch), got {max_batch!r}")
        self.speculative = speculative and engine.can_speculate
        if stop_below is not None and not is_probability(stop_below):
            raise RequestError(f"stop_below must be a probability in [0, 1], got {stop_below!r}")
        self.stop_below = engine.stop_below if stop_below is None else float(stop_below)
        k, self.tree, self.sizer = self._shape(k, tree)
        self.planner = make_planner(engine, k, self.stop_below) if self.speculative and self.tree is None else Planner(0)
        self.k = self.planner.k_max
        self.waiting: deque[Request] = deque()
        self.batch: Batch | None = None
        self.prefilling: Prefill | None = None  # requests admitted whose prompts are still being prefilled
        self.stats = RunStats()
        self.last_round: RoundRecord | None = None  # the latest decode round (adaptive policy, server metrics)
        self.pacing = Pacing()  # a long prompt's chunks beside decoding rows
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()

    def _shape(self, k, tree: TreeShape | None):
        """The rounds asked for, checked against the bundle: (chain k or None, tree or None, the tree's sizer)."""
        engine = self.engine
        tree_only = self.speculative and engine.drafter.method.tree_only
        # lookahead: k auto (asked for, or the recipe's) lets a gate cut rounds that do not pay to plain steps;
        # a tree asked for verifies the drafter's whole tree every round
        gated = tree_only and (k == "auto" or (k is None and tree is None and engine.k == "auto"))
        if tree_only and k is not None:
            if k != "auto":
                raise RequestError(f"k must be 'auto' with {engine.draft_label} drafting (its window sets the tree it "
                                   f"verifies; auto chooses each round between that tree and a plain step), got {k!r}")
            k, tree = None, engine.tree
        if k is not None and tree is not None:
            raise RequestError("give k (chain speculation) or tree, not both")
        if tree is not None and not engine.target.step.has_tree_mask:
            raise RequestError("this bundle was compiled for chain speculation; trees need speculation.mode tree in the recipe")
        if tree is not None and not engine.drafter.method.trees:
            raise RequestError(f"{engine.draft_label} drafting proposes chains, not trees")
        default_tree = engine.tree if k is None else None
        if tree_only:  # the drafter lays out its own tree; the shape only sizes the round's noise
            tree = engine.tree
        tree = (tree or default_tree) if self.speculative else None
        if k is None and tree is None:
            k = engine.k  # the recipe's: an integer or "auto"
        if k is not None and k != "auto" and not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_K):
            raise RequestError(f"k must be an integer in [1, {MAX_K}] or 'auto', got {k!r}")
        # trees whose node scores estimate acceptance are cut to what a verify pass of their width pays
        sizer = TreeSizer(tree.size) if tree is not None and engine.drafter.method.sized_trees else None
        if gated:
            sizer = engine.policy((LookaheadGate,), LookaheadGate)
        return k, tree, sizer

    def submit(self, request: Request) -> None:
        with self._lock:
            self.waiting.append(request)
            self.stats.requests += 1

    def cancel(self, index: int) -> None:
        """Stop request `index` (any thread): it leaves the queue or frees its row at the next step,
        which emits its last event with finish_reason "cancelled". Unknown or finished: no effect."""
        with self._lock:
            self._cancelled.add(index)

    @property
    def policy(self):
        """The adaptive policy choosing this scheduler's k (None for a fixed k or trees)."""
        return self.planner.policy

    @property
    def lookahead(self) -> int:
        """Most drafted tokens a round adds to a row's cache beyond its pending token."""
        return self.tree.size if self.tree is not None else self.k

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.batch is not None or self.prefilling is not None

    def step(self) -> list[StreamEvent]:
        """Prefill the next chunk of admitted requests, then run one round over the batch; return what it generated.

        Waiting requests are admitted when no prefill is under way (runtime/prefill.py). A long prompt
        prefills one chunk per step, and the running batch gets a round after each chunk, so its rows
        keep producing tokens; beside decoding rows the chunks are paced and sized by `Pacing`.
        A step whose prefill finished returns the new rows' first tokens at once (the round follows in
        the next step), so time to first token is the prefill's, not the prefill's plus a round's."""
        with torch_threads(self.engine.host_threads):
            return self._step()

    def _step(self) -> list[StreamEvent]:
        start = time.perf_counter()
        self.last_round = None
        events = self._drop_cancelled()
        if self.prefilling is None:
            self.prefilling = self._admit()
        if self.batch is None:
            self.pacing.idle()
        joined = False
        if self.prefilling is not None and (self.batch is None or self.pacing.due):
            events += self._prefill_chunk()
            joined = self.prefilling is None
        if self.batch is not None and not joined:
            events += self._round(self.batch)
        self.stats.seconds += time.perf_counter() - start
        return events

    def _prefill_chunk(self) -> list[StreamEvent]:
        """One chunk of the prompts being prefilled; once they are done, they join the batch."""
        began = time.perf_counter()
        decoding = self.batch is not None
        size = self.pacing.chunk_size(self.engine.interleave_chunk, self.engine.prefill_chunk) if decoding \
            else self.engine.prefill_chunk
        entered = sum(self.prefilling.entered)
        self.prefilling.step(size)
        spent = time.perf_counter() - began
        self.stats.prefill_seconds += spent
        if decoding:
            self.pacing.chunk_ran(spent, sum(self.prefilling.entered) - entered)
        if not self.prefilling.done:
            return []
        events = self._join(self.prefilling)
        self.prefilling = None
        return events

    def _round(self, batch: Batch) -> list[StreamEvent]:
        """One round over the batch, of the kind the planner decides; its record, statistics and events."""
        start = time.perf_counter()
        if self.tree is not None:
            record = tree_round(batch, self.drafter, self.verifier, self.tree, self.sizer)
        else:
            plan = self.planner.plan(batch)
            record = (chain_round(batch, self.drafter, self.verifier, plan) if plan.k else
                      plain_round(batch, self.verifier, self.drafter if self.speculative else None))
            record.arm = plan.arm or record.arm
        seconds = time.perf_counter() - start
        record.rows, record.seconds = [s.index for s in batch.seqs], seconds - record.catch_up_seconds
        self.planner.observe(record)
        if self.sizer is not None:
            self.sizer.observe(record)
        self.last_round = record
        self.pacing.round_ran(seconds)
        self._account(batch, record, drafting=self.tree is not None or record.k > 0)
        events = self._advance(batch, record.tokens, record.logprobs)
        if not batch.seqs:
            self.batch = None
        return events

    def _account(self, batch: Batch, record: RoundRecord, drafting: bool) -> None:
        """Add a round's figures to each row's and the run's statistics (plain rounds are not speculation's)."""
        self.stats.rounds_by_k[record.k] = self.stats.rounds_by_k.get(record.k, 0) + 1
        self.stats.draft_seconds += record.draft_seconds
        self.stats.target_seconds += record.target_seconds
        self.stats.prefill_seconds += record.catch_up_seconds  # a draft model's lazy prefill
        if drafting:
            for seq, d, n in zip(batch.seqs, record.drafted, record.accepted):
                seq.stats.record(d, n, record.front)

    def prefill(self, requests: list[Request]) -> tuple[Batch, list[list[int]]]:
        """Run the prompts through the target (and drafter) at once; returns their batch and each row's first token."""
        start = time.perf_counter()
        prefill = self._start_prefill(requests)
        prefill.run()
        batch = self._finish_prefill(prefill)
        self.stats.prefill_seconds += time.perf_counter() - start
        return batch, [[t] for t in prefill.next_token]

    def _start_prefill(self, requests: list[Request]) -> Prefill:
        """A batch for these requests whose cache starts with what the prefix cache holds of each prompt."""
        cache = KVCache(self.target.dims, len(requests), self.engine.max_context, self.engine.device)
        echo = any(r.rule is not None and r.rule.rules.prompt_logprobs for r in requests)
        prefix = self.engine.prefix_cache if self._prefix_cache_usable and not echo else None  # echo reads every prompt row
        found = [prefix.match(r.prompt, r.cache_domain) if prefix is not None else [] for r in requests]
        # room for the cached prefixes only: each chunk grows the cache by what it enters (Prefill.step), as the
        # graphs attend over the whole capacity and a cache sized for the whole prompt would tax every chunk
        cache.ensure(max(len(blocks) for blocks in found) * PREFIX_BLOCK + 1)
        for b, (r, blocks) in enumerate(zip(requests, found)):
            r.cached_tokens = copy_blocks(blocks, cache, b)
        cached = [r.cached_tokens for r in requests]
        cache.lengths[:] = torch.tensor(cached, dtype=torch.long)
        return Prefill(self.verifier, Batch(requests, cache), self.engine.prefill_chunk, cached)

    def _finish_prefill(self, prefill: Prefill) -> Batch:
        """Hand the prefilled prompts to the drafter and the prefix cache."""
        batch = prefill.batch
        if self.speculative:
            ids, lengths = prefill.prompt_tensors()
            self.drafter.prefill(batch, ids, lengths, prefill.verdict())
        self._store_prefixes(batch, range(len(batch.seqs)))
        return batch

    @property
    def _prefix_cache_usable(self) -> bool:
        return self.engine.prefix_cache.enabled and not (self.speculative and self.drafter.method.prompt_features)

    def _store_prefixes(self, batch: Batch, rows) -> None:
        """Offer these rows' committed KV (prompt and generated tokens) to the prefix cache."""
        if self._prefix_cache_usable:
            for b in rows:
                n = int(batch.cache.lengths[b])
                seq = batch.seqs[b]
                self.engine.prefix_cache.store(seq.tokens[:n], batch.cache.k[:, b, :, :n], batch.cache.v[:, b, :, :n],
                                              seq.cache_domain)

    # -- joining and leaving ----------------------------------------------------------------
    def _finished(self, seq: Request) -> None:
        """Tell the drafter a request is done (a drafter that learns from outputs takes its last tokens)."""
        if self.speculative:
            self.drafter.finished(seq)

    def _drop_cancelled(self) -> list[StreamEvent]:
        """Remove cancelled requests from the queue and their rows from the batch."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            if self.prefilling is not None:  # rows being prefilled leave once they join the batch
                held = {s.index for s in self.prefilling.batch.seqs} & cancelled
                cancelled, self._cancelled = cancelled - held, held
            gone = [s for s in self.waiting if s.index in cancelled]
            self.waiting = deque(s for s in self.waiting if s.index not in cancelled)
        if cancelled and self.batch is not None:
            running = [s for s in self.batch.seqs if s.index in cancelled]
            for seq in running:
                self.stats.speculation.merge(seq.stats)
                self._finished(seq)
            keep = [b for b, s in enumerate(self.batch.seqs) if s.index not in cancelled]
            if not keep:
                self.batch = None
            elif running:
                self.batch.keep_rows(keep)
            gone += running
        return [StreamEvent(s.index, "", [], True, "cancelled", s.stats.to_dict()) for s in gone]

    def _admit(self) -> Prefill | None:
        """Start prefilling waiting requests into free rows: several short prompts together (one pass),
        or one prompt longer than a prefill chunk alone (its chunks interleave with the batch's rounds)."""
        with self._lock:
            room = self.max_batch - (len(self.batch.seqs) if self.batch else 0)
            requests = []
            while self.waiting and len(requests) < room:
                long = len(self.waiting[0].prompt) > self.engine.prefill_chunk
                if long and requests:
                    break
                requests.append(self.waiting.popleft())
                if long:
                    break
        return self._start_prefill(requests) if requests else None

    def _join(self, prefill: Prefill) -> list[StreamEvent]:
        """Prefilled rows emit their first tokens and join the running batch."""
        batch = self._finish_prefill(prefill)
        cached = {s.index: s.cached_tokens for s in batch.seqs}
        events = self._advance(batch, [[t] for t in prefill.next_token], prefill.logprobs, prefill.prompt_logprobs)
        for ev in events:
            ev.cached_tokens = cached.get(ev.index)
        if batch.seqs:
            if self.batch is None:
                self.batch = batch
            else:
                self.batch.extend(batch)
        return events

    def _advance(self, batch: Batch, new_tokens: list[list[int]], logprobs: list | None = None,
                 prompt_logprobs: list | None = None) -> list[StreamEvent]:
        """Append each row's new tokens, stop rows at EOS / length / stop strings, emit text (and the
        logprobs of rows that asked)."""
        events, keep = [], []
        for b, (seq, toks) in enumerate(zip(batch.seqs, new_tokens)):
            failure = seq.rule.failure if seq.rule is not None else None  # its rules failed in this round
            if failure is None:
                try:
                    text, taken = self._take(seq, toks)
                except Exception as exc:  # its own detokenising, stop strings or grammar: it fails alone
                    failure = row_failure(exc)
            if failure is not None:  # nothing of this round is its: its rules did not hold
                text, taken = "", []
                seq.finish_reason, seq.error = "error", failure
            self.stats.new_tokens += len(taken)
            done = seq.finish_reason is not None
            if text or taken or done:
                events.append(StreamEvent(seq.index, text, taken, done, seq.finish_reason,
                                          seq.stats.to_dict() if done else None,
                                          logprobs[b][:len(taken)] if logprobs and logprobs[b] is not None else None,
                                          prompt_logprobs[b] if prompt_logprobs else None, error=seq.error))
            if done:
                self.stats.speculation.merge(seq.stats)
                if failure is None:  # a failed row's cache may hold tokens its rules did not choose
                    self._store_prefixes(batch, [b])
                self._finished(seq)
            else:
                keep.append(b)
        if len(keep) < len(batch.seqs):
            batch.keep_rows(keep)
        return events

    def _take(self, seq: Request, toks: list[int]) -> tuple[str, list[int]]:
        """Append a row's new tokens up to EOS, its length or a stop string, and advance its grammar over them;
        the text they release and the tokens kept."""
        taken, eos = [], False
        for t in toks:
            if t in self.engine.eos_ids:
                seq.finish_reason, eos = "stop", True
                break
            taken.append(t)
            if len(seq.out) + len(taken) >= seq.max_new_tokens:
                seq.finish_reason = "length"
                break
        before = len(seq.out)
        seq.out.extend(taken)
        text, hit_stop = seq.text.update(seq.out, final=seq.finish_reason is not None)
        if hit_stop:  # the row ends at the token that completed the stop string, as target-only's would
            seq.finish_reason = "stop"
            del seq.out[seq.text.stop_end(seq.out, before + 1):]
            taken = seq.out[before:]
        if seq.rule is not None and (error := seq.rule.commit(taken, eos)) is not None:
            seq.finish_reason, seq.error = "error", error  # this request fails; the batch goes on
        return text, taken
