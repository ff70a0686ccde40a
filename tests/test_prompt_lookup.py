"""Prompt lookup's n-gram matching: what it finds, and the match length it reports to the policy."""
from __future__ import annotations

import numpy as np
import pytest

import specc
from adaptive_helpers import admit
from specc.runtime.drafters import DraftPlan
from specc.runtime.scheduler import Scheduler


def test_prompt_lookup_reports_the_length_of_its_match(bundles, prompts):
    """finds and the proposal's classes: the n-gram length matched per row (0: nothing found)."""
    model = specc.load(bundles["prompt_lookup"])
    scheduler = Scheduler(model, k=4)
    for i, ids in enumerate(model.encode(prompts[:2])):
        scheduler.submit(model.new_request(i, ids, 20, model.sampling_params(), i, k=scheduler.lookahead))
    admit(scheduler)
    batch, drafter = scheduler.batch, scheduler.drafter
    first, second = batch.seqs
    first.out.extend(first.prompt[:3])  # ends by repeating its own first tokens
    second.out.append(max(second.tokens) + 1)  # a token never seen before: nothing to continue
    n = drafter.max_ngram  # the recipe's longest n-gram
    assert n >= 2 and drafter.finds(batch) == [n, 0]
    proposal = drafter.propose(batch, batch.params, DraftPlan(4))
    assert proposal.record.classes == [n, 0] and proposal.lengths.tolist()[1] == 0


@pytest.mark.parametrize("min_ngram", [1, 2, 3])
def test_prompt_lookup_finds_the_latest_longest_match(min_ngram):
    """PromptLookupDrafter.match against its definition, on random contexts over small vocabularies (many
    repeats): the longest n in [min_ngram, max_ngram] whose last n tokens occurred before, the latest such
    occurrence, and the up to k tokens that followed it."""
    from specc.runtime.drafters import PromptLookupDrafter

    def by_definition(tokens, k):
        for n in range(min(3, len(tokens) - 1), min_ngram - 1, -1):
            starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
            if starts:
                return n, tokens[starts[-1] + n:starts[-1] + n + k]
        return 0, []

    drafter, rng = PromptLookupDrafter(3, min_ngram, 8), np.random.default_rng(min_ngram)
    for _ in range(3000):
        tokens = rng.integers(0, rng.integers(1, 8), size=rng.integers(0, 40)).tolist()
        assert drafter.match(tokens, 4) == by_definition(tokens, 4), tokens
