"""One round of decoding over a batch, in three kinds: plain, chain and tree.

Each reads draft -> verify -> accept -> commit -> emit top to bottom and returns a `RoundResult`;
the scheduler owns the batch between rounds, the planner (runtime/planning.py) decides what the
next round drafts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..speculation.tree import TreeShape
from .drafters.base import DraftInfo, DraftPlan, Drafter
from .state import Batch
from .verifier import Verifier

if TYPE_CHECKING:
    from .planning import TreeSizer


@dataclass
class RoundResult:
    """What one round produced: each row's new tokens (accepted drafts, then the target's next token),
    its drafted and accepted counts, where the time went, and what the drafter told the policy."""

    tokens: list[list[int]]
    drafted: list[int]
    accepted: list[int]
    source: str = ""  # who drafted (Proposal.source), for the statistics
    draft_seconds: float = 0.0  # drafting, without catch-up
    verify_seconds: float = 0.0  # the target pass and acceptance
    info: DraftInfo = field(default_factory=DraftInfo)
    logprobs: list | None = None  # per row asking for them: its new tokens' logprobs (Verdict.logprobs)
    width: int = 0  # a tree round's widest row: drafted nodes verified


def plain_round(batch: Batch, verifier: Verifier, drafter: Drafter | None = None) -> RoundResult:
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
    return RoundResult([[t] for t in verdict.next_token.tolist()], zeros, zeros,
                       verify_seconds=time.perf_counter() - start, logprobs=verdict.logprobs)


def chain_round(batch: Batch, drafter: Drafter, verifier: Verifier, plan: DraftPlan) -> RoundResult:
    """Draft up to plan.k tokens per row, verify them after each row's pending token in one target pass,
    accept a prefix, commit its KV, emit the accepted drafts and the target's next token."""
    params, start = batch.params, time.perf_counter()
    proposal = (drafter.arms[plan.arm] if plan.arm else drafter).propose(batch, params, plan)   # draft
    drafted_at = time.perf_counter()
    u = batch.noise(plan.k + 1)  # always k + 1 draws, so a row's noise stream does not depend on the batch
    width = proposal.tokens.shape[1]
    verdict = verifier.chain(batch, proposal, params, u[:, :width], u[:, plan.k])               # verify, accept
    verified_at = time.perf_counter()
    verdict.commit(batch.cache)                                                                 # commit
    drafter.after_verify(batch, verdict)
    accepted = verdict.n_accepted.tolist()
    tokens = [d[:n] + [t] for d, n, t in zip(proposal.tokens.tolist(), accepted, verdict.next_token.tolist())]
    info = proposal.info
    return RoundResult(tokens, proposal.lengths.tolist(), accepted, proposal.source,                # emit
                       drafted_at - start - info.catch_up_seconds, verified_at - drafted_at, info, verdict.logprobs)


def tree_round(batch: Batch, drafter: Drafter, verifier: Verifier, shape: TreeShape,
               sizer: TreeSizer | None = None) -> RoundResult:
    """Draft a token tree per row (cut to what pays, with a sizer), verify every node in one target pass,
    commit the accepted path."""
    params, start = batch.params, time.perf_counter()
    trees = drafter.propose_tree(batch, shape, params)                                         # draft
    if sizer is not None:
        trees = sizer.size(trees, params.greedy)
    drafted_at = time.perf_counter()
    noise = batch.noise(shape.size + 2)
    verdict, paths = verifier.tree(batch, trees, params, noise, shape.verify_nodes)           # verify, accept
    verified_at = time.perf_counter()
    verdict.commit(batch.cache)                                                                 # commit
    drafter.after_verify(batch, verdict)
    tokens = [path + [t] for path, t in zip(paths, verdict.next_token.tolist())]              # emit
    return RoundResult(tokens, [max(t.depth) for t in trees], [len(p) for p in paths], drafter.kind,
                       drafted_at - start, verified_at - drafted_at, logprobs=verdict.logprobs,
                       width=max(t.size for t in trees))
