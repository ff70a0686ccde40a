"""Adaptive speculation (k "auto"): the policy's choices, and output that stays exact whatever k it picks."""
from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest

import specc
from specc.runtime.drafters import DraftPlan
from specc.errors import RequestError
from specc.speculation import sampling
from specc.runtime.adaptive import AdaptiveK, RoundRecord
from specc.runtime.scheduler import Scheduler
from specc.runtime.stats import RunStats
from specc.speculation.sampling import SamplingParams

from lossless_checks import small_vocab_bundle
from stats_helpers import FAIL_P, PASS_P, chi2_pvalue, total_variation
from test_lossless_sampling import PROMPT, exact_marginals


def _feed(policy: AdaptiveK, rows: list[int], k: int, accepted: int, seconds: float, draft: float = 0.0) -> None:
    policy.observe(RoundRecord(rows, k, [k] * len(rows), [min(accepted, k)] * len(rows), draft, seconds - draft, seconds))


def test_policy_drafts_long_when_drafts_are_accepted_and_verify_is_cheap():
    policy = AdaptiveK(8)
    _feed(policy, [0], 0, 0, 0.010)
    for _ in range(10):
        _feed(policy, [0], 8, 8, 0.012)
    assert policy.choose([0]) >= 6


def test_policy_stops_drafting_when_nothing_is_accepted_and_probes_later():
    """Probes after 5 plain rounds, then after 10, 20, ... (up to probe_idle_max) while drafting does not pay;
    back to 5 once it pays again."""
    policy = AdaptiveK(4, probe_idle=5, probe_idle_max=20)
    _feed(policy, [0, 1], 0, 0, 0.010)
    for _ in range(10):
        _feed(policy, [0, 1], 4, 0, 0.020, draft=0.004)
    ks = [policy.choose([0, 1]) for _ in range(80)]
    assert [i for i, k in enumerate(ks) if k] == [4, 14, 34, 54, 74], ks
    for _ in range(30):
        _feed(policy, [0, 1], 4, 4, 0.011)
    assert policy.choose([0, 1]) > 0 and policy.idle_gap[2, "draft"] == 5


def test_probe_gaps_are_kept_per_batch_size():
    """Drafting pays at batch 1 (cheap verify) and not at batch 2 (dear verify): the rounds at batch 1,
    which draft, do not bring batch 2's probes back to every few rounds."""
    policy = AdaptiveK(4, probe_idle=5, probe_idle_max=20)
    for _ in range(10):
        _feed(policy, [0], 0, 0, 0.008)
        _feed(policy, [0], 4, 2, 0.009)
        _feed(policy, [0, 1], 0, 0, 0.010)
        _feed(policy, [0, 1], 4, 2, 0.080)
    batch1, batch2 = [], []
    for _ in range(40):
        batch1.append(policy.choose([0]))
        batch2.append(policy.choose([0, 1]))
    assert sum(k > 0 for k in batch1) >= 35
    assert [i for i, k in enumerate(batch2) if k] == [4, 14, 34] and policy.idle_gap == {(1, "draft"): 5, (2, "draft"): 20}


def test_policy_prices_rounds_at_the_batch_size():
    """Verify cost that grows with the batch: drafting pays at batch 1 but not at batch 8."""
    policy = AdaptiveK(4)
    one, eight = [0], list(range(8))
    for _ in range(5):
        _feed(policy, one, 0, 0, 0.010)
        _feed(policy, one, 4, 2, 0.012)
        _feed(policy, eight, 0, 0, 0.020)
        _feed(policy, eight, 4, 2, 0.120)
    assert policy.choose(one) == 2  # draft 3 is never accepted: drafting it would only cost
    assert policy.choose(eight) == 0


def test_plain_rounds_are_priced_by_what_they_cost():
    """Lookup in front of a draft model: rounds of the same width cost 12 or 30 ms (lookup or model), so
    the cost line comes out flat and its intercept (~20 ms) is no price for a plain round (10 ms).
    One draft accepted in every other round (1.5 tokens a round at ~20 ms) is slower than plain decoding."""
    policy, rows = AdaptiveK(5), [0, 1, 2, 3]
    _feed(policy, rows, 0, 0, 0.010)
    for i in range(24):
        _feed(policy, rows, (3, 4, 5)[i % 3], i % 2, (0.021, 0.030, 0.012)[i % 3])
        if i % 8 == 0:
            _feed(policy, rows, 0, 0, 0.010)
    assert policy.rates(rows)[0] == pytest.approx(400, rel=0.01)
    assert policy.choose(rows) == 0


@pytest.mark.parametrize(("min_gain", "expect_drafting"), [(1.0, True), (1.1, False)])
def test_drafting_must_promise_a_margin(min_gain, expect_drafting):
    """Drafting that promises ~8% more than plain decoding does not run with the default margin."""
    policy, rows = AdaptiveK(5, min_gain=min_gain), [0, 1, 2, 3]
    for _ in range(8):
        _feed(policy, rows, 0, 0, 0.010)
        _feed(policy, rows, 1, 1, 0.0185)
    rates = policy.rates(rows)
    gain = max(rates[k] for k in range(1, 6)) / rates[0]
    assert 1.0 < gain < 1.1
    assert (policy.choose(rows) > 0) == expect_drafting


def test_a_lone_row_needs_no_margin():
    """At batch 1 an idle probe takes the row in a few plain rounds later anyway (its catch-up is paid either
    way), so drafting that promises ~8% more than plain decoding runs at once despite a 1.1 margin."""
    policy = AdaptiveK(5, min_gain=1.1)
    for _ in range(8):
        _feed(policy, [0], 0, 0, 0.010)
        _feed(policy, [0], 1, 1, 0.0185)
    rates = policy.rates([0])
    assert 1.0 < max(rates[k] for k in range(1, 6)) / rates[0] < 1.1
    assert policy.choose([0]) > 0


def test_the_margin_is_for_drafters_with_a_prefill(bundles):
    """A draft model (alone or behind lookup) pays a prefill per row it drafts for; lookup and early exit do not."""
    margins = {kind: Scheduler(specc.load(bundles[kind]), k="auto").policy.min_gain
               for kind in ("draft", "lookup_first", "prompt_lookup", "early_exit")}
    assert margins == {"draft": {"draft": 1.1}, "lookup_first": {"model": 1.1, "lookup": 1.0},
                       "prompt_lookup": {"draft": 1.0}, "early_exit": {"draft": 1.0}}


def _arm_round(policy: AdaptiveK, arm: str, k: int, drafted: list[int], accepted: list[int], seconds: float) -> None:
    policy.observe(RoundRecord([0, 1, 2, 3], k, drafted, accepted, 0.0, seconds, seconds, arm=arm))


@pytest.mark.parametrize(("model_accepts", "want"), [(1, "lookup"), (4, "model")])
def test_the_arm_that_pays_is_chosen(model_accepts, want):
    """Lookup in front of a draft model at batch 4: lookup finds drafts for half the rows (all accepted,
    no model call: 12 ms, 1000 tokens/s), the model drafts for every row at 16 ms a round. A model whose
    first draft alone is accepted (500 tokens/s) loses to lookup alone; one whose drafts are all
    accepted (1250 tokens/s) wins."""
    policy = AdaptiveK(4, min_gain={"model": 1.1, "lookup": 1.0}, arms=("model", "lookup"))
    _arm_round(policy, "model", 0, [0] * 4, [0] * 4, 0.010)
    for i in range(30):
        _arm_round(policy, "model", 4, [4] * 4, [model_accepts] * 4, 0.016)
        _arm_round(policy, "lookup", 4, [4, 4, 0, 0], [4, 4, 0, 0], 0.012)
        if i % 8 == 0:
            _arm_round(policy, "model", 0, [0] * 4, [0] * 4, 0.010)
    assert policy.choose([0, 1, 2, 3]) > 0 and policy.arm == want


@pytest.mark.parametrize(("found", "want"), [(True, "lookup"), (False, "model")])
def test_the_lookup_arm_is_priced_by_this_rounds_hits(found, want):
    """Batch 1, lookup in front of a draft model: lookup (free, all accepted when it finds something) beats
    the model on average, but a round where lookup finds nothing gets no drafts from it: the model's then."""
    policy = AdaptiveK(4, arms=("model", "lookup"))
    policy.observe(RoundRecord([0], 0, [0], [0], 0.0, 0.010, 0.010, arm="model"))
    for _ in range(20):
        policy.observe(RoundRecord([0], 4, [4], [2], 0.004, 0.012, 0.016, arm="model"))
        policy.observe(RoundRecord([0], 4, [4], [4], 0.0, 0.012, 0.012, arm="lookup"))
    assert policy.choose([0], finds={"model": None, "lookup": [found]}) > 0 and policy.arm == want


def test_lookup_that_finds_nothing_is_plain_decoding_and_the_model_is_probed():
    """Batch 1, lookup in front of a draft model whose first rounds went badly: where lookup finds nothing, the
    round is plain decoding (k = 0, not a lookup round that drafts nothing), so after a few of them an idle
    probe tries the model again; a probe never goes to lookup, which would find nothing."""
    policy = AdaptiveK(4, min_gain={"model": 1.1, "lookup": 1.0}, arms=("model", "lookup"))
    policy.observe(RoundRecord([0], 0, [0], [0], 0.0, 0.010, 0.010, arm="model"))
    for _ in range(5):
        policy.observe(RoundRecord([0], 2, [2], [0], 0.005, 0.012, 0.017, arm="model"))  # nothing accepted
    chosen = []
    for _ in range(10):
        k = policy.choose([0], finds={"model": None, "lookup": [False]})
        chosen.append((k, policy.arm))
        policy.observe(RoundRecord([0], k, [k], [0], 0.0, 0.010, 0.017 if k else 0.010, arm=policy.arm))
    assert all(k == 0 for k, _ in chosen[:policy.probe_idle - 1]), chosen
    assert any(k > 0 and arm == "model" for k, arm in chosen)
    assert not any(k > 0 and arm == "lookup" for k, arm in chosen)


def test_lookup_rounds_do_not_bring_the_models_probes_back():
    """Batch 4: lookup drafts (and pays) whenever every row finds a continuation, plain decoding wins otherwise,
    the draft model never pays. The model's idle-probe gap keeps doubling through the lookup rounds (the
    probes of the best choice's neighbours and of other arms every `probe_every` rounds are left out)."""
    policy = AdaptiveK(4, min_gain={"model": 1.1, "lookup": 1.0}, arms=("model", "lookup"), probe_idle=4, probe_idle_max=32,
                       probe_every=1000)
    rows = [0, 1, 2, 3]
    policy.observe(RoundRecord(rows, 0, [0] * 4, [0] * 4, 0.0, 0.040, 0.040, arm="model"))
    for _ in range(5):
        policy.observe(RoundRecord(rows, 3, [3] * 4, [0] * 4, 0.030, 0.060, 0.090, arm="model"))
        policy.observe(RoundRecord(rows, 3, [3] * 4, [3] * 4, 0.0, 0.045, 0.045, arm="lookup"))
    model_rounds = []
    for i in range(96):
        found = i % 3 == 0
        k = policy.choose(rows, finds={"model": None, "lookup": [found] * 4})
        assert found or not k or policy.arm == "model", "lookup that finds nothing drafts nothing: a plain round"
        if k and policy.arm == "model":
            model_rounds.append(i)
        drafted = [k] * 4 if k and (found or policy.arm == "model") else [0] * 4
        seconds = 0.040 if not k else (0.045 if policy.arm == "lookup" else 0.090)
        accepted = drafted if policy.arm == "lookup" else [0] * 4
        policy.observe(RoundRecord(rows, k, drafted, accepted, 0.0, seconds, seconds, arm=policy.arm))
    gaps = [b - a for a, b in zip(model_rounds, model_rounds[1:])]
    assert len(model_rounds) <= 5 and gaps == sorted(gaps), model_rounds


def test_the_model_arm_drafts_with_the_model_where_lookup_finds(bundles, prompts):
    """Lookup in front of a draft model: the policy's "model" arm drafts with the model in every round, also
    where lookup has a continuation (whether a match is long enough to beat the model is the policy's choice,
    made with its length in hand); the "lookup" arm's rounds count as lookup rounds in the statistics."""
    class Alternate(AdaptiveK):
        def choose(self, rows, remaining=None, behind=None, finds=None):
            self.arm, self.measuring = ("model", "lookup")[self.round_no % 2], False
            self.round_no += 1
            asked.append((self.arm, finds["lookup"][0] > 0))
            return 3

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
    assert stats.rounds == len(asked) and stats.lookup_rounds == sum(arm == "lookup" for arm, _ in asked)


def test_probes_of_another_arm_only_measure():
    """While lookup wins, every few rounds probe the model arm; such a probe must not make the draft model
    take in rows it has not (`measuring`: the scheduler drafts with warm=False)."""
    policy = AdaptiveK(4, min_gain={"model": 1.1, "lookup": 1.0}, arms=("model", "lookup"), probe_every=4)
    _arm_round(policy, "model", 0, [0] * 4, [0] * 4, 0.010)
    for _ in range(10):
        _arm_round(policy, "model", 4, [4] * 4, [1] * 4, 0.016)
        _arm_round(policy, "lookup", 4, [4, 4, 0, 0], [4, 4, 0, 0], 0.012)
    picks = []
    for _ in range(32):
        k = policy.choose([0, 1, 2, 3])
        picks.append((k, policy.arm, policy.measuring))
    assert all(measuring == (arm == "model") for k, arm, measuring in picks if k)
    assert any(arm == "model" for k, arm, _ in picks if k) and any(arm == "lookup" for k, arm, _ in picks if k)


@pytest.mark.parametrize(("behind", "remaining", "drafts"), [(0, 8, True), (400, 4, False), (400, 4000, True)])
def test_catch_up_is_priced_over_the_rounds_a_row_has_left(behind, remaining, drafts):
    """A draft model that pays (2 tokens a row at 15 ms vs 1 at 10 ms) but must first take in 400 tokens a
    row (at the 1 ms a token its earlier catch-up cost): not worth it for rows about to finish, worth it
    for rows with thousands of tokens left."""
    policy, rows = AdaptiveK(4), [0, 1, 2, 3]
    _feed(policy, rows, 0, 0, 0.010)
    for _ in range(10):
        _feed(policy, rows, 1, 1, 0.015)
    policy.observe(RoundRecord(rows, 1, [1] * 4, [1] * 4, 0.0, 0.015, 0.015, catch_up_seconds=0.1, catch_up_tokens=100))
    assert policy.stats["draft"].catch_up_cost() == pytest.approx(0.001)
    k = policy.choose(rows, remaining=[remaining] * 4, behind={"draft": [behind] * 4})
    assert (k > 0) == drafts


def test_draft_model_reports_what_it_must_take_in(bundles, prompts):
    """`behind` is what the next drafting round's catch-up enters: the prompts (but the pending token) of
    rows not taken in yet, then nothing."""
    model = specc.load(bundles["draft"])
    scheduler = Scheduler(model, k="auto")
    for i, ids in enumerate(model.encode(prompts[:4])):
        scheduler.submit(model.new_request(i, ids, 20, model.sampling_params(), i, k=scheduler.lookahead))
    scheduler._admit()
    batch = scheduler.batch
    lag = scheduler.drafter.behind(batch)
    assert lag == [len(s.tokens) - 1 for s in batch.seqs] and min(lag) > 0
    proposal = scheduler.drafter.propose(batch, batch.params, DraftPlan(2))
    assert proposal.info.catch_up_tokens == sum(lag) and proposal.info.catch_up_seconds > 0
    assert scheduler.drafter.behind(batch) == [0] * 4


def test_lookup_in_front_owes_nothing_where_lookup_drafts_every_row(bundles, prompts):
    """Prompt lookup in front of the draft model: a round where lookup finds a continuation for every row
    never runs the model, so it has nothing to take in first; otherwise the model's catch-up."""
    model = specc.load(bundles["lookup_first"])
    scheduler = Scheduler(model, k="auto")
    for i, ids in enumerate(model.encode(prompts[:2])):
        scheduler.submit(model.new_request(i, ids, 20, model.sampling_params(), i, k=scheduler.lookahead))
    scheduler._admit()
    batch, drafter = scheduler.batch, scheduler.drafter
    lag = drafter.model.behind(batch)
    assert min(lag) > 0
    for seq in batch.seqs:  # a context that ends by repeating its own start: lookup finds a continuation
        seq.out.extend(seq.prompt[:3])
    assert all(drafter.lookup.finds(batch)) and drafter.behind(batch) == [0, 0]
    seq = batch.seqs[0]
    seq.out.append(max(seq.tokens) + 1)  # a token never seen before: no continuation
    assert not drafter.lookup.finds(batch)[0] and drafter.behind(batch) == drafter.model.behind(batch)


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


def test_new_rows_start_from_the_acceptance_of_all_rows():
    policy = AdaptiveK(4)
    for _ in range(20):
        _feed(policy, [0], 4, 0, 0.01)
    alpha_new, _ = policy.row_estimates(99)
    assert alpha_new == pytest.approx(policy.conditional()[1]) and alpha_new < 0.15  # not the prior's 0.5


def test_acceptance_is_learned_per_position():
    """Prompt-lookup-like rounds: the first draft is accepted half the time, but a run that starts is
    copied to the end: the first position's acceptance stays near 0.5, the later ones near 1, and the
    policy drafts the longest chain."""
    policy = AdaptiveK(8)
    _feed(policy, [0], 0, 0, 0.010)
    for i in range(40):
        _feed(policy, [0], 8, 8 if i % 2 else 0, 0.010 + 8 * 0.0005)
    c = policy.conditional()
    assert c[1] == pytest.approx(0.5, abs=0.1) and min(c[2:]) > 0.8
    assert policy.choose([0]) == 8


def test_acceptance_is_learned_per_class_of_draft():
    """Prompt lookup's drafts after a three-token match are accepted, after a one-token match rejected (the
    classes `Drafter.finds` reports): each round is priced with the acceptance of its class, so a round
    whose row matched three tokens drafts the longest chain, and one that matched one token drafts none."""
    policy = AdaptiveK(8)
    _feed(policy, [0], 0, 0, 0.010)
    for i in range(40):
        cls = 3 if i % 2 else 1
        policy.observe(RoundRecord([0], 8, [8], [8 if cls == 3 else 0], 0.0, 0.020, 0.020, classes=[cls]))
    assert policy.conditional(cls=3)[1] > 0.8 and policy.conditional(cls=1)[1] < 0.15
    assert policy.conditional()[1] == pytest.approx(0.5, abs=0.1)  # all drafts together
    assert policy.choose([5], finds={"draft": [3]}) == 8
    assert policy.choose([5], finds={"draft": [1]}) == 0
    assert policy.choose([5], finds={"draft": [0]}) == 0 and not policy.measuring  # nothing found: a plain round


def test_a_short_match_is_drafted_by_the_model_a_long_one_by_lookup():
    """Lookup in front of a draft model at batch 1: the model's drafts are accepted 3 of 4 at 30 ms a round,
    lookup's after a one-token match never, after a three-token match always (20 ms). The match length
    lookup reports for this round decides the arm: the model for a one-token match, lookup for a long one."""
    policy = AdaptiveK(4, arms=("model", "lookup"))
    policy.observe(RoundRecord([0], 0, [0], [0], 0.0, 0.015, 0.015))
    for i in range(30):
        policy.observe(RoundRecord([0], 4, [4], [3], 0.010, 0.020, 0.030, arm="model"))
        cls = 3 if i % 2 else 1
        policy.observe(RoundRecord([0], 4, [4], [4 if cls == 3 else 0], 0.0, 0.020, 0.020, arm="lookup", classes=[cls]))
    picks = {cls: (policy.choose([0], finds={"model": None, "lookup": [cls]}), policy.arm) for cls in (1, 3)}
    assert picks[1][0] > 0 and picks[1][1] == "model"
    assert picks[3] == (4, "lookup")


def test_prompt_lookup_reports_the_length_of_its_match(bundles, prompts):
    """finds and the proposal's classes: the n-gram length matched per row (0: nothing found)."""
    model = specc.load(bundles["prompt_lookup"])
    scheduler = Scheduler(model, k=4)
    for i, ids in enumerate(model.encode(prompts[:2])):
        scheduler.submit(model.new_request(i, ids, 20, model.sampling_params(), i, k=scheduler.lookahead))
    scheduler._admit()
    batch, drafter = scheduler.batch, scheduler.drafter
    first, second = batch.seqs
    first.out.extend(first.prompt[:3])  # ends by repeating its own first tokens
    second.out.append(max(second.tokens) + 1)  # a token never seen before: nothing to continue
    n = drafter.max_ngram  # the recipe's longest n-gram
    assert n >= 2 and drafter.finds(batch) == [n, 0]
    proposal = drafter.propose(batch, batch.params, DraftPlan(4))
    assert proposal.info.classes == [n, 0] and proposal.lengths.tolist()[1] == 0


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


class FlippingK(AdaptiveK):
    """A policy that changes k every round (0 included), in a fixed pseudo-random order; some of its
    drafting rounds are idle probes (a draft model skips rows whose context it has not taken in), and it
    takes the drafter's arms in turn."""

    def __init__(self, k_max: int, **kwargs):
        super().__init__(k_max, **kwargs)
        self.order = itertools.cycle([3, 0, 1, 4, 2, 0, 4, 1, 1, 3, 0, 2])
        self.probes = itertools.cycle([False, True, False, True, False])
        self.arm_order = itertools.cycle(range(5))
        self.thresholds = itertools.cycle([0.3, 0.6, 0.9, 0.1])  # chain-probability stops, where enabled

    def choose(self, rows, remaining=None, behind=None, finds=None):
        k = min(next(self.order), self.k_max)
        self.measuring = bool(k) and next(self.probes)
        self.arm = self.arms[next(self.arm_order) % len(self.arms)]  # lookup first: lookup-only rounds too
        self.stop_below = next(self.thresholds) if k and self.arm in self.stop_arms else 0.0
        self.chosen.append(k)
        return k


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


def test_draft_prefill_is_lazy_and_probes_skip_cold_rows(bundles, prompts, monkeypatch):
    """A draft model takes in a prompt only in the first round that drafts for its row (none at
    admission); an idle probe leaves rows it has not taken in without drafts. With the target as its
    own draft every draft made must still be accepted (a catch-up at wrong positions would not be),
    and the output is the target's."""
    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", FlippingK)
    model = specc.load(bundles["self"])
    scheduler = Scheduler(model, k="auto")
    for i, ids in enumerate(model.encode(prompts[:10])):
        scheduler.submit(model.new_request(i, ids, 20, model.sampling_params(), i, k=scheduler.lookahead))
    done = {e.index: list(e.token_ids) for e in scheduler._admit()}
    assert scheduler.batch.draft_state.lengths.tolist() == [0, 0, 0, 0]  # admitted, nothing drafted yet
    assert max(len(s.prompt) for s in scheduler.batch.seqs) > 16  # longer than a catch-up
    probe = scheduler.drafter.propose(scheduler.batch, scheduler.batch.params, DraftPlan(3, warm=False))
    assert probe.info.skipped == [0, 1, 2, 3] and probe.lengths.tolist() == [0, 0, 0, 0]
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


def test_a_probe_takes_in_a_lone_row(bundles, prompts):
    """At batch 1 a probe that skipped the row would draft nothing and the arm would never be measured:
    it takes the row in. With the target as its own draft every draft is accepted; output is the target's."""
    class AlwaysProbe(AdaptiveK):
        def choose(self, rows, remaining=None, behind=None, finds=None):
            self.measuring = True
            return 3

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
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, f"position {pos}, TV {total_variation(samples[:, pos], exact[pos]):.3f}"


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


# -- cancel --------------------------------------------------------------------------------------
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


def test_generate_cli_takes_k_auto(bundles, capsys):
    from specc.cli import main

    assert main(["generate", str(bundles["draft"]), "--prompt", "abc", "--k", "auto", "--max-new-tokens", "6",
                 "--no-verify", "--json"]) == 0
    assert '"completions"' in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["generate", str(bundles["draft"]), "--prompt", "abc", "--k", "fast"])
    assert info.value.code == 2 and "'auto'" in capsys.readouterr().err


def test_recipe_k_auto_is_the_bundles_default(models_dir, prompts, tmp_path):
    """speculation.k: auto compiles (graphs shaped for k up to AUTO_K_MAX) and generate without k runs adaptive;
    the bundle is compiled for limits.max_batch 1 (torch.export refuses a dynamic dim with min == max), so its
    rows run one at a time."""
    from conftest import build_bundle
    from specc.limits import AUTO_K_MAX

    bundle = build_bundle(tmp_path / "auto", models_dir / "target", {"method": "model", "model": str(models_dir / "draft")},
                          speculation={"k": "auto"}, limits={"max_batch": 1, "max_context": 256})
    model = specc.load(bundle)
    assert model.k == "auto" and Scheduler(model).policy.k_max == AUTO_K_MAX
    assert Scheduler(model, k=2).policy is None and Scheduler(model, speculative=False).k == 0
    fast = model.generate(prompts[:8], max_new_tokens=16)
    assert model.last_stats.to_dict()["rounds"] > 0
    assert [c.token_ids for c in fast] == [c.token_ids for c in model.generate(prompts[:8], max_new_tokens=16,
                                                                                speculative=False)]
    with pytest.raises(RequestError, match="max_batch"):
        Scheduler(model, max_batch=2)


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
        seen.append((plan.k, proposal.lengths.tolist(), proposal.info.stop_below))
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


def test_a_stop_counts_as_a_rejection_and_narrows_the_priced_width():
    """Chains that stopped after 2 of k = 4 drafts, both accepted, gain what a rejection of the third would:
    c_3 falls; the rounds verified 2, so a k = 4 round is priced at a width near 2 (at that batch size)."""
    policy = AdaptiveK(4)
    for _ in range(30):
        policy.observe(RoundRecord([0], 4, [2], [2], 0.004, 0.012, 0.016, stop_below=0.6))
    c = policy.conditional()
    assert c[1] > 0.85 and c[2] > 0.85 and c[3] < 0.2
    assert 2.0 < policy.drafted_width(1, 4) < 2.2 and policy.drafted_width(2, 4) == 4.0
    plain = AdaptiveK(4)
    for _ in range(30):  # lookup found 2 of 4: no stop, nothing counted past the drafts
        plain.observe(RoundRecord([0], 4, [2], [2], 0.0, 0.012, 0.012))
    assert plain.conditional()[3] == pytest.approx(plain.conditional()[2]) and plain.conditional()[3] > 0.85
    assert plain.drafted_width(1, 4) == 4.0


def test_chain_stops_end_a_row_where_its_chains_probability_falls_below_the_threshold():
    """Stops(chain=True): a row stops after the first draft at which the product of its drafts' probabilities
    is below the threshold, 0.7 here (per draft: after the first draft below it). Row 0 drafts at 0.9 each
    (chain 0.9, 0.81, 0.73, 0.66: stops at its fourth), row 1 at 0.6 (stops at its first either way)."""
    import torch

    from specc.runtime.drafters.base import Stops

    def logits(p: float) -> torch.Tensor:  # token 0 drawn with probability p out of two tokens
        return torch.log(torch.tensor([p, 1 - p]))

    for chain, want in [(True, [4, 1]), (False, [5, 1])]:
        stops = Stops(torch.ones(2, dtype=torch.long), 5, 0.7, chain=chain)
        for i in range(5):
            going = stops.update(i, torch.stack([logits(0.9), logits(0.6)]), torch.zeros(2, dtype=torch.long))
        assert stops.n_draft.tolist() == want and going == (not chain)


def test_stop_arms_end_chains_where_a_draft_stops_paying():
    """An arm whose chains end early (stop_arms) gets a chain-probability threshold of its round's seconds per
    drafted position times the tokens per second the round promises: rounds of 10 ms + 5 ms per position
    whose first draft is accepted give 0.005 s x ~100 tokens/s = ~0.5. The lookup arm, which cannot stop,
    gets none."""
    policy = AdaptiveK(6, arms=("model", "lookup"), stop_arms=("model",))

    def round_(arm: str, k: int, drafted: int, accepted: int, seconds: float, stop: float = 0.0) -> None:
        policy.observe(RoundRecord([0], k, [drafted], [accepted], 0.0, seconds, seconds, arm=arm, stop_below=stop))

    round_("model", 0, 0, 0, 0.010)
    for width in (1, 2, 3) * 20:
        round_("model", 6, width, 1, 0.010 + 0.005 * width, stop=0.5)
    k = policy.choose([0], finds={"model": None, "lookup": [0]})
    assert k > 0 and policy.arm == "model"
    rate = policy.rates([0], "model")[k]
    assert policy.stop_below == pytest.approx(0.005 * rate, rel=1e-6) and 0.3 < policy.stop_below < 0.8
    for _ in range(40):
        round_("lookup", 3, 3, 3, 0.008)
    assert policy.choose([0], finds={"model": None, "lookup": [3]}) and policy.arm == "lookup"
    assert policy.stop_below == 0.0


@pytest.mark.parametrize(("accept_all", "probes_plain"), [(True, False), (False, True)])
def test_plain_decoding_is_probed_only_where_it_is_near_the_best(accept_all, probes_plain):
    """Batch 1, rounds of 10 ms + 3 ms per draft, plain rounds 10 ms. Drafts all accepted: k = 4 makes
    ~2.3x plain decoding's tokens per second, and the periodic probes never run k = 0 (a price that far off
    cannot turn the choice); the first draft accepted every other round: k = 1 makes ~1.15x, and they do."""
    policy = AdaptiveK(4)
    policy.observe(RoundRecord([0], 0, [0], [0], 0.0, 0.010, 0.010))
    plain = 0
    for i in range(96):
        k = policy.choose([0])
        accepted = k if accept_all else min(k, i % 2)
        policy.observe(RoundRecord([0], k, [k], [accepted], 0.003 * k, 0.010, 0.010 + 0.003 * k))
        plain += i > 8 and k == 0
    assert (plain > 0) == probes_plain
