"""Rows leaving a real bundle's batch early: cancellation from the queue and the batch, and the batch limit."""
from __future__ import annotations

import pytest

import specc
from specc.errors import RequestError
from specc.runtime.scheduler import Scheduler


def test_cancel_frees_the_row_and_leaves_the_others_exact(bundles, prompts):
    model = specc.load(bundles["draft"])
    chunk = prompts[:6]
    want = model.generate(chunk, max_new_tokens=24, k=3)
    scheduler = Scheduler(model, k="auto", max_batch=3)
    for i, ids in enumerate(model.encode(chunk)):
        scheduler.submit(model.new_request(i, ids, 24, model.sampling_params(), i, k=scheduler.lookahead))
    got: dict[int, list[int]] = {i: [] for i in range(len(chunk))}
    reasons, rounds = {}, 0
    while scheduler.busy:
        if rounds == 2:
            scheduler.cancel(1)  # running
            scheduler.cancel(5)  # still queued
            scheduler.cancel(42)  # unknown: ignored
        for ev in scheduler.step():
            got[ev.index] += ev.token_ids
            if ev.finished:
                reasons[ev.index] = ev.finish_reason
        assert scheduler.batch is None or len(scheduler.batch.seqs) <= 3
        rounds += 1
    assert reasons[1] == "cancelled" and reasons[5] == "cancelled"
    for i in (0, 2, 3, 4):
        assert got[i] == want[i].token_ids and reasons[i] == want[i].finish_reason
    assert got[5] == [] and got[1] == want[1].token_ids[:len(got[1])]


def test_max_batch_is_checked(bundles):
    model = specc.load(bundles["draft"])
    with pytest.raises(RequestError, match="max_batch"):
        Scheduler(model, max_batch=model.max_batch + 1)
