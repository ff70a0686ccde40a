"""What each chain round drafts: a fixed k, or the adaptive policy (runtime/adaptive.py).

A planner answers `plan(batch)` before a round (None: a plain round) and hears how it went in
`observe`, which turns the round's result into the `RoundRecord` the policy learns from and the
server's metrics read. Nothing here touches the batch: the choice depends only on finished rounds
and the context so far, so every round stays an ordinary lossless speculative round.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..limits import auto_k_max
from .adaptive import MIN_GAIN_LAZY_PREFILL, AdaptiveK, RoundRecord
from .drafters.base import DraftPlan, Drafter
from .rounds import RoundResult
from .state import Batch

if TYPE_CHECKING:
    from .model import SpecModel


class Planner:
    """A fixed chain length k (0: plain rounds only), with early stops below `stop_below`."""

    def __init__(self, k: int, stop_below: float = 0.0):
        self.k, self.stop_below = k, stop_below

    @property
    def k_max(self) -> int:
        """The longest chain a round may draft."""
        return self.k

    def plan(self, batch: Batch) -> DraftPlan | None:
        return DraftPlan(self.k, stop_below=self.stop_below) if self.k else None

    def observe(self, batch: Batch, plan: DraftPlan | None, result: RoundResult, seconds: float) -> RoundRecord:
        """The record of a finished round (`seconds`: the whole round, catch-up included)."""
        info = result.info
        return RoundRecord(rows=[s.index for s in batch.seqs], k=plan.k if plan else 0, n_draft=result.drafted,
                           n_accepted=result.accepted, draft_seconds=result.draft_seconds,
                           target_seconds=result.verify_seconds, seconds=seconds - info.catch_up_seconds,
                           skipped=info.skipped, arm=(plan.arm if plan else None) or "draft",
                           catch_up_seconds=info.catch_up_seconds, catch_up_tokens=info.catch_up_tokens,
                           stop_below=info.stop_below, classes=info.classes or [])


class AdaptivePlanner(Planner):
    """k "auto": the policy picks each round's arm and k in [0, k_max] from the rounds it observed."""

    def __init__(self, policy: AdaptiveK, drafter: Drafter):
        super().__init__(policy.k_max)
        self.policy, self.drafter = policy, drafter

    def plan(self, batch: Batch) -> DraftPlan | None:
        seqs, arms = batch.seqs, self.drafter.arms
        k = self.policy.choose([s.index for s in seqs], remaining=[s.max_new_tokens - len(s.out) for s in seqs],
                               behind={name: d.behind(batch) for name, d in arms.items()},
                               finds={name: d.finds(batch) for name, d in arms.items()})
        if not k:
            return None
        # a probe (policy.measuring) does not make the drafter take in rows it has not taken in, but a
        # lone row: skipping it, the probe would measure nothing (and the arm never be learned)
        warm = not self.policy.measuring or len(seqs) == 1
        return DraftPlan(k, arm=self.policy.arm, warm=warm, stop_below=self.policy.stop_below, stop_chain=True)

    def observe(self, batch: Batch, plan: DraftPlan | None, result: RoundResult, seconds: float) -> RoundRecord:
        record = super().observe(batch, plan, result, seconds)
        record.arm = plan.arm if plan else self.policy.arm
        self.policy.observe(record)
        return record


def make_planner(model: "SpecModel", k: int | str, stop_below: float) -> Planner:
    """The planner for chain rounds of this model: fixed k, or one adaptive policy per model and settings,
    so a call starts from what earlier calls learned."""
    if k != "auto":
        return Planner(k, stop_below)
    arms = model.drafter.arms
    # a drafter whose first rounds for a row pay its prefill must promise more than plain decoding
    margins = {name: MIN_GAIN_LAZY_PREFILL if d.lazy_prefill else 1.0 for name, d in arms.items()}
    # with early stops, chains end where the policy prices one more draft above what it gains
    stop_arms = tuple(name for name, d in arms.items() if d.method.stops) if stop_below else ()
    k_max = auto_k_max(model.k)
    key = (AdaptiveK, k_max, tuple(margins.items()), stop_arms)
    if key not in model.policies:
        model.policies[key] = AdaptiveK(k_max, min_gain=margins, arms=tuple(arms), stop_arms=stop_arms)
    policy = model.policies[key]
    policy.forget_rows()
    return AdaptivePlanner(policy, model.drafter)
