"""Unit tests of sampling and the acceptance rules, including a statistical check that a
deliberately broken rule fails."""
from __future__ import annotations

import pytest
import torch

from specc.errors import RequestError
from specc.speculation.sampling import (RowParams, SamplingParams, accept, accept_greedy, accept_sampled,
                                    probs_from_logits, sample)

from stats_helpers import FAIL_P, PASS_P, chi2_pvalue


def test_processing_matches_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    for t, k, p in [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6)]:
        ref = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        rows = RowParams.of([SamplingParams(t, k, p)] * 4)
        got = probs_from_logits(logits, rows.temperature, rows.top_k, rows.top_p)
        assert torch.allclose(got, torch.softmax(ref, -1), atol=1e-6), (t, k, p)


def test_processing_is_per_row():
    torch.manual_seed(1)
    logits = torch.randn(3, 2, 40) * 2
    settings = [SamplingParams(1.0), SamplingParams(0.5, 5), SamplingParams(1.5, 0, 0.7)]
    rows = RowParams.of(settings)
    batched = probs_from_logits(logits, rows.temperature, rows.top_k, rows.top_p)
    for b, sp in enumerate(settings):
        one = RowParams.of([sp])
        assert torch.allclose(batched[b], probs_from_logits(logits[b:b + 1], one.temperature, one.top_k, one.top_p)[0])
    assert (batched[1] > 0).sum(-1).tolist() == [5, 5]


def test_mixed_greedy_and_sampled_rows():
    """A greedy row in a sampled batch gets exactly the greedy result."""
    torch.manual_seed(2)
    logits = torch.randn(2, 4, 30)
    draft = logits[:, :3].argmax(-1)
    draft[0, 1] = (draft[0, 1] + 1) % 30  # row 0 (greedy) rejects at position 1
    q = torch.softmax(torch.randn(2, 3, 30), -1)
    params = RowParams.of([SamplingParams(0.0), SamplingParams(1.0)])
    n, nxt = accept(logits, q, draft, torch.tensor([3, 3]), params, torch.rand(2, 3), torch.rand(2))
    n_g, next_g = accept_greedy(logits, draft, torch.tensor([3, 3]))
    assert n[0] == n_g[0] == 1 and nxt[0] == next_g[0]


def test_sample_is_inverse_cdf():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]])
    assert sample(probs, torch.tensor([0.05])).item() == 0
    assert sample(probs, torch.tensor([0.1])).item() == 2  # never the zero-mass token 1
    assert sample(probs, torch.tensor([0.69])).item() == 2
    assert sample(probs, torch.tensor([0.71])).item() == 3
    assert sample(probs, torch.tensor([0.999999])).item() == 3


def test_sampling_params_are_validated():
    for bad in (SamplingParams(-1.0), SamplingParams(1.0, -2), SamplingParams(1.0, 0, 0.0), SamplingParams(1.0, 0, 1.5)):
        with pytest.raises(RequestError):
            bad.validate()


def test_accept_greedy_prefix_and_correction():
    logits = torch.zeros(3, 4, 10)
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]])
    logits.scatter_(-1, best[..., None], 1.0)
    draft = torch.tensor([[1, 2, 3], [1, 9, 3], [1, 1, 1]])
    n_acc, nxt = accept_greedy(logits, draft, torch.tensor([3, 3, 3]))
    assert n_acc.tolist() == [3, 1, 0]
    assert nxt.tolist() == [4, 2, 5]  # bonus, correction, correction
    n_acc, nxt = accept_greedy(logits, draft, torch.tensor([2, 3, 3]))  # row 0 proposed only 2
    assert n_acc.tolist()[0] == 2 and nxt.tolist()[0] == 3


def _rule_samples(rule, n=200_000, k=2, vocab=8, seed=0):
    """Context-free target p_i and draft q_i per position: speculative output tokens must be i.i.d. p_i."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)
    P, Q = p.expand(n, -1, -1), q.expand(n, -1, -1)
    draft = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1)
    u = torch.rand(n, k + 1, generator=g)
    n_acc, nxt = rule(P, Q, draft, torch.full((n,), k), u[:, :k], u[:, k])
    first = torch.where(n_acc >= 1, draft[:, 0], nxt)
    rows = n_acc >= 1
    second = torch.where(n_acc >= 2, draft[:, 1], nxt)[rows]
    return p, first, second


def _accept_everything(p, q, draft, n_draft, u_accept, u_next):
    """A deliberately wrong rule: every draft token accepted, bonus from p."""
    rows = torch.arange(p.shape[0])
    return n_draft, sample(p[rows, n_draft], u_next)


def _accept_without_residual(p, q, draft, n_draft, u_accept, u_next):
    """A subtler wrong rule: correct acceptance test, but the correction drawn from p, not max(0, p - q)."""
    n_acc, _ = accept_sampled(p, q, draft, n_draft, u_accept, u_next)
    rows = torch.arange(p.shape[0])
    return n_acc, sample(p[rows, n_acc], u_next)


def test_modified_rejection_sampling_is_lossless():
    p, first, second = _rule_samples(accept_sampled)
    assert chi2_pvalue(first, p[0]) > PASS_P
    assert chi2_pvalue(second, p[1]) > PASS_P


@pytest.mark.parametrize("broken", [_accept_everything, _accept_without_residual])
def test_statistical_check_catches_broken_rules(broken):
    p, first, second = _rule_samples(broken)
    assert min(chi2_pvalue(first, p[0]), chi2_pvalue(second, p[1])) < FAIL_P


def test_fewer_drafts_than_k_take_bonus_from_p():
    """A row that proposed nothing samples its next token straight from p[0]."""
    n, vocab = 100_000, 6
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(3, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(2, vocab, generator=g), -1)
    draft = torch.randint(0, vocab, (n, 2), generator=g)
    u = torch.rand(n, 3, generator=g)
    n_acc, nxt = accept_sampled(p.expand(n, -1, -1), q.expand(n, -1, -1), draft, torch.zeros(n, dtype=torch.long),
                                u[:, :2], u[:, 2])
    assert (n_acc == 0).all()
    assert chi2_pvalue(nxt, p[0]) > PASS_P
