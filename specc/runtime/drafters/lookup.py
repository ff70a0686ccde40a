"""Drafting by prompt lookup: n-grams of the row's own context, alone or in front of a model (drafters/front.py)."""
from __future__ import annotations

from typing import Callable

import torch

from ...speculation.sampling import RowParams
from ..state import Batch
from ..record import DraftPlan
from .base import DraftContext, Drafter, Proposal, one_hot_proposal


class PromptLookupDrafter(Drafter):
    """Drafts by n-gram lookup in the row's own context (prompt and generated text), no model.

    The last n tokens (n from max_ngram down to min_ngram) are searched for in the earlier
    context, most recent occurrence first; the tokens that followed it are the draft. The
    draft distribution is one-hot at each proposed token, so sampled rows accept a draft d
    with probability p(d) and correct from p without d: still exactly the target's distribution.
    """

    def __init__(self, max_ngram: int, min_ngram: int, vocab_size: int):
        self.max_ngram, self.min_ngram, self.vocab_size = max_ngram, min_ngram, vocab_size

    @classmethod
    def build(cls, ctx: DraftContext) -> "PromptLookupDrafter":
        return cls(ctx.settings["max_ngram"], ctx.settings["min_ngram"], ctx.vocab_size)

    def match(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(n, the up to k tokens that followed the latest earlier occurrence of the last n tokens) for the
        longest n in [min_ngram, max_ngram] that occurs; (0, []) if none does."""
        if len(tokens) < 2:
            return 0, []
        # where the last token occurred before, latest first (list.index scans in C: a search costs
        # its few occurrences, not a Python loop over the whole context for every n)
        earlier, ends, i = tokens[-2::-1], [], -1
        while True:
            try:
                i = earlier.index(tokens[-1], i + 1)
            except ValueError:
                break
            ends.append(len(tokens) - 2 - i)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for end in ends:  # an occurrence of the n-gram that ends at `end`
                if end >= n - 1 and tokens[end - n + 1:end + 1] == tail:
                    return n, tokens[end + 1:end + 1 + k]
        return 0, []

    def finds(self, batch: Batch) -> list[int]:
        return [self.match(s.tokens, 1)[0] for s in batch.seqs]

    def covers(self, batch: Batch) -> bool:
        """Every row finds a continuation: in front of a model, lookup drafts the round."""
        return all(self.finds(batch))

    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        return self.drafts([self.match(s.tokens, plan.k) for s in batch.seqs], params, batch.cache.lengths.device)

    def drafts(self, matches: list[tuple[int, list[int]]], params: RowParams, device: torch.device) -> Proposal:
        """The proposal of each row's lookup (n, tokens): tokens [B, width], one-hot q (sampled rows), lengths,
        the matched n as each row's class."""
        return one_hot_proposal([f for _, f in matches], [n if f else 0 for n, f in matches], params, self.vocab_size,
                                device)

    def probe(self, batch: Batch, k: int) -> Callable[[], object]:
        tokens = batch.seqs[0].tokens
        return lambda: self.match(tokens, k)
