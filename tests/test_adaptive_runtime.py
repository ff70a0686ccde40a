"""Adaptive speculation (k "auto") under the scheduler with real bundles: what drafters tell the policy, and output
that stays exact whatever k it picks (greedy, and the sampled distribution)."""
from __future__ import annotations

from collections import deque

import numpy as np
import pytest

import specc
from adaptive_helpers import FlippingK, admit
from lossless_checks import small_vocab_bundle
from specc.errors import RequestError
from specc.runtime.adaptive import AdaptiveK
from specc.runtime.drafters import DraftPlan
from specc.runtime.scheduler import Scheduler
from specc.runtime.stats import RunStats
from specc.speculation import sampling
from specc.speculation.sampling import SamplingParams
from stats_helpers import FAIL_P, PASS_P, chi2_pvalue, total_variation
from test_lossless_sampling import PROMPT, exact_marginals


def test_the_margin_is_for_drafters_with_a_prefill(bundles):
    """A draft model (alone or behind lookup) pays a prefill per row it drafts for; lookup and early exit do not."""
    margins = {kind: Scheduler(specc.load(bundles[kind]), k="auto").policy.min_gain
               for kind in ("draft", "lookup_first", "prompt_lookup", "early_exit")}
    assert margins == {"draft": {"draft": 1.1}, "lookup_first": {"model": 1.1, "lookup": 1.0},
                       "prompt_lookup": {"draft": 1.0}, "early_exit": {"draft": 1.0}}


def test_the_model_arm_drafts_with_the_model_where_lookup_finds(bundles, prompts):
    """Lookup in front of a draft model: the policy's "model" arm drafts with the model in every round, also
    where lookup has a continuation (whether a match is long enough to beat the model is the policy's choice,
    made with its length in hand); the "lookup" arm's rounds count as lookup rounds in the statistics."""
    class Alternate(AdaptiveK):
        def choose(self, rows, remaining=None, behind=None, finds=None):
            arm = ("model", "lookup")[self.round_no % 2]
            self.round_no += 1
            asked.append((arm, finds["lookup"][0] > 0))
            return DraftPlan(3, arm, stop_chain=True)

    asked: list[tuple[str, bool]] = []
    model = specc.load(bundles["lookup_first"])
    scheduler = Scheduler(model, k="auto", max_batch=1)
    scheduler.planner.policy = Alternate(4, arms=("model", "lookup"))
    for i, ids in enumerate(model.encode(prompts[:4])):
        scheduler.submit(model.new_request(i, ids, 24, model.sampling_params(), i, k=scheduler.lookahead))
    while scheduler.busy:
        scheduler.step()
    stats = scheduler.stats.speculation
    assert ("model", True) in asked  # the model drafted where lookup had found something
    assert stats.rounds == len(asked) and stats.front_rounds == sum(arm == "lookup" for arm, _ in asked)


def test_draft_model_reports_what_it_must_take_in(bundles, prompts, whole_draft_context):
    """`behind` is what the next drafting round's catch-up enters: the prompts (but the pending token) of
    rows not taken in yet, then nothing."""
    model = specc.load(bundles["draft"])
    scheduler = Scheduler(model, k="auto")
    for i, ids in enumerate(model.encode(prompts[:4])):
        scheduler.submit(model.new_request(i, ids, 20, model.sampling_params(), i, k=scheduler.lookahead))
    admit(scheduler)
    batch = scheduler.batch
    lag = scheduler.drafter.behind(batch)
    assert lag == [len(s.tokens) - 1 for s in batch.seqs] and min(lag) > 0
    proposal = scheduler.drafter.propose(batch, batch.params, DraftPlan(2))
    assert proposal.record.catch_up_tokens == sum(lag) and proposal.record.catch_up_seconds > 0
    assert scheduler.drafter.behind(batch) == [0] * 4


def test_lookup_in_front_owes_nothing_where_lookup_drafts_every_row(bundles, prompts):
    """Prompt lookup in front of the draft model: a round where lookup finds a continuation for every row
    never runs the model, so it has nothing to take in first; otherwise the model's catch-up."""
    model = specc.load(bundles["lookup_first"])
    scheduler = Scheduler(model, k="auto")
    for i, ids in enumerate(model.encode(prompts[:2])):
        scheduler.submit(model.new_request(i, ids, 20, model.sampling_params(), i, k=scheduler.lookahead))
    admit(scheduler)
    batch, drafter = scheduler.batch, scheduler.drafter
    lag = drafter.model.behind(batch)
    assert min(lag) > 0
    for seq in batch.seqs:  # a context that ends by repeating its own start: lookup finds a continuation
        seq.out.extend(seq.prompt[:3])
    assert all(drafter.front.finds(batch)) and drafter.behind(batch) == [0, 0]
    seq = batch.seqs[0]
    seq.out.append(max(seq.tokens) + 1)  # a token never seen before: no continuation
    assert not drafter.front.finds(batch)[0] and drafter.behind(batch) == drafter.model.behind(batch)


def test_calls_start_from_what_earlier_calls_learned(bundles, prompts):
    """`generate(k="auto")` calls on one model share its policy: the second call does not learn the costs
    and acceptance again from nothing (a first round of plain decoding, priors), only its requests are new."""
    model = specc.load(bundles["prompt_lookup"])
    model.generate(prompts[:2], max_new_tokens=12, k="auto")
    (policy,) = model.policies.values()
    rounds, learned = policy.round_no, dict(policy.plain)
    assert rounds > 0 and 2 in learned
    policy.stats["draft"].rows.setdefault(0, deque([(1, 1, True)]))  # a request's history, as a call may leave it
    scheduler = Scheduler(model, k="auto")
    assert scheduler.policy is policy and not policy.stats["draft"].rows  # the old requests are forgotten
    model.generate(prompts[2:4], max_new_tokens=12, k="auto")
    assert list(model.policies.values()) == [policy] and policy.round_no > rounds


@pytest.fixture(params=["adaptive", "flipping"])
def policy_kind(request, monkeypatch):
    if request.param == "flipping":
        monkeypatch.setattr("specc.runtime.planning.AdaptiveK", FlippingK)
    return request.param


@pytest.mark.parametrize("kind", ["draft", "wrong", "self", "prompt_lookup", "lookup_first", "early_exit", "verify_head"])
def test_auto_k_greedy_equals_target_only(bundles, prompts, kind, policy_kind):
    model = specc.load(bundles[kind])
    chunk = prompts[:12]
    fast = model.generate(chunk, max_new_tokens=20, k="auto")
    stats = model.last_stats.to_dict()
    slow = model.generate(chunk, max_new_tokens=20, speculative=False)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    assert stats["rounds"] > 0


def test_flipping_policy_really_flips(bundles, prompts, monkeypatch):
    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", FlippingK)
    model = specc.load(bundles["draft"])
    scheduler = Scheduler(model, k="auto")
    for i, ids in enumerate(model.encode(prompts[:4])):
        scheduler.submit(model.new_request(i, ids, 20, model.sampling_params(), i, k=scheduler.lookahead))
    while scheduler.busy:
        scheduler.step()
    chosen = list(scheduler.policy.chosen)
    assert len(set(chosen)) >= 4 and sum(a != b for a, b in zip(chosen, chosen[1:])) > len(chosen) // 2


def test_draft_prefill_is_lazy_and_probes_skip_cold_rows(bundles, prompts, monkeypatch, whole_draft_context):
    """A draft model takes in a prompt only in the first round that drafts for its row (none at
    admission); an idle probe leaves rows it has not taken in without drafts. With the target as its
    own draft every draft made must still be accepted (a catch-up at wrong positions would not be),
    and the output is the target's."""
    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", FlippingK)
    model = specc.load(bundles["self"])
    scheduler = Scheduler(model, k="auto")
    for i, ids in enumerate(model.encode(prompts[:10])):
        scheduler.submit(model.new_request(i, ids, 20, model.sampling_params(), i, k=scheduler.lookahead))
    done = {e.index: list(e.token_ids) for e in admit(scheduler)}
    assert scheduler.batch.draft_state.lengths.tolist() == [0, 0, 0, 0]  # admitted, nothing drafted yet
    assert max(len(s.prompt) for s in scheduler.batch.seqs) > 16  # longer than a catch-up
    probe = scheduler.drafter.propose(scheduler.batch, scheduler.batch.params, DraftPlan(3, take_in=False))
    assert probe.record.skipped == [0, 1, 2, 3] and probe.lengths.tolist() == [0, 0, 0, 0]
    assert scheduler.batch.draft_state.lengths.tolist() == [0, 0, 0, 0]
    skipped = 0
    while scheduler.busy:
        for event in scheduler.step():
            done.setdefault(event.index, []).extend(event.token_ids)
        skipped += len(scheduler.last_round.skipped) if scheduler.last_round else 0
    assert skipped > 0 and scheduler.stats.speculation.drafted > 0
    assert scheduler.stats.speculation.accepted == scheduler.stats.speculation.drafted
    slow = model.generate(prompts[:10], max_new_tokens=20, speculative=False)
    assert [done[i] for i in range(10)] == [c.token_ids for c in slow]


def test_a_probe_takes_in_a_lone_row(bundles, prompts, whole_draft_context):
    """At batch 1 a probe that skipped the row would draft nothing and the arm would never be measured:
    it takes the row in. With the target as its own draft every draft is accepted; output is the target's."""
    class AlwaysProbe(AdaptiveK):
        def choose(self, rows, remaining=None, behind=None, finds=None):
            return DraftPlan(3, "draft", take_in=len(rows) == 1, stop_chain=True)  # a probe (a lone row is taken in)

    model = specc.load(bundles["self"])
    scheduler = Scheduler(model, k="auto", max_batch=1)
    scheduler.planner.policy = AlwaysProbe(4)
    for i, ids in enumerate(model.encode(prompts[:3])):
        scheduler.submit(model.new_request(i, ids, 20, model.sampling_params(), i, k=scheduler.lookahead))
    done: dict[int, list[int]] = {}
    while scheduler.busy:
        for event in scheduler.step():
            done.setdefault(event.index, []).extend(event.token_ids)
    assert scheduler.stats.speculation.drafted > 0
    assert scheduler.stats.speculation.accepted == scheduler.stats.speculation.drafted
    slow = model.generate(prompts[:3], max_new_tokens=20, speculative=False)
    assert [done[i] for i in range(3)] == [c.token_ids for c in slow]


def test_auto_k_bad_values_are_refused(bundles):
    model = specc.load(bundles["draft"])
    with pytest.raises(RequestError, match="'auto'"):
        model.generate(["abc"], k="fast")


def test_early_stops_settings(bundles):
    """stop_below outside [0, 1] is refused; k auto with and without early stops learns in separate policies
    (a stopped chain counts as a rejection, so the two measure different acceptance)."""
    model = specc.load(bundles["draft"])
    with pytest.raises(RequestError, match=r"\[0, 1\]"):
        Scheduler(model, k=3, stop_below=2)
    assert Scheduler(model, k=3).stop_below == 0.0 and Scheduler(model, k=3, stop_below=0.4).stop_below == 0.4
    assert Scheduler(model, k="auto", stop_below=0.5).policy is not Scheduler(model, k="auto").policy


def _spy_on_stops(monkeypatch) -> list[tuple[int, list[int], float]]:
    """Record (k asked, drafts per row, stop_below) of every round a draft model drafts."""
    from specc.runtime.drafters.model import ModelDrafter

    seen, propose = [], ModelDrafter.propose

    def spy(self, batch, params, plan):
        proposal = propose(self, batch, params, plan)
        seen.append((plan.k, proposal.lengths.tolist(), proposal.record.stop_below))
        return proposal

    monkeypatch.setattr(ModelDrafter, "propose", spy)
    return seen


def test_auto_k_with_early_stops_equals_target_only(bundles, prompts, monkeypatch):
    """k auto with draft.stop_below: k is the longest chain a round asks for, and a row's chain ends once the
    product of the probabilities the draft model gave its drafts falls below the policy's threshold. Under a
    policy that changes k and the threshold every round, greedy output stays the target's."""
    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", FlippingK)
    model = specc.load(bundles["draft"])
    seen = _spy_on_stops(monkeypatch)
    chunk = prompts[:12]
    fast = model.generate(chunk, max_new_tokens=20, k="auto", stop_below=0.3)
    assert [c.token_ids for c in fast] == [c.token_ids for c in model.generate(chunk, max_new_tokens=20, speculative=False)]
    lengths = [(k, d) for k, ds, stop in seen if stop for d in ds if d]
    assert lengths and any(d < k for k, d in lengths) and any(d > 1 for k, d in lengths)


# -- sampling: the exact distribution under adaptive and flipping k -------------------------------
N, BATCH = 4096, 512


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return small_vocab_bundle(tmp_path_factory.mktemp("adaptive_vocab"), "onnxruntime")


def _draw(bundle, params: SamplingParams, stop_below: float = 0.0):
    model = specc.load(bundle)
    out, stats = [], RunStats()
    for lo in range(0, N, BATCH):
        done = model.generate([PROMPT] * BATCH, max_new_tokens=3, seed=list(range(lo, lo + BATCH)), k="auto",
                              temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                              stop_below=stop_below)
        out += [c.token_ids for c in done]
        stats.merge(model.last_stats)
    return np.array(out), stats.to_dict()


def test_auto_k_sampled_output_has_target_distribution(small_vocab, policy_kind, monkeypatch):
    """Under the flipping policy with early stops: rows whose chains end where the draft is unsure stay exact."""
    target, bundle = small_vocab
    params = SamplingParams(0.8, 6, 0.9)
    exact = exact_marginals(target, params)
    seen = _spy_on_stops(monkeypatch)
    samples, stats = _draw(bundle, params, stop_below=0.5 if policy_kind == "flipping" else 0.0)
    assert 0.01 < stats["acceptance_rate"] < 0.95
    if policy_kind == "flipping":
        rows = [(k, d) for k, lengths, stop in seen if stop for d in lengths if d]
        assert 0.1 < sum(d < k for k, d in rows) / len(rows) < 0.9, "early stops should be common but not universal"
    for pos in range(3):
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, (
            f"position {pos}, TV {total_variation(samples[:, pos], exact[pos]):.3f}")


def _accept_everything(p, q, draft, n_draft, u_accept, u_next):
    import torch

    rows = torch.arange(p.shape[0])
    return n_draft, sampling.sample(p[rows, n_draft], u_next)


def test_broken_rule_is_caught_under_flipping_k(small_vocab, monkeypatch):
    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", FlippingK)
    monkeypatch.setattr(sampling, "accept_sampled", _accept_everything)
    target, bundle = small_vocab
    params = SamplingParams(1.0)
    exact = exact_marginals(target, params)
    samples, _ = _draw(bundle, params)
    assert min(chi2_pvalue(samples[:, pos], exact[pos]) for pos in (1, 2)) < FAIL_P
