"""Drafters that run a draft step graph: a separate model (or the quantised target) with a KV
cache of its own, and the early-exit draft that reads the target's cache."""
from __future__ import annotations

import time
from typing import Callable

import torch

from ...speculation.sampling import RowParams
from ...speculation.tree import DraftTree, TreeShape, tree_tensors
from ..kv_cache import KVCache, LayerView
from ..state import Batch
from ..step import pad_right
from ..record import DraftPlan, RoundRecord
from .base import GraphDrafter, Proposal
from .loops import draft_chain, grow_tree


CATCH_UP = 16  # a row further behind than this catches up in a call of its own (no padding of the others)
DRAFT_WINDOW = 2048  # a row's draft cache takes in at most its last this many prompt tokens (ModelDrafter)
# ... and at most WINDOW_PER_NEW_TOKEN per token the row may still generate, but never fewer than DRAFT_WINDOW_MIN:
# a short answer repays only a short catch-up, and what a small draft proposes depends mostly on the last hundred
# or so tokens (prompt lookup, in front of it, still sees the whole prompt)
WINDOW_PER_NEW_TOKEN = 1
DRAFT_WINDOW_MIN = 64
# ... behind the prompt's first DRAFT_SINK tokens: a chat template's header (system prompt, the user turn's
# start) sets the role the draft writes in, and a small model that loses it drafts in another voice
DRAFT_SINK = 32
SKIPPED = "model:skipped"  # Request.draft_memo: the prompt tokens between the sink and the window, never taken in


def _skipped(seq) -> int:
    """Tokens the row's draft cache skips: its slot i holds token i below DRAFT_SINK, token i + skipped above."""
    return seq.draft_memo.get(SKIPPED, 0)


def _window(seq) -> int:
    """Prompt tokens a cold row's draft cache takes in after the sink: the catch-up is paid back only over the
    tokens the row still generates, so a short answer to a long prompt drafts from its recent context alone."""
    left = seq.max_new_tokens - len(seq.out)
    return min(DRAFT_WINDOW, max(DRAFT_WINDOW_MIN, WINDOW_PER_NEW_TOKEN * left))


def _to_skip(seq) -> int:
    """Context tokens (all but the pending one) between the sink and the window of a cold row: 0 where the context
    is no longer than both."""
    return max(0, len(seq.tokens) - 1 - DRAFT_SINK - _window(seq))


def _cold_tokens(seq) -> list[int]:
    """What a cold row's draft cache takes in (all but the pending token): the sink and the window, or the whole
    context where it is shorter than both; sets the row's SKIPPED."""
    skipped = seq.draft_memo[SKIPPED] = _to_skip(seq)
    return seq.tokens[:DRAFT_SINK] + seq.tokens[DRAFT_SINK + skipped:-1] if skipped else seq.tokens[:-1]


class ModelDrafter(GraphDrafter):
    """A draft step graph with its own KV cache (`Batch.draft_state`), kept in step with the target's tokens.

    The cache fills lazily: a prompt enters it in the first round that drafts for its row, not at
    admission, so requests that are never drafted for (adaptive k at 0, a probe that skips cold
    rows) never pay for the draft's prefill. Rows far behind (new ones, or after plain rounds)
    catch up in a call of their own before the round, so they do not widen the others' feed.
    A long prompt enters only its first DRAFT_SINK tokens and its last DRAFT_WINDOW (at consecutive positions
    from 0), fewer where the row will generate little (`_window`): what the draft proposes depends mostly on the
    recent context and the role the header sets, and drafts never change what is accepted, so speculation adds
    a bounded prefill to a long prompt's, in proportion to what it can save, instead of a second one nearly as
    long.
    """

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor, verdict) -> None:
        batch.draft_state = KVCache(self.step.dims, len(batch.seqs), self.max_context, lengths.device)

    def cache(self, batch: Batch) -> KVCache | LayerView:
        """The draft KV this batch's rounds extend."""
        return batch.draft_state

    def behind(self, batch: Batch) -> list[int]:
        """Tokens `catch_up` would enter per row: all but the pending one for cold rows (nothing entered
        yet) and rows more than CATCH_UP behind; 0 for the rest (their few tokens ride in the first draft step)."""
        cache = self.cache(batch)
        out = []
        for s, n in zip(batch.seqs, cache.lengths.tolist()):
            if n == 0:
                out.append(len(s.tokens) - 1 - _to_skip(s))
            else:
                lag = len(s.tokens) - 1 - _skipped(s) - n
                out.append(lag if lag + 1 > CATCH_UP else 0)
        return out

    def catch_up(self, batch: Batch, take_in: bool = True) -> tuple[list[int], int]:
        """Enter the tokens of rows far behind (all but the pending one) in a call over those rows only;
        cold rows (nothing entered yet) only when `take_in`. Returns the rows still cold and the tokens entered."""
        cache = self.cache(batch)
        lengths = cache.lengths.tolist()
        cold = [b for b, n in enumerate(lengths) if n == 0 and not take_in]
        lag = self.behind(batch)
        rows = [b for b, d in enumerate(lag) if d and (take_in or lengths[b] > 0)]
        if rows:
            sub = cache.take(rows)
            todo = [_cold_tokens(batch.seqs[b]) if lengths[b] == 0 else
                    batch.seqs[b].tokens[_skipped(batch.seqs[b]) + lengths[b]:-1] for b in rows]
            width = max(len(t) for t in todo)
            sub.ensure(int(sub.lengths.max()) + width)
            for lo in range(0, width, self.prefill_chunk):  # a long prompt in chunks, like the target's prefill
                parts = [t[lo:lo + self.prefill_chunk] for t in todo]
                feed, _ = pad_right([p or t[-1:] for p, t in zip(parts, todo)], cache.lengths.device)
                _, new_k, new_v = self.step(feed, sub, logit_index=torch.zeros(len(rows), 1, dtype=torch.long))
                sub.commit(new_k, new_v, torch.tensor([len(p) for p in parts]))
            cache.put(rows, sub)
        return cold, sum(lag[b] for b in rows)

    def after_verify(self, batch: Batch, verdict) -> None:
        # Draft KV is valid up to the first rejected draft: no further than the target's.
        if batch.draft_state is not None:
            skipped = torch.tensor([_skipped(s) for s in batch.seqs], device=batch.cache.lengths.device)
            batch.draft_state.lengths = torch.minimum(batch.draft_state.lengths, batch.cache.lengths - skipped)

    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        start = time.perf_counter()
        cold, entered = self.catch_up(batch, plan.take_in)
        record = RoundRecord(skipped=cold, catch_up_seconds=time.perf_counter() - start, catch_up_tokens=entered)
        if len(cold) == len(batch.seqs):  # nothing to draft from: an empty proposal, a plain round
            return Proposal.empty(batch, params, self.step.dims.vocab_size, record)
        # Feed what the draft cache lacks: the pending token, and after a fully accepted round also
        # the last draft token (its KV was never computed). Cold rows run along on their pending
        # token, commit nothing and propose nothing.
        cache = self.cache(batch)
        lengths = cache.lengths.tolist()
        feed, n_feed = pad_right([s.tokens[-1:] if b in cold else s.tokens[_skipped(s) + n:]
                                  for b, (s, n) in enumerate(zip(batch.seqs, lengths))], cache.lengths.device)
        drafting = torch.ones_like(n_feed)
        drafting[cold] = 0
        cache.ensure(max(lengths) + feed.shape[1] + plan.k)
        logits, new_k, new_v = self.step(feed, cache, logit_index=(n_feed - 1)[:, None])
        cache.commit(new_k, new_v, n_feed * drafting)  # a stopped row's later entries lie past what it keeps

        def step(tok: torch.Tensor) -> torch.Tensor:
            logits, new_k, new_v = self.step(tok[:, None], cache, logit_index=torch.zeros_like(tok)[:, None])
            cache.commit(new_k, new_v, drafting)
            return logits[:, 0]

        return draft_chain(batch, params, plan, logits[:, 0], step, drafting, record)

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        """The first call feeds what the draft cache lacks (ending with the root) and commits it; each
        further call runs all drafted nodes with their ancestor mask at depth-based positions, reading
        logits at the newest level only."""
        self.catch_up(batch)
        cache = self.cache(batch)
        lengths = cache.lengths.tolist()
        feed, n_feed = pad_right([s.tokens[_skipped(s) + n:] for s, n in zip(batch.seqs, lengths)],
                                 cache.lengths.device)
        cache.ensure(max(lengths) + feed.shape[1] + shape.size)
        logits, new_k, new_v = self.step(feed, cache, logit_index=(n_feed - 1)[:, None])
        cache.commit(new_k, new_v, n_feed)

        def next_level(trees: list[DraftTree], frontier: list[list[int]], level: int) -> torch.Tensor:
            ids, depth, mask = tree_tensors(trees, first=1, device=cache.lengths.device)
            index, _ = pad_right([[n - 1 for n in f] or [0] for f in frontier], cache.lengths.device)
            positions = cache.lengths[:, None] - 1 + depth
            return self.step(ids, cache, logit_index=index, positions=positions, tree_mask=mask)[0]

        return grow_tree(batch, shape, params, logits, next_level)

    def probe(self, batch: Batch, k: int) -> Callable[[], object]:
        self.catch_up(batch)
        cache, pending = self.cache(batch), batch.pending[:, None]
        first = torch.zeros_like(pending)
        return lambda: self.step(pending, cache, logit_index=first)


class SharedCacheDrafter(ModelDrafter):
    """An early-exit draft: the target's first layers, reading the target's own KV cache.

    Nothing to prefill and nothing to catch up: each round starts from a fresh view of the
    target cache at the target's committed length, and feeds only the pending token.
    """

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor, verdict) -> None:
        pass

    def cache(self, batch: Batch) -> LayerView:
        return LayerView(batch.cache, self.step.dims.n_layers)

    def behind(self, batch: Batch) -> list[int]:
        return [0] * len(batch.seqs)

    def catch_up(self, batch: Batch, take_in: bool = True) -> tuple[list[int], int]:
        return [], 0

