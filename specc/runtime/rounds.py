"""One round of decoding over a batch, in three kinds: plain, chain and tree.

Each reads draft -> verify -> accept -> commit -> emit top to bottom and returns the round's
`RoundRecord`; the scheduler owns the batch between rounds, the planner (runtime/planning.py) decides
what the next round drafts.
"""
from __future__ import annotations

import time
from typing import Protocol

from ..speculation.tree import DraftTree, TreeShape
from .drafters.base import Drafter
from .record import DraftPlan, RoundRecord
from .state import Batch
from .verifier import Verifier


class Sizer(Protocol):
    """Cuts a tree round's trees to what a verify pass of their width pays (runtime/planning.py)."""

    def size(self, trees: list[DraftTree], greedy: list[bool]) -> tuple[list[DraftTree], object]:
        """The trees to verify, and the cut (what `observe` reads back from the round's record)."""

    def observe(self, record: RoundRecord) -> None:
        """A finished round of trees it cut."""


def plain_round(batch: Batch, verifier: Verifier, drafter: Drafter | None = None) -> RoundRecord:
    """The baseline: one target pass, one token per row. A drafter that follows the target's outputs
    (a head reading its features) still sees the verdict."""
    cache, start = batch.cache, time.perf_counter()
    cache.ensure(int(cache.lengths.max()) + 1)
    first = cache.lengths.new_zeros(len(batch.seqs), 1)
    verdict = verifier.next_token(cache, batch.pending[:, None], first, batch.params, batch.noise(1)[:, 0])
    verdict.commit(cache)
    if drafter is not None:
        drafter.after_verify(batch, verdict)
    zeros = [0] * len(batch.seqs)
    return RoundRecord(drafted=zeros, accepted=zeros, target_seconds=time.perf_counter() - start,
                       tokens=[[t] for t in verdict.next_token.tolist()], logprobs=verdict.logprobs)


def chain_round(batch: Batch, drafter: Drafter, verifier: Verifier, plan: DraftPlan) -> RoundRecord:
    """Draft up to plan.k tokens per row, verify them after each row's pending token in one target pass,
    accept a prefix, commit its KV, emit the accepted drafts and the target's next token."""
    params, start = batch.params, time.perf_counter()
    who = drafter.arms[plan.arm] if plan.arm else drafter.drafting(batch)
    proposal = who.propose(batch, params, plan)                                                 # draft
    drafted_at = time.perf_counter()
    u = batch.noise(plan.k + 1)  # always k + 1 draws, so a row's noise stream does not depend on the batch
    width = proposal.tokens.shape[1]
    verdict = verifier.chain(batch, proposal, params, u[:, :width], u[:, plan.k])               # verify, accept
    verified_at = time.perf_counter()
    verdict.commit(batch.cache)                                                                 # commit
    drafter.after_verify(batch, verdict)
    record = proposal.record
    record.k, record.front = plan.k, who is drafter.front
    record.drafted, record.accepted = proposal.lengths.tolist(), verdict.n_accepted.tolist()
    record.tokens = [d[:n] + [t] for d, n, t in zip(proposal.tokens.tolist(), record.accepted,  # emit
                                                    verdict.next_token.tolist())]
    record.draft_seconds = drafted_at - start - record.catch_up_seconds
    record.target_seconds, record.logprobs = verified_at - drafted_at, verdict.logprobs
    return record


def tree_round(batch: Batch, drafter: Drafter, verifier: Verifier, shape: TreeShape,
               sizer: Sizer | None = None) -> RoundRecord:
    """Draft a token tree per row (cut to what pays, with a sizer), verify every node in one target pass,
    commit the accepted path."""
    params, start = batch.params, time.perf_counter()
    who = drafter.drafting(batch)
    trees = who.propose_tree(batch, shape, params)                                              # draft
    trees, cut = sizer.size(trees, params.greedy) if sizer is not None else (trees, None)
    drafted_at = time.perf_counter()
    noise = batch.noise(shape.size + 2)
    verdict, paths = verifier.tree(batch, trees, params, noise, shape.verify_nodes)           # verify, accept
    verified_at = time.perf_counter()
    verdict.commit(batch.cache)                                                                 # commit
    drafter.after_verify(batch, verdict)
    tokens = [path + [t] for path, t in zip(paths, verdict.next_token.tolist())]              # emit
    return RoundRecord(k=max(t.size for t in trees), drafted=[max(t.depth) for t in trees],
                       accepted=[len(p) for p in paths], draft_seconds=drafted_at - start,
                       target_seconds=verified_at - drafted_at, front=who is drafter.front, tokens=tokens,
                       logprobs=verdict.logprobs, cut=cut)
