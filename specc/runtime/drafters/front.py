"""A cheap drafter in front of a model drafter: prompt lookup (draft.lookup) or suffix decoding (draft.suffix)
drafts the rounds where it has drafts for every row, the model (a draft model, early exit, EAGLE, lookahead)
the others."""
from __future__ import annotations

import torch

from ...speculation.sampling import RowParams
from ...speculation.tree import DraftTree, TreeShape
from ..record import DraftPlan
from ..state import Batch, Request
from .base import Drafter, Proposal


class FrontDrafter(Drafter):
    """`front` drafts a round where it `covers` the batch (a continuation for every row), `model` the rest.

    The choice depends only on the contexts (and the suffix drafter's indexes), never on this round's noise,
    and each round's q is what its drafts were drawn from, so acceptance stays exact. Every capability of the
    method (its row: prompt features, a lazy prefill, trees, stops) is the model's. Every hook goes to both:
    the model sees every verdict, lookup rounds' included (a draft model's cache catches up on their tokens in
    its next round, since ModelDrafter feeds whatever its cache lacks; an EAGLE head enters their features), and
    so does the front (the suffix drafter counts what was accepted of its own drafts, and takes in each
    finished output).
    """

    def __init__(self, front: Drafter, model: Drafter):
        self.front, self.model, self.method = front, model, model.method

    @property
    def label(self) -> str:
        return f"{self.model.label}+{self.front.method.front}"

    @property
    def arms(self) -> dict[str, Drafter]:
        """"model": the model for every row, also where the front has drafts; the front's name ("lookup",
        "suffix"): the front alone (rows it misses get no drafts; no model call, so no draft prefill either).
        An adaptive policy picks per round, with what the front finds in hand."""
        return {"model": self.model, self.front.method.front: self.front}

    @property
    def suffix_cache(self):
        return self.front.suffix_cache or self.model.suffix_cache

    def drafting(self, batch: Batch) -> Drafter:
        return self.front if self.front.covers(batch) else self.model

    def set_prefill_chunk(self, tokens: int) -> None:
        self.front.set_prefill_chunk(tokens)
        self.model.set_prefill_chunk(tokens)

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor, verdict) -> None:
        self.front.prefill(batch, ids, lengths, verdict)
        self.model.prefill(batch, ids, lengths, verdict)

    def behind(self, batch: Batch) -> list[int]:
        """What a round that needs the model enters first; nothing where the front drafts every row."""
        return self.drafting(batch).behind(batch)

    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        return self.drafting(batch).propose(batch, params, plan)

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        return self.drafting(batch).propose_tree(batch, shape, params)

    def after_verify(self, batch: Batch, verdict) -> None:
        self.front.after_verify(batch, verdict)
        self.model.after_verify(batch, verdict)

    def finished(self, seq: Request) -> None:
        self.front.finished(seq)
        self.model.finished(seq)
