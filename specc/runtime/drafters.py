"""Drafters propose k tokens per row; the target then verifies them in one pass.

A drafter returns draft tokens [B, k], their draft probabilities q [B, k, V] (None when
greedy) and the number of valid drafts per row n_draft [B] (a row may propose fewer).
"""
from __future__ import annotations

from typing import Protocol

import torch

from .kv_cache import KVCache
from .sampling import RowParams, choose
from .state import Batch
from .step import StepRunner, pad_right


class Drafter(Protocol):
    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor) -> None: ...

    def propose(self, batch: Batch, k: int, params: RowParams): ...

    def after_verify(self, batch: Batch) -> None: ...

    def keep_rows(self, batch: Batch, rows: torch.Tensor) -> None: ...

    def extend(self, batch: Batch, other: Batch) -> None: ...


class ModelDrafter:
    """A draft step graph with its own KV cache, kept in step with the target's tokens."""

    def __init__(self, step: StepRunner, max_context: int):
        self.step, self.max_context = step, max_context

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        cache = KVCache(self.step.dims, len(batch.seqs), self.max_context, lengths.device)
        cache.ensure(int(lengths.max()))
        _, new_k, new_v = self.step(ids, cache, logit_index=torch.zeros_like(lengths)[:, None])
        cache.commit(new_k, new_v, lengths)
        batch.draft_state = cache

    def propose(self, batch: Batch, k: int, params: RowParams):
        cache: KVCache = batch.draft_state
        # Feed what the draft cache lacks: the pending token, and after a fully accepted
        # round also the last draft token (its KV was never computed).
        lengths = cache.lengths.tolist()
        feed, n_feed = pad_right([s.tokens[n:] for s, n in zip(batch.seqs, lengths)], cache.lengths.device)
        cache.ensure(max(lengths) + feed.shape[1] + k)
        noise = batch.noise(k)
        tokens, probs = [], []
        logits, new_k, new_v = self.step(feed, cache, logit_index=(n_feed - 1)[:, None])
        for i in range(k):
            cache.commit(new_k, new_v, n_feed)
            tok, q = choose(logits[:, 0], params, noise[:, i])
            tokens.append(tok)
            probs.append(q)
            if i + 1 < k:
                n_feed = torch.ones_like(n_feed)
                logits, new_k, new_v = self.step(tok[:, None], cache, logit_index=torch.zeros_like(tok)[:, None])
        q = None if params.all_greedy else torch.stack(probs, 1)
        return torch.stack(tokens, 1), q, torch.full_like(n_feed, k)

    def after_verify(self, batch: Batch) -> None:
        # Draft KV is valid up to the first rejected draft: no further than the target's.
        cache: KVCache = batch.draft_state
        cache.lengths = torch.minimum(cache.lengths, batch.cache.lengths)

    def keep_rows(self, batch: Batch, rows: torch.Tensor) -> None:
        batch.draft_state.keep_rows(rows)

    def extend(self, batch: Batch, other: Batch) -> None:
        batch.draft_state.extend(other.draft_state)
