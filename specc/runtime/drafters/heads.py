"""Drafters over the target's own features: Medusa heads and the EAGLE draft layer.

The target graph returns `features` for every token it runs (passes/add_feature_outputs.py);
the scheduler hands them over in the verdict of prefill and of every round, in committed order
(the accepted path, for trees). Row j of a verdict's features belongs to the j-th committed token.

Medusa keeps one feature per row: the last committed token's. Head i reads it and proposes the
token i+2 positions later; the heads' distributions are independent of each other, so the q of
draft i is exactly head i's distribution whatever was drafted before it.

EAGLE keeps a one-layer KV cache of entries (f_j, x_{j+1}) at position j and the features of the
committed tokens not yet entered. A round enters them (their KV is kept), then drafts
autoregressively, feeding its own output hidden state as the next entry's feature; those
speculative entries are dropped when the round ends, since the target's true features replace them.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...speculation.sampling import RowParams, choose
from ...speculation.tree import DraftTree, TreeShape, tree_tensors
from ..kv_cache import KVCache
from ..state import Batch
from ..step import pad_right
from .base import DraftPlan, GraphDrafter, Proposal
from .loops import draft_chain, grow_tree


class LastFeatures:
    """Medusa's per-row state: the last committed token's feature [B, F], kept row for row with the batch."""

    def __init__(self, last: torch.Tensor):
        self.last = last

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.last = self.last.index_select(0, rows)

    def extend(self, other: "LastFeatures") -> None:
        self.last = torch.cat([self.last, other.last])


class MedusaDrafter(GraphDrafter):
    """Medusa heads: one call of the head graph per round drafts every position (chain or tree)."""

    def heads(self, batch: Batch) -> torch.Tensor:
        """[B, N, V] logits of every head at each row's last committed token."""
        (logits,) = self.step.runner(batch.draft_state.last[:, None].contiguous())
        return logits[:, 0]

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor, verdict) -> None:
        feats = verdict.extra["features"]
        batch.draft_state = LastFeatures(feats[torch.arange(len(lengths)), lengths - 1])

    def after_verify(self, batch: Batch, verdict) -> None:
        feats = verdict.extra["features"]
        batch.draft_state.last = feats[torch.arange(feats.shape[0]), verdict.n_accepted]

    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        logits = self.heads(batch)
        k = min(plan.k, logits.shape[1])
        noise = batch.noise(k)
        tokens, probs = [], []
        for i in range(k):
            head = params.rules.apply(logits[:, i], tokens, start=i) if params.rules else logits[:, i]
            tok, q = choose(head, params, noise[:, i])
            tokens.append(tok)
            probs.append(q)
        q = None if params.all_greedy else torch.stack(probs, 1)
        tokens = torch.stack(tokens, 1)
        return Proposal(tokens, q, torch.full((tokens.shape[0],), k, dtype=torch.long, device=tokens.device))

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        """Level l's candidates come from head l at every node of that level (top tokens, or i.i.d. draws)."""
        logits = self.heads(batch)
        return grow_tree(batch, shape, params, logits[:, :1], lambda trees, frontier, level: logits[:, level:level + 1],
                         depth=min(shape.depth, logits.shape[1]))

    def probe(self, batch: Batch, k: int) -> Callable[[], object]:
        return lambda: self.heads(batch)


class EagleCache(KVCache):
    """EAGLE's one-layer KV cache plus, per row, the features of committed tokens not yet entered."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.todo: list[torch.Tensor] = []

    def keep_rows(self, rows: torch.Tensor) -> None:
        super().keep_rows(rows)
        self.todo = [self.todo[r] for r in rows.tolist()]

    def extend(self, other: "EagleCache") -> None:
        super().extend(other)
        self.todo += other.todo


class EagleDrafter(GraphDrafter):
    """The EAGLE draft layer: chains drafted autoregressively, or EAGLE-2 style trees grown by draft
    confidence within the node budget (dynamic) or along static paths."""

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor, verdict) -> None:
        cache = EagleCache(self.step.dims, len(batch.seqs), self.max_context, lengths.device)
        feats = verdict.extra["features"]
        cache.todo = [feats[b, :n] for b, n in enumerate(lengths.tolist())]
        batch.draft_state = cache

    def after_verify(self, batch: Batch, verdict) -> None:
        cache: EagleCache = batch.draft_state
        feats = verdict.extra["features"]
        cache.todo = [torch.cat([t, feats[b, :n + 1]]) for b, (t, n) in enumerate(zip(cache.todo, verdict.n_accepted.tolist()))]

    def _enter(self, batch: Batch, room: int):
        """Enter every row's pending entries (kept); returns the logits [B, 1, V] and hidden [B, 1, H] of
        each row's last entry, whose token is the row's pending token. A prompt's entries go in chunks of
        prefill_chunk (a row whose entries are done rides along on a dummy entry, committing nothing)."""
        cache: EagleCache = batch.draft_state
        starts = cache.lengths.tolist()
        ids_of = [s.tokens[j + 1:j + 1 + len(t)] for s, j, t in zip(batch.seqs, starts, cache.todo)]
        width = max(len(r) for r in ids_of)
        cache.ensure(max(starts) + width + room)
        logits = hidden = None
        for lo in range(0, width, self.prefill_chunk):
            parts = [r[lo:lo + self.prefill_chunk] for r in ids_of]
            ids, n_feed = pad_right([p or r[-1:] for p, r in zip(parts, ids_of)], cache.lengths.device)
            feats = torch.zeros(ids.shape[0], ids.shape[1], cache.todo[0].shape[-1], dtype=cache.todo[0].dtype,
                                device=ids.device)
            for b, t in enumerate(cache.todo):
                feats[b, :len(parts[b])] = t[lo:lo + len(parts[b])]
            last = (n_feed - 1)[:, None]
            out, out_hidden, new_k, new_v = self.step(ids, cache, logit_index=last, features=feats)
            cache.commit(new_k, new_v, torch.tensor([len(p) for p in parts], device=cache.lengths.device))
            out_hidden = torch.gather(out_hidden, 1, last[:, :, None].expand(-1, -1, out_hidden.shape[-1]))
            ends = torch.tensor([lo < len(r) <= lo + self.prefill_chunk for r in ids_of], device=ids.device)
            logits = out if logits is None else torch.where(ends[:, None, None], out, logits)
            hidden = out_hidden if hidden is None else torch.where(ends[:, None, None], out_hidden, hidden)
        cache.todo = [t[:0] for t in cache.todo]
        return logits, hidden

    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        cache: EagleCache = batch.draft_state
        logits, hidden = self._enter(batch, plan.k)
        kept = cache.lengths.clone()
        first = torch.zeros_like(kept)[:, None]

        def step(tok: torch.Tensor) -> torch.Tensor:
            nonlocal hidden
            logits, hidden, new_k, new_v = self.step(tok[:, None], cache, logit_index=first, features=hidden)
            cache.commit(new_k, new_v, torch.ones_like(kept))
            return logits[:, 0]

        proposal = draft_chain(batch, params, plan, logits[:, 0], step)
        cache.lengths = kept  # speculative entries carry draft features: never kept
        return proposal

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        """Level by level: every drafted node is an entry (its parent's output hidden state, its token)
        at position depth-based; the node's output hidden state feeds its children."""
        cache: EagleCache = batch.draft_state
        logits, root_hidden = self._enter(batch, shape.size)
        hidden_of = [{0: root_hidden[b, 0]} for b in range(len(batch.seqs))]

        def next_level(trees: list[DraftTree], frontier: list[list[int]], level: int) -> torch.Tensor:
            ids, depth, mask = tree_tensors(trees, first=1, device=cache.lengths.device)
            feats = torch.zeros(ids.shape[0], ids.shape[1], root_hidden.shape[-1], dtype=root_hidden.dtype, device=ids.device)
            for b, tree in enumerate(trees):
                for node in range(1, len(tree.tokens)):
                    feats[b, node - 1] = hidden_of[b][tree.parent[node]]
            index, _ = pad_right([[n - 1 for n in f] or [0] for f in frontier], cache.lengths.device)
            positions = cache.lengths[:, None] - 1 + depth
            logits, hidden, _, _ = self.step(ids, cache, logit_index=index, positions=positions, tree_mask=mask,
                                             features=feats)
            for b, f in enumerate(frontier):
                for node in f:
                    hidden_of[b][node] = hidden[b, node - 1]
            return logits

        return grow_tree(batch, shape, params, logits, next_level)

    def probe(self, batch: Batch, k: int) -> Callable[[], object]:
        cache: EagleCache = batch.draft_state
        pending = batch.pending[:, None]
        feats = torch.zeros(pending.shape[0], 1, cache.todo[0].shape[-1])
        first = torch.zeros_like(pending)
        return lambda: self.step(pending, cache, logit_index=first, features=feats)
