"""What a generation holds between rounds: its requests and the batch they run in.

Everything else a round needs is derived from these: a row's pending token is its last
token, its committed length is its cache length, the batch's sampling settings come from
its requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..speculation.sampling import RowParams, SamplingParams
from .kv_cache import KVCache
from .rules import BatchRules, RowFailure, RowRule
from .stats import RowStats
from .text import TextStream


@dataclass
class Request:
    """One prompt while it is generated."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    generator: torch.Generator
    text: TextStream
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RowStats = field(default_factory=RowStats)
    rule: RowRule | None = None  # penalties, logit_bias, grammar, logprobs (runtime/rules.py)
    draft_memo: dict = field(default_factory=dict)  # what a drafter keeps for this request whatever batch it is in
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    cache_domain: bytes = b""  # the prefix cache's isolation domain: prefixes are shared only within one
    error: RowFailure | None = None  # why it failed (finish_reason "error"), e.g. its grammar reached a dead end

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens; the last one is not yet in the target cache."""
        return self.prompt + self.out


class DraftState(Protocol):
    """What a drafter keeps per row between rounds (a draft model's KV cache, a head's features),
    kept row for row with the batch as rows join and leave."""

    def keep_rows(self, rows: torch.Tensor) -> None: ...

    def extend(self, other: "DraftState") -> None: ...


@dataclass
class Batch:
    """Rows generated together. Row b's committed length is cache.lengths[b]; its pending
    token (generated, not yet in the cache) is its last token. draft_state is what the drafter
    keeps for these rows, if anything."""

    seqs: list[Request]
    cache: KVCache
    draft_state: DraftState | None = None

    @property
    def params(self) -> RowParams:
        params = RowParams.of([s.params for s in self.seqs], self.cache.lengths.device)
        if any(s.rule is not None for s in self.seqs):
            params.rules = BatchRules([s.rule for s in self.seqs], [list(s.out) for s in self.seqs])
        return params

    @property
    def pending(self) -> torch.Tensor:
        return torch.tensor([s.out[-1] for s in self.seqs], dtype=torch.long, device=self.cache.lengths.device)

    def noise(self, n: int) -> torch.Tensor:
        """[B, n] uniforms from each row's own generator (so a row's result depends only on its seed)."""
        return torch.stack([torch.rand(n, generator=s.generator) for s in self.seqs]).to(self.cache.lengths.device)

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only these rows (in order): requests, target cache and draft cache."""
        rows = torch.tensor(keep, dtype=torch.long, device=self.cache.lengths.device)
        self.seqs = [self.seqs[b] for b in keep]
        self.cache.keep_rows(rows)
        if self.draft_state is not None:
            self.draft_state.keep_rows(rows)

    def extend(self, other: "Batch") -> None:
        """Append another batch's rows (continuous batching)."""
        self.seqs += other.seqs
        self.cache.extend(other.cache)
        if self.draft_state is not None:
            self.draft_state.extend(other.draft_state)
