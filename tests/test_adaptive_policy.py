"""The adaptive policy's maths (runtime/adaptive.py's AdaptiveK, and chain stops): what it chooses from the rounds
it observed. No bundles: rounds are fed as records."""
from __future__ import annotations

import pytest

from specc.runtime.adaptive import PROBE_SHARE, AdaptiveK, RoundRecord


def _feed(policy: AdaptiveK, rows: list[int], k: int, accepted: int, seconds: float, draft: float = 0.0) -> None:
    policy.observe(RoundRecord(rows, k, [k] * len(rows), [min(accepted, k)] * len(rows), draft, seconds - draft, seconds))


def test_policy_drafts_long_when_drafts_are_accepted_and_verify_is_cheap():
    policy = AdaptiveK(8)
    _feed(policy, [0], 0, 0, 0.010)
    for _ in range(10):
        _feed(policy, [0], 8, 8, 0.012)
    assert policy.choose([0]).k >= 6


def test_policy_stops_drafting_when_nothing_is_accepted_and_probes_later():
    """Probes after 5 plain rounds, then after 10, 20, ... (up to probe_idle_max) while drafting does not pay;
    back to 5 once it pays again."""
    policy = AdaptiveK(4, probe_idle=5, probe_idle_max=20)
    _feed(policy, [0, 1], 0, 0, 0.010)
    for _ in range(10):
        _feed(policy, [0, 1], 4, 0, 0.020, draft=0.004)
    ks = [policy.choose([0, 1]).k for _ in range(80)]
    assert [i for i, k in enumerate(ks) if k] == [4, 14, 34, 54, 74], ks
    for _ in range(30):
        _feed(policy, [0, 1], 4, 4, 0.011)
    assert policy.choose([0, 1]).k > 0 and policy.idle_gap[2, "draft"] == 5


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
        batch1.append(policy.choose([0]).k)
        batch2.append(policy.choose([0, 1]).k)
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
    assert policy.choose(one).k == 2  # draft 3 is never accepted: drafting it would only cost
    assert policy.choose(eight).k == 0


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
    assert policy.choose(rows).k == 0


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
    assert (policy.choose(rows).k > 0) == expect_drafting


def _lone_row_with_a_measured_catch_up(policy: AdaptiveK) -> None:
    """Plain rounds of 10 ms, drafting rounds of one accepted draft at 18.5 ms (~8% more tokens a second) and
    a catch-up that cost 1 ms a token."""
    for _ in range(8):
        _feed(policy, [0], 0, 0, 0.010)
        _feed(policy, [0], 1, 1, 0.0185)
    policy.observe(RoundRecord([0], 1, [1], [1], 0.0, 0.0185, 0.0185, catch_up_seconds=0.1, catch_up_tokens=100))


@pytest.mark.parametrize(("behind", "drafts"), [(0, True), (5, True), (200, False)])
def test_a_lone_row_needs_a_margin_only_while_it_owes_a_catch_up(behind, drafts):
    """Drafting that promises ~8% more than plain decoding runs at once for a lone row the draft has taken in (or
    nearly: 5 ms of catch-up, under a plain round's 10), but not for one it must first take 200 tokens of, even
    with its catch-up spread over 100,000 tokens: had the gain been an estimate's error, the catch-up would be lost."""
    policy = AdaptiveK(5, min_gain=1.1)
    _lone_row_with_a_measured_catch_up(policy)
    rates = policy.rates([0])
    assert 1.0 < max(rates[k] for k in range(1, 6)) / rates[0] < 1.1
    assert (policy.choose([0], remaining=[100_000], behind={"draft": [behind]}).k > 0) == drafts


@pytest.mark.parametrize(("behind", "first_probe"), [(0, 3), (100, 199)])
def test_a_lone_row_is_probed_when_the_catch_up_fits_a_share_of_the_plain_rounds(behind, first_probe):
    """A probe of a lone row takes it in: with 100 tokens to take in at 1 ms each (0.1 s), the first idle probe
    waits until the plain rounds since the draft last ran (10 ms each) add up to 0.1 s / PROBE_SHARE; with nothing
    to take in, it comes after probe_idle rounds."""
    policy = AdaptiveK(5, probe_idle=4)
    _lone_row_with_a_measured_catch_up(policy)
    for _ in range(20):
        _feed(policy, [0], 2, 0, 0.030)  # drafting stopped paying
    ks = [policy.choose([0], remaining=[64], behind={"draft": [behind]}).k for _ in range(300)]
    assert ks.index(next(k for k in ks if k)) == first_probe, ks[:8]
    assert PROBE_SHARE == 0.05


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
    plan = policy.choose([0, 1, 2, 3])
    assert plan.k > 0 and plan.arm == want


@pytest.mark.parametrize(("found", "want"), [(True, "lookup"), (False, "model")])
def test_the_lookup_arm_is_priced_by_this_rounds_hits(found, want):
    """Batch 1, lookup in front of a draft model: lookup (free, all accepted when it finds something) beats
    the model on average, but a round where lookup finds nothing gets no drafts from it: the model's then."""
    policy = AdaptiveK(4, arms=("model", "lookup"))
    policy.observe(RoundRecord([0], 0, [0], [0], 0.0, 0.010, 0.010, arm="model"))
    for _ in range(20):
        policy.observe(RoundRecord([0], 4, [4], [2], 0.004, 0.012, 0.016, arm="model"))
        policy.observe(RoundRecord([0], 4, [4], [4], 0.0, 0.012, 0.012, arm="lookup"))
    plan = policy.choose([0], finds={"model": None, "lookup": [found]})
    assert plan.k > 0 and plan.arm == want


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
        plan = policy.choose([0], finds={"model": None, "lookup": [False]})
        k = plan.k
        chosen.append((k, plan.arm))
        policy.observe(RoundRecord([0], k, [k], [0], 0.0, 0.010, 0.017 if k else 0.010, arm=plan.arm))
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
        plan = policy.choose(rows, finds={"model": None, "lookup": [found] * 4})
        k = plan.k
        assert found or not k or plan.arm == "model", "lookup that finds nothing drafts nothing: a plain round"
        if k and plan.arm == "model":
            model_rounds.append(i)
        drafted = [k] * 4 if k and (found or plan.arm == "model") else [0] * 4
        seconds = 0.040 if not k else (0.045 if plan.arm == "lookup" else 0.090)
        accepted = drafted if plan.arm == "lookup" else [0] * 4
        policy.observe(RoundRecord(rows, k, drafted, accepted, 0.0, seconds, seconds, arm=plan.arm))
    gaps = [b - a for a, b in zip(model_rounds, model_rounds[1:])]
    assert len(model_rounds) <= 5 and gaps == sorted(gaps), model_rounds


def test_probes_of_another_arm_only_measure():
    """While lookup wins, every few rounds probe the model arm; such a probe must not make the draft model
    take in rows it has not (`measuring`: the scheduler drafts with take_in=False)."""
    policy = AdaptiveK(4, min_gain={"model": 1.1, "lookup": 1.0}, arms=("model", "lookup"), probe_every=4)
    _arm_round(policy, "model", 0, [0] * 4, [0] * 4, 0.010)
    for _ in range(10):
        _arm_round(policy, "model", 4, [4] * 4, [1] * 4, 0.016)
        _arm_round(policy, "lookup", 4, [4, 4, 0, 0], [4, 4, 0, 0], 0.012)
    picks = []
    for _ in range(32):
        plan = policy.choose([0, 1, 2, 3])
        k = plan.k
        picks.append((k, plan.arm, not plan.take_in))
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
    plan = policy.choose(rows, remaining=[remaining] * 4, behind={"draft": [behind] * 4})
    k = plan.k
    assert (k > 0) == drafts


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
    assert policy.choose([0]).k == 8


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
    assert policy.choose([5], finds={"draft": [3]}).k == 8
    assert policy.choose([5], finds={"draft": [1]}).k == 0
    plan = policy.choose([5], finds={"draft": [0]})
    assert plan.k == 0 and plan.take_in  # nothing found: a plain round


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
    picks = {cls: (lambda plan: (plan.k, plan.arm))(policy.choose([0], finds={"model": None, "lookup": [cls]}))
             for cls in (1, 3)}
    assert picks[1][0] > 0 and picks[1][1] == "model"
    assert picks[3] == (4, "lookup")


# -- early stops ---------------------------------------------------------------------------------
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
    plan = policy.choose([0], finds={"model": None, "lookup": [0]})
    k = plan.k
    assert k > 0 and plan.arm == "model"
    rate = policy.rates([0], "model")[k]
    assert plan.stop_below == pytest.approx(0.005 * rate, rel=1e-6) and 0.3 < plan.stop_below < 0.8
    for _ in range(40):
        round_("lookup", 3, 3, 3, 0.008)
    plan = policy.choose([0], finds={"model": None, "lookup": [3]})
    assert plan.k and plan.arm == "lookup"
    assert plan.stop_below == 0.0


@pytest.mark.parametrize(("accept_all", "probes_plain"), [(True, False), (False, True)])
def test_plain_decoding_is_probed_only_where_it_is_near_the_best(accept_all, probes_plain):
    """Batch 1, rounds of 10 ms + 3 ms per draft, plain rounds 10 ms. Drafts all accepted: k = 4 makes
    ~2.3x plain decoding's tokens per second, and the periodic probes never run k = 0 (a price that far off
    cannot turn the choice); the first draft accepted every other round: k = 1 makes ~1.15x, and they do."""
    policy = AdaptiveK(4)
    policy.observe(RoundRecord([0], 0, [0], [0], 0.0, 0.010, 0.010))
    plain = 0
    for i in range(96):
        plan = policy.choose([0])
        k = plan.k
        accepted = k if accept_all else min(k, i % 2)
        policy.observe(RoundRecord([0], k, [k], [accepted], 0.003 * k, 0.010, 0.010 + 0.003 * k))
        plain += i > 8 and k == 0
    assert (plain > 0) == probes_plain
