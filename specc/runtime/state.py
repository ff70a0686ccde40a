"""Per-request and per-batch state of a generation, and its statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_cache import KVCache
from .sampling import RowParams, SamplingParams
from .text import TextStream


@dataclass
class RowStats:
    """Speculation figures of one request (one batch row)."""

    rounds: int = 0  # target passes after prefill
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that ended at a rejected draft (n_acc < n_draft)
    lookup_rounds: int = 0  # rounds drafted by prompt lookup in front of a draft model (draft.lookup) ...
    lookup_drafted: int = 0  # ... and their drafted and accepted tokens
    lookup_accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # acceptances per draft position
    drafted_at: list[int] = field(default_factory=list)

    def record(self, n_draft: int, n_acc: int, looked_up: bool = False) -> None:
        self.rounds += 1
        if looked_up:
            self.lookup_rounds += 1
            self.lookup_drafted += n_draft
            self.lookup_accepted += n_acc
        self.drafted += n_draft
        self.accepted += n_acc
        self.rejected += n_acc < n_draft
        width = max(n_draft, len(self.drafted_at))
        self.drafted_at += [0] * (width - len(self.drafted_at))
        self.accepted_at += [0] * (width - len(self.accepted_at))
        for i in range(n_draft):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_acc

    def merge(self, other: "RowStats") -> None:
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.rejected += other.rejected
        self.lookup_rounds += other.lookup_rounds
        self.lookup_drafted += other.lookup_drafted
        self.lookup_accepted += other.lookup_accepted
        for _ in range(len(other.drafted_at) - len(self.drafted_at)):
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i, (d, a) in enumerate(zip(other.drafted_at, other.accepted_at)):
            self.drafted_at[i] += d
            self.accepted_at[i] += a

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "lookup_rounds": self.lookup_rounds,
            "lookup_acceptance_rate": self.lookup_accepted / self.lookup_drafted if self.lookup_drafted else None,
            "model_acceptance_rate": ((self.accepted - self.lookup_accepted) / (self.drafted - self.lookup_drafted)
                                      if self.lookup_rounds and self.drafted > self.lookup_drafted else None),
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            # per-token acceptance alpha: of the drafts the target judged (each accepted one, and the first
            # rejected one of a round), the fraction accepted; the geometric model's estimate of alpha
            "per_token_acceptance": self.accepted / (self.accepted + self.rejected) if self.accepted + self.rejected else None,
            "accepted_per_round": self.accepted / self.rounds if self.rounds else None,
            "tokens_per_target_pass": (self.accepted + self.rounds) / self.rounds if self.rounds else None,
            "acceptance_by_position": [a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at)],
        }


@dataclass
class Sequence:
    """One request while it is generated."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    generator: torch.Generator
    text: TextStream
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RowStats = field(default_factory=RowStats)

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens; the last one is not yet in the target cache."""
        return self.prompt + self.out


@dataclass
class Batch:
    """Rows generated together. Row b's committed length is cache.lengths[b]; its pending
    token (generated, not yet in the cache) is its last token."""

    seqs: list[Sequence]
    cache: KVCache
    draft_state: object = None

    @property
    def params(self) -> RowParams:
        return RowParams.of([s.params for s in self.seqs], self.cache.lengths.device)

    @property
    def pending(self) -> torch.Tensor:
        return torch.tensor([s.out[-1] for s in self.seqs], dtype=torch.long, device=self.cache.lengths.device)

    def noise(self, n: int) -> torch.Tensor:
        """[B, n] uniforms from each row's own generator (so a row's result depends only on its seed)."""
        return torch.stack([torch.rand(n, generator=s.generator) for s in self.seqs]).to(self.cache.lengths.device)

    def keep_rows(self, keep: list[int]) -> torch.Tensor:
        """Keep only these rows (in order) in the sequences and the target cache; returns their index tensor."""
        rows = torch.tensor(keep, dtype=torch.long, device=self.cache.lengths.device)
        self.seqs = [self.seqs[b] for b in keep]
        self.cache.keep_rows(rows)
        return rows

    def extend(self, other: "Batch") -> None:
        """Append another batch's rows (continuous batching)."""
        self.seqs += other.seqs
        self.cache.extend(other.cache)
