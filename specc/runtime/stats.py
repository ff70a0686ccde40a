"""Speculation statistics: per request (RowStats) and per generate call or scheduler (RunStats)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RowStats:
    """Speculation figures of one request (one batch row)."""

    rounds: int = 0  # target passes after prefill
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that ended at a rejected draft (n_acc < n_draft)
    front_rounds: int = 0  # rounds drafted by the drafter in front of a model (drafters/front.py) ...
    front_drafted: int = 0  # ... and their drafted and accepted tokens, and those that ended at a rejection
    front_accepted: int = 0
    front_rejected: int = 0
    accepted_at: list[int] = field(default_factory=list)  # acceptances per draft position
    drafted_at: list[int] = field(default_factory=list)
    front_accepted_at: list[int] = field(default_factory=list)  # ... of the front's rounds

    def record(self, n_draft: int, n_acc: int, front: bool = False) -> None:
        """One round of this row: n_draft tokens proposed (by the front drafter, `front`), n_acc accepted."""
        self.rounds += 1
        if front:
            self.front_rounds += 1
            self.front_drafted += n_draft
            self.front_accepted += n_acc
            self.front_rejected += n_acc < n_draft
        self.drafted += n_draft
        self.accepted += n_acc
        self.rejected += n_acc < n_draft
        accepted = [int(i < n_acc) for i in range(n_draft)]
        _add_at(self.drafted_at, [1] * n_draft)
        _add_at(self.accepted_at, accepted)
        if front:
            _add_at(self.front_accepted_at, accepted)

    def merge(self, other: "RowStats") -> None:
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.rejected += other.rejected
        self.front_rounds += other.front_rounds
        self.front_drafted += other.front_drafted
        self.front_accepted += other.front_accepted
        self.front_rejected += other.front_rejected
        _add_at(self.drafted_at, other.drafted_at)
        _add_at(self.accepted_at, other.accepted_at)
        _add_at(self.front_accepted_at, other.front_accepted_at)

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "front_rounds": self.front_rounds,
            "front_acceptance_rate": self.front_accepted / self.front_drafted if self.front_drafted else None,
            "model_acceptance_rate": ((self.accepted - self.front_accepted) / (self.drafted - self.front_drafted)
                                      if self.front_rounds and self.drafted > self.front_drafted else None),
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            # per-token acceptance alpha: of the drafts the target judged (each accepted one, and the first
            # rejected one of a round), the fraction accepted; the geometric model's estimate of alpha
            "per_token_acceptance": self.accepted / (self.accepted + self.rejected) if self.accepted + self.rejected else None,
            "accepted_per_round": self.accepted / self.rounds if self.rounds else None,
            "tokens_per_target_pass": (self.accepted + self.rounds) / self.rounds if self.rounds else None,
            "acceptance_by_position": [a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at)],
        }


def _add_at(counts: list[int], more: list[int]) -> None:
    """Add per-position counts `more` into `counts` (in place), growing it as needed."""
    counts += [0] * (len(more) - len(counts))
    for i, n in enumerate(more):
        counts[i] += n


@dataclass
class RunStats:
    """Aggregate figures of one generate call (or one scheduler's life)."""

    requests: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # drafting, including the draft's own sampling
    target_seconds: float = 0.0  # target passes after prefill (verify, or decode without speculation)
    speculation: RowStats = field(default_factory=RowStats)
    rounds_by_k: dict[int, int] = field(default_factory=dict)  # rounds after prefill by the k they drafted (0: plain)

    def merge(self, other: "RunStats") -> None:
        for name in ("requests", "new_tokens", "seconds", "prefill_seconds", "draft_seconds", "target_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.speculation.merge(other.speculation)
        for k, n in other.rounds_by_k.items():
            self.rounds_by_k[k] = self.rounds_by_k.get(k, 0) + n

    def to_dict(self) -> dict:
        host = self.seconds - self.draft_seconds - self.target_seconds - self.prefill_seconds
        return {
            "requests": self.requests,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.new_tokens / self.seconds if self.seconds else None,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "host_seconds": host,
            "rounds_by_k": {str(k): n for k, n in sorted(self.rounds_by_k.items())},
            **self.speculation.to_dict(),
        }
