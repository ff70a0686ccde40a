"""What a round is asked to draft (`DraftPlan`) and what it did (`RoundRecord`).

One record travels with a round from its drafter (who drafted, rows left out, context taken in first)
through verification (accepted drafts, new tokens, seconds) to the scheduler's statistics and the
policy that plans the next round; every stage fills its own fields, none copies another's.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DraftPlan:
    """How to draft one chain round: up to k tokens per row (k 0: a plain round, no drafts).

    arm: which of the drafter's ways of drafting runs (`Drafter.arms`; None: the drafter chooses).
    take_in=False: a drafter that takes a row's context in lazily leaves rows it has not taken in without
    drafts (a round that only measures whether drafting pays). stop_below: a drafter of one token at a
    time ends a row's chain after the first draft it gave a probability below this, or with stop_chain,
    after the first at which the product of the chain's probabilities falls below it (`Stops`)."""

    k: int
    arm: str | None = None
    take_in: bool = True
    stop_below: float = 0.0
    stop_chain: bool = False


@dataclass
class RoundRecord:
    """One round, from draft to policy (`Scheduler.last_round`; the adaptive policy learns from it).

    The drafter fills front, skipped, catch_up_*, stop_below and classes; the round fills rows, k, arm,
    drafted, accepted, tokens, logprobs and its seconds."""

    rows: list[int] = field(default_factory=list)  # request index of each batch row
    k: int = 0  # drafts asked for per row (0: plain round; a tree round: its widest row's verified nodes)
    drafted: list[int] = field(default_factory=list)  # drafts each row proposed (<= k)
    accepted: list[int] = field(default_factory=list)  # of which the target accepted
    draft_seconds: float = 0.0  # drafting, without the catch-up
    target_seconds: float = 0.0  # the target pass and acceptance
    seconds: float = 0.0  # the whole round, host work included, the catch-up excluded
    skipped: list[int] = field(default_factory=list)  # batch rows the drafter left out (`DraftPlan.take_in`)
    arm: str = "draft"  # which of the drafter's ways of drafting ran (`Drafter.arms`)
    catch_up_seconds: float = 0.0  # entering context the drafter lacked (a lazy prefill), booked as prefill
    catch_up_tokens: int = 0
    stop_below: float = 0.0  # chains could end early below this (0: none could)
    classes: list[int] = field(default_factory=list)  # per row, the class of its drafts (`Drafter.finds`; empty: none)
    front: bool = False  # drafted by the drafter in front of a model (draft.lookup, draft.suffix), for the statistics
    tokens: list[list[int]] = field(default_factory=list)  # each row's new tokens: accepted drafts, then the next token
    logprobs: list | None = None  # per row asking for them: its new tokens' logprobs (`Verdict.logprobs`)
    cut: object = None  # a tree round's sizing (`TreeSizer.size`, `LookaheadGate.size`), for the sizer's `observe`
