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
from ..limits import MAX_K, auto_k_max, is_probability
from ..speculation.sampling import probs_from_logits
from ..speculation.tree import TreeShape, accept_tree_greedy, accept_tree_sampled, rerank, tree_tensors
from .adaptive import MIN_GAIN_LAZY_PREFILL, AdaptiveK, RoundRecord
from .kv_cache import KVCache
from .state import Batch, Request
from .stats import RunStats
from .step import pad_right
from .target import Verdict

if TYPE_CHECKING:
    from .drafters.base import Proposal
    from .model import SpecModel


@dataclass
class StreamEvent:
    index: int  # which request
    text: str  # newly released text
    token_ids: list[int]  # newly generated tokens
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", or "cancelled" (Scheduler.cancel)
    stats: dict | None = None  # the request's speculation stats, on its last event


class Scheduler:
    """Continuous batching: requests wait in a queue and join the running batch between rounds.

    `submit` may be called from any thread; `step` from one thread at a time. Each step
    prefills the waiting requests that fit in max_batch, then runs one round over the batch.
    """

    def __init__(self, model: "SpecModel", speculative: bool = True, k: int | str | None = None,
                 tree: TreeShape | None = None, max_batch: int | None = None, stop_below: float | None = None):
        """k: chain length, or "auto" (runtime/adaptive.py picks 0..k_max each round); max_batch: at most
        this many rows (default and upper bound: the bundle's limits.max_batch); stop_below: a row's chain
        ends after a draft the drafter gave a probability below this (default: the recipe's draft.stop_below;
        under k auto, above 0 it turns on early stops at the policy's threshold: a row's chain ends once the
        product of its drafts' probabilities is below what one more draft costs, `AdaptiveK.stop_threshold`)."""
        self.model, self.target, self.drafter = model, model.target, model.drafter
        self.max_batch = model.max_batch if max_batch is None else max_batch
        if not (isinstance(self.max_batch, int) and 1 <= self.max_batch <= model.max_batch):
            raise RequestError(f"max_batch must be in [1, {model.max_batch}] (the bundle's limits.max_batch), got {max_batch!r}")
        self.speculative = speculative and model.can_speculate
        if k is not None and tree is not None:
            raise RequestError("give k (chain speculation) or tree, not both")
        if tree is not None and not model.target.step.has_tree_mask:
            raise RequestError("this bundle was compiled for chain speculation; trees need speculation.mode tree in the recipe")
        if tree is not None and not model.drafter.supports_tree:
            raise RequestError(f"{model.draft_label} drafting proposes chains, not trees")
        default_tree = model.tree if k is None else None
        self.tree = (tree or default_tree) if self.speculative else None
        if k is None and self.tree is None:
            k = model.k  # the recipe's: an integer or "auto"
        if stop_below is not None and not is_probability(stop_below):
            raise RequestError(f"stop_below must be a probability in [0, 1], got {stop_below!r}")
        self.stop_below = model.stop_below if stop_below is None else float(stop_below)
        self.policy = None
        if k == "auto":
            if self.speculative and self.tree is None:
                # a drafter whose first rounds for a row pay its prefill must promise more than plain decoding
                arms = self.drafter.arms
                margins = {name: MIN_GAIN_LAZY_PREFILL if d.lazy_prefill else 1.0 for name, d in arms.items()}
                # one policy per model and settings: a call starts from what earlier calls learned
                # with early stops, chains end where the policy prices one more draft above what it gains
                stop_arms = tuple(name for name, d in arms.items() if d.stops) if self.stop_below else ()
                key = (AdaptiveK, auto_k_max(model.k), tuple(margins.items()), stop_arms)
                if key not in model.policies:
                    model.policies[key] = AdaptiveK(auto_k_max(model.k), min_gain=margins, arms=tuple(arms),
                                                    stop_arms=stop_arms)
                self.policy = model.policies[key]
                self.policy.forget_rows()
            k = self.policy.k_max if self.policy else None
        if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_K):
            raise RequestError(f"k must be an integer in [1, {MAX_K}] or 'auto', got {k!r}")
        self.k = k if self.speculative and self.tree is None and k is not None else 0
        self.waiting: deque[Request] = deque()
        self.batch: Batch | None = None
        self.stats = RunStats()
        self.last_round: RoundRecord | None = None  # the latest decode round (adaptive policy, server metrics)
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()

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
    def lookahead(self) -> int:
        """Most drafted tokens a round adds to a row's cache beyond its pending token."""
        return self.tree.size if self.tree is not None else self.k

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.batch is not None

    def step(self) -> list[StreamEvent]:
        """Admit waiting requests, or run one round; return what it generated.

        A step that admitted requests returns their first tokens at once (the round follows in the
        next step), so time to first token is the prefill's, not the prefill's plus a round's."""
        start = time.perf_counter()
        self.last_round = None
        events = self._drop_cancelled()
        admitted = self._admit()
        events += admitted
        if self.batch is not None and not admitted:
            round_start = time.perf_counter()
            before = (self.stats.draft_seconds, self.stats.target_seconds, self.stats.prefill_seconds)
            rows = [s.index for s in self.batch.seqs]
            k, counts, skipped, entered, arm, stopped_below, classes = self.k, None, [], 0, None, 0.0, []
            if self.tree is not None:
                k, (new_tokens, counts) = self.tree.size, self._tree_round(self.batch)
            elif self.speculative and (k := self._policy_k(self.batch) if self.policy else self.k):
                # a probe (policy.measuring) does not make the drafter take in rows it has not taken in,
                # but a lone row: skipping it, the probe would measure nothing (and the arm never be learned)
                warm = not (self.policy and self.policy.measuring) or len(self.batch.seqs) == 1
                arm = self.policy.arm if self.policy else None  # fixed k: the drafter itself
                stop = (self.policy.stop_below, True) if self.policy else (self.stop_below, False)
                new_tokens, counts, proposal = self._speculative_round(self.batch, k, warm, arm, *stop)
                skipped, entered, stopped_below = proposal.skipped, proposal.catch_up_tokens, proposal.stop_below
                classes = proposal.classes or []
            else:
                k, new_tokens = 0, self._target_round(self.batch)
            n_draft, n_acc = counts or ([0] * len(rows), [0] * len(rows))
            caught_up = self.stats.prefill_seconds - before[2]  # a lazy draft prefill is not this round's cost
            self.last_round = RoundRecord(rows, k, n_draft, n_acc, self.stats.draft_seconds - before[0],
                                          self.stats.target_seconds - before[1],
                                          time.perf_counter() - round_start - caught_up, skipped,
                                          arm or (self.policy.arm if self.policy else "draft"), caught_up, entered,
                                          stopped_below, classes)
            if self.policy is not None:
                self.policy.observe(self.last_round)
            events += self._advance(self.batch, new_tokens)
            if not self.batch.seqs:
                self.batch = None
        self.stats.seconds += time.perf_counter() - start
        return events

    def _policy_k(self, batch: Batch) -> int:
        """The adaptive policy's k for this round (its arm: `policy.arm`), given what each row may still
        generate, what each arm would have to take in before drafting and which rows each arm would find
        drafts for, of which class (prompt lookup knows before it drafts)."""
        seqs, arms = batch.seqs, self.drafter.arms
        return self.policy.choose([s.index for s in seqs], remaining=[s.max_new_tokens - len(s.out) for s in seqs],
                                  behind={name: d.behind(batch) for name, d in arms.items()},
                                  finds={name: d.finds(batch) for name, d in arms.items()})

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
                self.drafter.after_prefill(batch, lengths, verdict)
        return batch, [[t] for t in verdict.next_token.tolist()]

    def _target_round(self, batch: Batch) -> list[list[int]]:
        """The baseline: one target pass per token."""
        cache = batch.cache
        cache.ensure(int(cache.lengths.max()) + 1)
        with self._timed("target_seconds"):
            first = torch.zeros_like(cache.lengths)[:, None]
            verdict = self.target.decide(cache, batch.pending[:, None], first, batch.params, batch.noise(1)[:, 0])
        cache.commit(verdict.new_k, verdict.new_v, torch.ones_like(cache.lengths))
        if self.speculative:  # a plain round under k auto: a drafter over the target's features takes this token's
            self.drafter.after_verify(batch, verdict)
        return [[t] for t in verdict.next_token.tolist()]

    def _speculative_round(self, batch: Batch, k: int, warm: bool = True, arm: str | None = None,
                           stop_below: float = 0.0, stop_chain: bool = False
                           ) -> tuple[list[list[int]], tuple[list[int], list[int]], Proposal]:
        """Draft k (with the drafter's arm `arm`, default itself; chains may end early, `Stops`), verify
        k+1 in one target pass, accept a prefix, commit its KV.

        Returns each row's new tokens, the (drafted, accepted) counts of every row and the proposal
        (its rows skipped as not warm, its catch-up)."""
        cache = batch.cache
        drafter = self.drafter.arms[arm] if arm else self.drafter
        with self._timed("draft_seconds"):
            proposal = drafter.propose(batch, k, batch.params, warm, stop_below, stop_chain)  # may propose fewer than k
        self.stats.draft_seconds -= proposal.catch_up_seconds  # a draft model's lazy prefill
        self.stats.prefill_seconds += proposal.catch_up_seconds
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
        counts = (proposal.lengths.tolist(), verdict.n_accepted.tolist())
        for seq, n, d, t, drafted in zip(batch.seqs, counts[1], counts[0], verdict.next_token.tolist(),
                                         proposal.tokens.tolist()):
            seq.stats.record(d, n, proposal.source)
            out.append(drafted[:n] + [t])
        return out, counts, proposal

    def _tree_round(self, batch: Batch) -> tuple[list[list[int]], tuple[list[int], list[int]]]:
        """Draft a token tree per row, verify all its nodes in one target pass, commit the accepted path.

        Returns each row's new tokens and the (depth drafted, accepted) counts of every row."""
        params, shape, cache = batch.params, self.tree, batch.cache
        with self._timed("draft_seconds"):
            trees = self.drafter.propose_tree(batch, shape, params)
            if shape.verify_nodes is not None:
                trees = [rerank(t, shape.verify_nodes) if params.greedy[b] else t for b, t in enumerate(trees)]
        with self._timed("target_seconds"):
            ids, depth, mask = tree_tensors(trees, first=0, device=cache.lengths.device)
            cache.ensure(int(cache.lengths.max()) + ids.shape[1])
            rows = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
            outputs = self.target.outputs(ids, cache, rows, positions=cache.lengths[:, None] + depth, tree_mask=mask)
            logits, new_k, new_v = outputs["logits"], outputs["new_k"], outputs["new_v"]
        u = batch.noise(shape.size + 2)
        probs = None if params.all_greedy else probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
        paths, out, depth_acc = [], [], ([], [])
        for b, tree in enumerate(trees):
            n = tree.size + 1
            if params.greedy[b]:
                path, nxt = accept_tree_greedy(logits[b, :n], tree)
            else:
                path, nxt = accept_tree_sampled(probs[b, :n], tree, u[b])
            paths.append(path)
            batch.seqs[b].stats.record(max(tree.depth), len(path) - 1)
            depth_acc[0].append(max(tree.depth))
            depth_acc[1].append(len(path) - 1)
            out.append([tree.tokens[node] for node in path[1:]] + [nxt])
        index, counts = pad_right(paths, cache.lengths.device)
        cache.commit(new_k, new_v, counts, index=index)
        # further target outputs (features for a draft head) in accepted-path order, like a chain's
        extra = {n: torch.gather(v, 1, index.view(*index.shape, *[1] * (v.dim() - 2)).expand(-1, -1, *v.shape[2:]))
                 for n, v in outputs.items() if n not in ("logits", "new_k", "new_v")}
        next_token = torch.tensor([o[-1] for o in out], device=cache.lengths.device)
        self.drafter.after_verify(batch, Verdict(counts - 1, next_token, new_k, new_v, extra))
        return out, depth_acc

    # -- joining and leaving ----------------------------------------------------------------
    def _drop_cancelled(self) -> list[StreamEvent]:
        """Remove cancelled requests from the queue and their rows from the batch."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            gone = [s for s in self.waiting if s.index in cancelled]
            self.waiting = deque(s for s in self.waiting if s.index not in cancelled)
        if cancelled and self.batch is not None:
            running = [s for s in self.batch.seqs if s.index in cancelled]
            for seq in running:
                self.stats.speculation.merge(seq.stats)
            keep = [b for b, s in enumerate(self.batch.seqs) if s.index not in cancelled]
            if not keep:
                self.batch = None
            elif running:
                self.batch.keep_rows(keep)
            gone += running
        return [StreamEvent(s.index, "", [], True, "cancelled", s.stats.to_dict()) for s in gone]

    def _admit(self) -> list[StreamEvent]:
        """Prefill waiting requests into free rows; emit their first tokens."""
        with self._lock:
            room = self.max_batch - (len(self.batch.seqs) if self.batch else 0)
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
