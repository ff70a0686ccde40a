"""Drafters propose k tokens per row; the target then verifies them in one pass.

A drafter returns draft tokens [B, k], their draft probabilities q [B, k, V] (None when
greedy) and the number of valid drafts per row n_draft [B] (a row may propose fewer).
"""
from __future__ import annotations

from typing import Protocol

import torch

from .kv_cache import KVCache, LayerView
from .sampling import RowParams, choose, probs_from_logits, sample
from .state import Batch
from .step import StepRunner, pad_right
from .tree import DraftTree, TreeShape, tree_tensors


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

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        """Grow one token tree per row, level by level (see runtime/tree.py for the candidate rules).

        The first call feeds what the draft cache lacks (ending with the root) and commits it;
        each further call runs all drafted nodes with their ancestor mask at depth-based
        positions, reading logits at the newest level only.
        """
        cache: KVCache = batch.draft_state
        lengths = cache.lengths.tolist()
        feed, n_feed = pad_right([s.tokens[n:] for s, n in zip(batch.seqs, lengths)], cache.lengths.device)
        cache.ensure(max(lengths) + feed.shape[1] + shape.size)
        logits, new_k, new_v = self.step(feed, cache, logit_index=(n_feed - 1)[:, None])
        cache.commit(new_k, new_v, n_feed)
        trees = [DraftTree([s.out[-1]]) for s in batch.seqs]
        noise = batch.noise(shape.size + 1)
        frontier = [[0] for _ in trees]
        for level in range(1, shape.depth + 1):
            probs = None if params.all_greedy else probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
            logq = torch.log_softmax(logits.float(), -1)
            frontier = [
                _expand(tree, frontier[b], None if params.greedy[b] else probs[b], logq[b], shape, level, noise[b])
                for b, tree in enumerate(trees)
            ]
            if level == shape.depth or not any(frontier):
                break
            ids, depth, mask = tree_tensors(trees, first=1, device=cache.lengths.device)
            index, _ = pad_right([[n - 1 for n in f] or [0] for f in frontier], cache.lengths.device)
            positions = cache.lengths[:, None] - 1 + depth
            logits, _, _ = self.step(ids, cache, logit_index=index, positions=positions, tree_mask=mask)
        return trees

    def after_verify(self, batch: Batch) -> None:
        # Draft KV is valid up to the first rejected draft: no further than the target's.
        cache: KVCache = batch.draft_state
        cache.lengths = torch.minimum(cache.lengths, batch.cache.lengths)

    def keep_rows(self, batch: Batch, rows: torch.Tensor) -> None:
        batch.draft_state.keep_rows(rows)

    def extend(self, batch: Batch, other: Batch) -> None:
        batch.draft_state.extend(other.draft_state)


def _expand(tree: DraftTree, frontier: list[int], probs: torch.Tensor | None, logq: torch.Tensor,
            shape: TreeShape, level: int, noise: torch.Tensor) -> list[int]:
    """Add children to this level's frontier nodes; returns the new nodes.

    probs [F, V]: the draft distribution at each frontier node (sampled rows), None for greedy
    rows; logq [F, V]: draft log-probabilities. Greedy candidates are the top tokens; sampled
    candidates are i.i.d. draws from q, whose values never decide how many candidates a node gets.
    """
    wanted = shape.children_at_level(level)
    if wanted is None:  # dynamic: expand the most likely paths first, within the node budget
        order = sorted(range(len(frontier)), key=lambda i: -tree.score[frontier[i]])
        counts = {}
        for i in order:
            if tree.size + sum(counts.values()) + shape.branching <= shape.max_nodes:
                counts[i] = shape.branching
    else:
        counts = {i: wanted.get(tree.path[node], 0) for i, node in enumerate(frontier)}
    new = []
    for i, node in enumerate(frontier):
        m = counts.get(i, 0)
        if m == 0:
            continue
        if probs is None:
            top = torch.topk(logq[i], m)
            for rank, (tok, lq) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
                new.append(tree.add(node, tok, lq, rank))
        else:
            q = probs[i]
            tree.q[node] = q
            for rank in range(m):
                slot = tree.size + 1  # the index the new node gets: one noise value per node
                tok = int(sample(q[None], noise[slot:slot + 1])[0])
                new.append(tree.add(node, tok, float(torch.log(q[tok])), rank))
    return new


class SharedCacheDrafter(ModelDrafter):
    """An early-exit draft: the target's first layers, reading the target's own KV cache.

    Nothing to prefill and nothing to catch up: each round starts from a fresh view of the
    target cache at the target's committed length, and feeds only the pending token.
    """

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        pass

    def propose(self, batch: Batch, k: int, params: RowParams):
        batch.draft_state = LayerView(batch.cache, self.step.dims.n_layers)
        return super().propose(batch, k, params)

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        batch.draft_state = LayerView(batch.cache, self.step.dims.n_layers)
        return super().propose_tree(batch, shape, params)

    def after_verify(self, batch: Batch) -> None:
        batch.draft_state = None

    def keep_rows(self, batch: Batch, rows: torch.Tensor) -> None:
        pass

    def extend(self, batch: Batch, other: Batch) -> None:
        pass


class PromptLookupDrafter:
    """Drafts by n-gram lookup in the row's own context (prompt and generated text), no model.

    The last n tokens (n from max_ngram down to min_ngram) are searched for in the earlier
    context, most recent occurrence first; the tokens that followed it are the draft. The
    draft distribution is one-hot at each proposed token, so sampled rows accept a draft d
    with probability p(d) and correct from p without d: still exactly the target's distribution.
    """

    def __init__(self, max_ngram: int, min_ngram: int, vocab_size: int):
        self.max_ngram, self.min_ngram, self.vocab_size = max_ngram, min_ngram, vocab_size

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        pass

    def propose(self, batch: Batch, k: int, params: RowParams):
        return self.drafts([self.lookup(s.tokens, k) for s in batch.seqs], params, batch.cache.lengths.device)

    def drafts(self, found: list[list[int]], params: RowParams, device: torch.device):
        """Draft tokens [B, width], one-hot q (sampled rows) and n_draft from each row's lookup."""
        width = max(len(f) for f in found)
        draft = torch.zeros(len(found), width, dtype=torch.long, device=device)
        for b, f in enumerate(found):
            draft[b, : len(f)] = torch.tensor(f, dtype=torch.long)
        n_draft = torch.tensor([len(f) for f in found], dtype=torch.long, device=device)
        q = None
        if not params.all_greedy:
            q = torch.zeros(len(found), width, self.vocab_size, device=device).scatter_(-1, draft[..., None], 1.0)
        return draft, q, n_draft

    def after_verify(self, batch: Batch) -> None:
        pass

    def keep_rows(self, batch: Batch, rows: torch.Tensor) -> None:
        pass

    def extend(self, batch: Batch, other: Batch) -> None:
        pass


class LookupFirstDrafter:
    """Prompt lookup first, the draft model where lookup finds nothing (recipe: draft.lookup).

    A round whose every row finds an n-gram continuation drafts from the context alone and
    skips the model; otherwise the model drafts for the whole batch. The choice depends only
    on the context, never on this round's noise, and each round's q is the distribution its
    drafts were drawn from, so acceptance stays exact. The model's cache catches up on the
    tokens of lookup rounds in its next round (ModelDrafter feeds whatever its cache lacks).
    """

    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter):
        self.lookup, self.model = lookup, model
        self.looked_up = False  # which drafter the last round used

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        self.model.prefill(batch, ids, lengths)

    def propose(self, batch: Batch, k: int, params: RowParams):
        found = [self.lookup.lookup(s.tokens, k) for s in batch.seqs]
        self.looked_up = all(found)
        if self.looked_up:
            return self.lookup.drafts(found, params, batch.cache.lengths.device)
        return self.model.propose(batch, k, params)

    def after_verify(self, batch: Batch) -> None:
        self.model.after_verify(batch)

    def keep_rows(self, batch: Batch, rows: torch.Tensor) -> None:
        self.model.keep_rows(batch, rows)

    def extend(self, batch: Batch, other: Batch) -> None:
        self.model.extend(batch, other)
