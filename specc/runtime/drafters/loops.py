"""The two drafting loops every graph drafter shares: a chain one token at a time, a tree level by level."""
from __future__ import annotations

from typing import Callable

import torch

from ...speculation.sampling import RowParams, choose
from ...speculation.tree import DraftTree, TreeShape, expand_level
from ..state import Batch
from ..record import DraftPlan, RoundRecord
from .base import Proposal, Stops


def draft_chain(batch: Batch, params: RowParams, plan: DraftPlan, logits: torch.Tensor,
                step: Callable[[torch.Tensor], torch.Tensor], drafting: torch.Tensor | None = None,
                record: RoundRecord | None = None) -> Proposal:
    """Draw up to plan.k tokens per row: from logits [B, V], then from step(tokens [B]) -> the next logits
    [B, V], until k drafts or every row has stopped (`Stops`). drafting [B]: rows that draft (default all)."""
    noise = batch.noise(plan.k)
    drafting = torch.ones_like(batch.cache.lengths) if drafting is None else drafting
    stops = Stops(drafting, plan.k, plan.stop_below, plan.stop_chain)
    tokens, probs = [], []
    for i in range(plan.k):
        if params.rules:  # penalties, logit_bias, grammar: draw from the distribution the target is held to
            logits = params.rules.apply(logits, tokens, start=i)
        tok, q = choose(logits, params, noise[:, i])
        tokens.append(tok)
        probs.append(q)
        if not stops.update(i, logits, tok) or i + 1 == plan.k:
            break
        logits = step(tok)
    record = record or RoundRecord()
    record.stop_below = plan.stop_below
    q = None if params.all_greedy else torch.stack(probs, 1)
    return Proposal(torch.stack(tokens, 1), q, stops.n_draft, record)


def grow_tree(batch: Batch, shape: TreeShape, params: RowParams, logits: torch.Tensor,
              next_level: Callable[[list[DraftTree], list[list[int]], int], torch.Tensor], depth: int | None = None
              ) -> list[DraftTree]:
    """One token tree per row rooted at its pending token, grown level by level (speculation/tree.py's
    candidate rules): level 1 from logits [B, F, V], each next level from next_level(trees, frontier,
    level) -> logits at the frontier nodes. depth: levels at most (default the shape's)."""
    trees = [DraftTree([s.out[-1]]) for s in batch.seqs]
    noise = batch.noise(shape.size + 1)
    frontier = [[0] for _ in trees]
    depth = shape.depth if depth is None else depth
    for level in range(1, depth + 1):
        if params.rules:  # as in draft_chain: each node's children drawn from the transformed distribution
            logits = params.rules.apply_tree(logits, trees, frontier)
        frontier = expand_level(trees, frontier, logits, params, shape, level, noise)
        if level == depth or not any(frontier):
            break
        logits = next_level(trees, frontier, level)
    return trees
