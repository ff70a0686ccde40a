"""The scheduler and its rounds on fakes (tests/fakes.py): a lookup-table target and drafters that are right
exactly as often as a test says. Output must be the table's, token for token, and each row's statistics
what the drafter implies; milliseconds a test, no graphs."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from adaptive_helpers import FlippingK
from fakes import (ALPHABET, ALWAYS_RIGHT, ALWAYS_WRONG, AcceptOneMore, FakeModel, TableDrafter, continuation,
                   expected, ragged, right)
from specc.errors import RequestError
from specc.methods import DraftMethod
from specc.runtime.scheduler import Scheduler
from specc.runtime.verifier import Verifier
from specc.speculation.tree import TreeShape

RNG = random.Random(45)
PROMPTS = [[RNG.randrange(32) for _ in range(RNG.randint(1, 8))] for _ in range(8)]
LENGTHS = [5, 12, 9, 16, 3, 7, 1, 11]  # max_new_tokens per request: rows leave at different lengths
TREE = TreeShape(depth=3, branching=2, max_nodes=8)
RULES = {"right": ALWAYS_RIGHT, "wrong": ALWAYS_WRONG, "right1": right(1), "right2": right(2), "ragged": ragged}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The fakes' tensors are tiny: a thread pool only adds its wake-ups (tenfold on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Run:
    """What a driven run produced, by request index."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    stats: dict[int, dict] = field(default_factory=dict)
    widths: list[int] = field(default_factory=list)  # rows in the batch after each step
    joins: int = 0  # steps that admitted requests while others were running
    rounds_by_k: dict[int, int] = field(default_factory=dict)  # the scheduler's RunStats.rounds_by_k


def check_rows(scheduler: Scheduler) -> None:
    """Between rounds, each row's cache holds exactly its tokens but the pending one."""
    batch = scheduler.batch
    if batch is None:
        return
    for b, seq in enumerate(batch.seqs):
        n = int(batch.cache.lengths[b])
        assert n == len(seq.tokens) - 1, f"request {seq.index}: cache length {n}, {len(seq.tokens)} tokens"
        assert batch.cache.k[0, b, 0, :n, 0].long().tolist() == seq.tokens[:-1], f"request {seq.index}: cache tokens"


def drive(model: FakeModel, requests, cancel: dict[int, list[int]] | None = None, **options) -> Run:
    """Submit the requests, step the scheduler to the end (cancelling at step i the indices cancel[i]);
    check the rows after every step."""
    scheduler = Scheduler(model, **options)
    for r in requests:
        scheduler.submit(r)
    run, step = Run(), 0
    while scheduler.busy:
        for index in (cancel or {}).get(step, []):
            scheduler.cancel(index)
        running = scheduler.batch is not None
        events = scheduler.step()
        run.joins += running and any(e.token_ids and not run.tokens.get(e.index) for e in events)
        for e in events:
            run.tokens[e.index] = run.tokens.get(e.index, []) + e.token_ids
            run.text[e.index] = run.text.get(e.index, "") + e.text
            if e.finished:
                assert e.index not in run.reasons, f"request {e.index} finished twice"
                run.reasons[e.index], run.stats[e.index] = e.finish_reason, e.stats
        check_rows(scheduler)
        run.widths.append(len(scheduler.batch.seqs) if scheduler.batch else 0)
        step += 1
        assert step < 500
    run.rounds_by_k = scheduler.stats.rounds_by_k
    return run


def requests(model: FakeModel, n: int = 8, temperature: float | list[float] = 0.0, lengths=LENGTHS, **kw):
    temps = temperature if isinstance(temperature, list) else [temperature] * n
    return [model.request(i, PROMPTS[i], lengths[i], temps[i], **kw) for i in range(n)]


def table_outputs(n: int = 8, lengths=LENGTHS, eos=frozenset()) -> dict[int, list[int]]:
    return {i: expected(PROMPTS[i], lengths[i], eos)[0] for i in range(n)}


def assert_stats_match_the_drafter(run: Run, drafter: TableDrafter) -> None:
    """Each row's rounds, drafts and acceptances are what the drafter proposed and knew to be right."""
    for index, stats in run.stats.items():
        log = drafter.log.get(index, [])
        assert stats["rounds"] == len(log), index
        assert stats["drafted"] == sum(d for d, _ in log), index
        assert stats["accepted"] == sum(r for _, r in log), index


# -- the fakes themselves ---------------------------------------------------------------------------
@pytest.mark.parametrize("max_batch", [1, 4])
def test_plain_rounds_follow_the_table(max_batch):
    """Target-only decoding of the fake target is the table's continuation, at batch 1 and 4."""
    model = FakeModel(max_batch=max_batch)
    run = drive(model, requests(model), speculative=False)
    assert run.tokens == table_outputs()
    assert set(run.reasons.values()) == {"length"} and max(run.widths) == max_batch
    assert all(s["rounds"] == 0 for s in run.stats.values())


def test_the_fake_target_reads_its_cache():
    """A cache that lost a row's history changes what the fake target says next (so a round that commits
    the wrong KV cannot pass unnoticed)."""
    model = FakeModel(max_batch=1)
    scheduler = Scheduler(model, speculative=False)
    prompt = [3, 9, 4]
    scheduler.submit(model.request(0, prompt, 4))
    scheduler.step()
    assert scheduler.batch.seqs[0].out == continuation(prompt, 1)
    scheduler.batch.cache.k[0, 0, 0, 2, 0] += 1  # the token before the pending one, overwritten
    scheduler.step()
    assert scheduler.batch.seqs[0].out[1] != continuation(prompt, 2)[1]


# -- chain rounds ---------------------------------------------------------------------------------
@pytest.mark.parametrize("max_batch", [1, 4])
@pytest.mark.parametrize("rule", list(RULES))
def test_chain_rounds_equal_target_only(rule, max_batch):
    """Every drafter, right always, never, for the first 1 or 2 drafts, or ragged per row and round:
    output equals target-only token for token, and the statistics are exactly what the drafter implies."""
    drafter = TableDrafter(RULES[rule])
    model = FakeModel(drafter, max_batch=max_batch, k=3)
    run = drive(model, requests(model), k=3)
    plain = drive(model, requests(model), speculative=False)
    assert run.tokens == plain.tokens == table_outputs()
    assert set(run.reasons.values()) == {"length"}
    assert_stats_match_the_drafter(run, drafter)
    assert drafter.after == drafter.round > 0  # each round: one proposal, one verdict
    assert run.rounds_by_k == {3: drafter.round} and list(plain.rounds_by_k) == [0]


@pytest.mark.parametrize(("rule", "rounds", "accepted"),
                         [(ALWAYS_RIGHT, 3, 9), (right(1), 6, 6), (ALWAYS_WRONG, 12, 0)])
def test_counts_are_what_the_drafter_implies(rule, rounds, accepted):
    """One row, 13 tokens, k = 3: the first comes from the prefill; rounds that accept a drafts emit a + 1."""
    model = FakeModel(TableDrafter(rule), max_batch=1)
    run = drive(model, [model.request(0, [5, 6], 13)], k=3)
    stats = run.stats[0]
    assert (stats["rounds"], stats["drafted"], stats["accepted"]) == (rounds, 3 * rounds, accepted)
    assert len(run.tokens[0]) == 13 and run.tokens[0] == continuation([5, 6], 13)


def test_a_rule_that_accepts_one_draft_too_many_is_caught():
    """The twin of the equality tests: a verifier that accepts one draft past the first rejection breaks
    the output and the counts."""
    drafter = TableDrafter(ragged)
    model = FakeModel(drafter, max_batch=4, verifier=AcceptOneMore)
    run = drive(model, requests(model), k=3)
    assert run.tokens != table_outputs()
    assert any(s["accepted"] != sum(r for _, r in drafter.log[i]) for i, s in run.stats.items())


def test_ragged_rows_include_rounds_without_drafts():
    """The ragged rule leaves some rows without drafts in some rounds, and now and then every row."""
    drafter = TableDrafter(ragged)
    model = FakeModel(drafter, max_batch=4)
    drive(model, requests(model), k=3)
    drafted = [d for row in drafter.log.values() for d, _ in row]
    assert 0 in drafted and 3 in drafted and len(set(drafted)) == 4


@pytest.mark.parametrize("rule", ["right", "wrong", "right2", "ragged"])
def test_acceptance_in_the_graph(rule):
    """A target compiled with the verification head (the real VerifyHead over the table's logits): chain rounds,
    greedy and sampled rows, give the table's output and the drafter's counts; so do its plain rounds, which
    pass the head a dummy draft."""
    drafter = TableDrafter(RULES[rule])
    model = FakeModel(drafter, max_batch=4, verify_head=True)
    assert model.verify_head
    temps = [0.0, 0.8] * 4
    run = drive(model, requests(model, temperature=temps), k=3)
    assert run.tokens == drive(model, requests(model, temperature=temps), speculative=False).tokens == table_outputs()
    assert_stats_match_the_drafter(run, drafter)


def test_acceptance_in_the_graph_under_a_flipping_policy(monkeypatch):
    """k auto over the verification head: rounds of k = 0 (a dummy draft) and every other k mixed."""
    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", FlippingK)
    drafter = TableDrafter(ragged)
    model = FakeModel(drafter, max_batch=4, k=4, verify_head=True)
    run = drive(model, requests(model, temperature=[0.0, 0.9] * 4), k="auto")
    assert run.tokens == table_outputs() and 0 in run.rounds_by_k and len(run.rounds_by_k) >= 4
    assert_stats_match_the_drafter(run, drafter)


# -- joining and leaving ----------------------------------------------------------------------------
def test_rows_join_mid_run_and_leave_at_different_lengths():
    """Eight requests through two rows: requests join between rounds as others finish; output and counts
    stay exact, the batch never holds more than max_batch rows."""
    drafter = TableDrafter(ragged)
    model = FakeModel(drafter, max_batch=4)
    run = drive(model, requests(model), k=3, max_batch=2)
    assert run.tokens == table_outputs()
    assert max(run.widths) == 2 and 1 in run.widths and run.joins >= 3
    assert_stats_match_the_drafter(run, drafter)


def test_a_request_that_finishes_in_its_prefill_never_joins():
    """max_new_tokens 1: the prefill's token is the whole output; no round runs for it."""
    drafter = TableDrafter(ALWAYS_RIGHT)
    model = FakeModel(drafter)
    run = drive(model, [model.request(0, [1, 2], 1), model.request(1, [3], 6)], k=3)
    assert run.tokens == {0: continuation([1, 2], 1), 1: continuation([3], 6)}
    assert run.stats[0]["rounds"] == 0 and 0 not in drafter.log


def test_cancel_from_the_queue_and_from_the_batch():
    """cancel: a queued request leaves without a token, a running one frees its row at the next step; both
    end with finish_reason "cancelled" and the others stay exact. Unknown indices are ignored."""
    drafter = TableDrafter(ragged)
    model = FakeModel(drafter, max_batch=4)
    run = drive(model, requests(model), k=3, max_batch=3, cancel={2: [1, 6, 42]})
    want = table_outputs()
    assert run.reasons[1] == run.reasons[6] == "cancelled"
    assert run.tokens.get(6, []) == [] and run.stats[6]["rounds"] == 0
    assert 0 < len(run.tokens[1]) < len(want[1]) and run.tokens[1] == want[1][:len(run.tokens[1])]
    others = [i for i in want if i not in (1, 6)]
    assert {i: run.tokens[i] for i in others} == {i: want[i] for i in others}
    assert all(run.reasons[i] == "length" for i in want if i not in (1, 6))
    assert run.stats[1]["rounds"] == len(drafter.log[1])


def test_cancelling_every_running_row_empties_the_batch():
    model = FakeModel(TableDrafter(ALWAYS_RIGHT), max_batch=2)
    scheduler = Scheduler(model, k=3)
    for r in requests(model, 3):
        scheduler.submit(r)
    scheduler.step()
    assert [s.index for s in scheduler.batch.seqs] == [0, 1]
    scheduler.cancel(0)
    scheduler.cancel(1)
    events = scheduler.step()
    assert [(e.index, e.finish_reason) for e in events if e.finished] == [(0, "cancelled"), (1, "cancelled")]
    assert [s.index for s in scheduler.batch.seqs] == [2]  # the queued request took the freed rows


# -- ends inside accepted drafts -------------------------------------------------------------------------
def _eos_inside_drafts(k: int) -> tuple[list[int], int, int]:
    """A prompt, an EOS token and its place e in the prompt's continuation where, with every draft right and
    k drafts a round, EOS is a draft (not the round's own next token) and not the last one."""
    for prompt in PROMPTS:
        out = continuation(prompt, 40)
        for e, t in enumerate(out):
            if e and t not in out[:e] and (e - 1) % (k + 1) < k - 1:
                return prompt, t, e
    raise AssertionError("no prompt puts an EOS inside a round's drafts")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_eos_inside_accepted_drafts_ends_the_row(temperature):
    """Drafts after an accepted EOS are accepted but not emitted; the row ends with "stop"; the other rows
    of the batch run on."""
    k = 4
    prompt, eos, e = _eos_inside_drafts(k)
    drafter = TableDrafter(ALWAYS_RIGHT)
    model = FakeModel(drafter, eos_ids={eos}, max_batch=4)
    others = [p for p in PROMPTS if p != prompt][:3]
    reqs = [model.request(0, prompt, 40, temperature)]
    reqs += [model.request(i + 1, p, 10, temperature) for i, p in enumerate(others)]
    run = drive(model, reqs, k=k)
    assert run.tokens[0] == continuation(prompt, e) and run.reasons[0] == "stop"
    for i, p in enumerate(others):
        assert (run.tokens[i + 1], run.reasons[i + 1]) == expected(p, 10, {eos})
    stats = run.stats[0]
    assert stats["accepted"] == stats["drafted"] == k * stats["rounds"]
    # every round made k + 1 tokens, the last one's up to its end: EOS and what followed it were accepted
    assert 1 + stats["accepted"] + stats["rounds"] == 1 + ((e - 1) // (k + 1) + 1) * (k + 1) > e + 2


def test_max_new_tokens_inside_accepted_drafts():
    """A row with 3 tokens to go after its prefill and a round that accepts 4 drafts: 3 emitted, "length"."""
    drafter = TableDrafter(ALWAYS_RIGHT)
    model = FakeModel(drafter, max_batch=1)
    run = drive(model, [model.request(0, [7, 8, 9], 4)], k=4)
    assert run.tokens[0] == continuation([7, 8, 9], 4) and run.reasons[0] == "length"
    assert (run.stats[0]["rounds"], run.stats[0]["accepted"]) == (1, 4)


def test_a_stop_string_ends_the_tokens_where_target_only_does():
    """With a stop string, speculative token_ids (and new_tokens) equal target-only's: the row's tokens end at
    the one that completes the stop string."""
    prompt = PROMPTS[3]
    text = "".join(ALPHABET[t] for t in continuation(prompt, 12))
    runs = []
    for options in ({"k": 4}, {"speculative": False}):
        model = FakeModel(TableDrafter(ALWAYS_RIGHT), max_batch=1)
        runs.append(drive(model, [model.request(0, prompt, 12, stop=(text[3:5],))], **options))
    assert runs[0].text == runs[1].text and runs[0].reasons == runs[1].reasons == {0: "stop"}
    assert runs[0].tokens == runs[1].tokens


def test_a_stop_string_inside_accepted_drafts():
    """The text stops before the stop string, which sits in the middle of a round's accepted drafts."""
    prompt = PROMPTS[3]
    out = continuation(prompt, 12)
    text = "".join(ALPHABET[t] for t in out)
    stop = text[3:5]
    model = FakeModel(TableDrafter(ALWAYS_RIGHT), max_batch=1)
    run = drive(model, [model.request(0, prompt, 12, stop=(stop,))], k=4)
    assert run.reasons[0] == "stop" and run.text[0] == text[:text.find(stop)]
    assert run.tokens[0] == out[:len(run.tokens[0])] and len(run.tokens[0]) < 12


# -- sampling ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_batch", [1, 4])
def test_sampled_rows_follow_the_table(max_batch):
    """Sampled rows (and a batch mixing them with greedy ones) under a one-hot target: the accepted output
    is still the table's, and acceptance is exactly the drafter's right drafts."""
    drafter = TableDrafter(ragged)
    model = FakeModel(drafter, max_batch=max_batch)
    temps = [0.8, 0.0, 1.3, 0.5, 0.0, 1.0, 0.7, 0.9]
    run = drive(model, requests(model, temperature=temps), k=3)
    assert run.tokens == table_outputs()
    assert_stats_match_the_drafter(run, drafter)


# -- tree rounds ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_batch", [1, 4])
@pytest.mark.parametrize("rule", ["right", "wrong", "right1", "ragged"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tree_rounds_equal_target_only(temperature, rule, max_batch):
    """Trees whose right child is first or second at each level, with a decoy that continues the table
    under a wrong node: the accepted path is the right children for as long as the drafter is right."""
    drafter = TableDrafter(RULES[rule])
    model = FakeModel(drafter, max_batch=max_batch, tree=TREE)
    run = drive(model, requests(model, temperature=temperature), tree=TREE)
    assert run.tokens == table_outputs()
    assert_stats_match_the_drafter(run, drafter)


class CommitInOrder(Verifier):
    """A broken tree commit: the first nodes in creation order instead of the accepted path's."""

    def tree(self, *args, **kwargs):
        verdict, paths = super().tree(*args, **kwargs)
        verdict.index = None
        return verdict, paths


def test_a_tree_commit_of_the_wrong_nodes_is_caught():
    """The twin of the tree tests: committing nodes other than the accepted path's breaks the rows' cache."""
    model = FakeModel(TableDrafter(ALWAYS_RIGHT), max_batch=4, tree=TREE, verifier=CommitInOrder)
    with pytest.raises(AssertionError, match="cache|features"):
        drive(model, requests(model), tree=TREE)


def test_trees_need_a_tree_graph_and_a_drafter_of_trees():
    """A target without the tree mask, or a drafter whose method row says no trees, refuses tree rounds."""
    model = FakeModel(TableDrafter(ALWAYS_RIGHT))
    with pytest.raises(RequestError, match="speculation.mode tree"):
        Scheduler(model, tree=TREE)
    chains = TableDrafter(ALWAYS_RIGHT)
    chains.method = DraftMethod("chains", None, None)
    with pytest.raises(RequestError, match="proposes chains"):
        Scheduler(FakeModel(chains, tree=TREE), tree=TREE)


# -- the planner ---------------------------------------------------------------------------------------
def test_adaptive_k_under_a_flipping_policy(monkeypatch):
    """k auto with a policy that changes k (0 included) every round: output stays the table's."""
    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", FlippingK)
    drafter = TableDrafter(ragged)
    model = FakeModel(drafter, max_batch=4, k=4)
    scheduler_run = drive(model, requests(model, temperature=[0.0, 0.9] * 4), k="auto")
    assert scheduler_run.tokens == table_outputs()
    (policy,) = model.policies.values()
    assert 0 in policy.chosen and len(set(policy.chosen)) >= 4
    assert scheduler_run.rounds_by_k == dict(Counter(policy.chosen))  # one round per choice, counted by its k
    assert_stats_match_the_drafter(scheduler_run, drafter)


def test_adaptive_k_learns_to_draft_for_a_drafter_that_is_always_right():
    """The real policy on an always-right drafter: it drafts (rounds are counted), output stays exact."""
    drafter = TableDrafter(ALWAYS_RIGHT)
    model = FakeModel(drafter, max_batch=4, k=4)
    run = drive(model, requests(model, lengths=[40] * 8), k="auto")
    assert run.tokens == table_outputs(lengths=[40] * 8)
    assert sum(s["drafted"] for s in run.stats.values()) > 0
    assert all(s["accepted"] == s["drafted"] for s in run.stats.values())


def test_generate_on_the_fake_model():
    """SpecModel.generate (its request checks, stream and completions) over the fake: the table's output."""
    model = FakeModel(TableDrafter(ragged), max_batch=3)
    fast = model.generate(PROMPTS[:5], max_new_tokens=9, k=2)
    slow = model.generate(PROMPTS[:5], max_new_tokens=9, speculative=False)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow] == [continuation(p, 9) for p in PROMPTS[:5]]
    assert [c.text for c in fast] == ["".join(ALPHABET[t] for t in c.token_ids) for c in fast]
    assert fast.stats.speculation.rounds > 0 and slow.stats.speculation.rounds == 0


def test_noise_does_not_depend_on_the_batch():
    """A row's uniforms come from its own generator: the same seed draws the same noise alone or in a batch."""
    model = FakeModel(max_batch=4)
    one = Scheduler(model, speculative=False)
    one.submit(model.request(0, [1], 4, 0.5, seed=9))
    one.step()
    many = Scheduler(model, speculative=False)
    for i, seed in enumerate([3, 9, 4]):
        many.submit(model.request(i, [1], 4, 0.5, seed=seed))
    many.step()
    assert torch.equal(one.batch.noise(5)[0], many.batch.noise(5)[1])


# -- prompt lookup in front of a drafter -------------------------------------------------------------------
def _lookup_first(rule) -> tuple:
    from specc.runtime.drafters import FrontDrafter, PromptLookupDrafter
    from specc.runtime.drafters.base import with_method

    inner = TableDrafter(rule)
    return FrontDrafter(with_method(PromptLookupDrafter(3, 1, 32), "prompt_lookup"), inner), inner


def test_prompt_lookup_in_front_of_a_drafter():
    """The real lookup drafter on the table's text (which repeats: its state is two tokens) in front of an always
    wrong drafter: rounds where every row finds an n-gram are lookup's and count as such; output stays exact."""
    drafter, inner = _lookup_first(ALWAYS_WRONG)
    model = FakeModel(drafter, max_batch=4)
    run = drive(model, requests(model, lengths=[30] * 8), k=3)
    assert run.tokens == table_outputs(lengths=[30] * 8)
    lookup = sum(s["front_rounds"] for s in run.stats.values())
    assert 0 < lookup < sum(s["rounds"] for s in run.stats.values())
    # the inner drafter's drafts are all wrong, so every accepted draft is lookup's
    assert sum(s["accepted"] for s in run.stats.values()) > 0 and sum(len(v) for v in inner.log.values()) > 0
    assert {s["model_acceptance_rate"] for s in run.stats.values()} <= {None, 0.0}


def test_suffix_in_front_counts_what_was_accepted_of_its_own_drafts():
    """The real suffix drafter in front of an always right drafter: the verdicts of its own rounds reach it (its
    cache's drafted and accepted figures, what /metrics exports, are those of the rounds it drafted), the model's
    rounds' do not."""
    from specc.runtime.drafters import FrontDrafter
    from specc.runtime.drafters.base import with_method
    from specc.runtime.drafters.suffix import GlobalSuffixCache, SuffixDrafter

    inner, cache = TableDrafter(ALWAYS_RIGHT), GlobalSuffixCache(64, 4096, 32)
    model = FakeModel(FrontDrafter(with_method(SuffixDrafter(cache, 32), "suffix"), inner), max_batch=4)
    run = drive(model, requests(model, lengths=[30] * 8), k=3)
    assert run.tokens == table_outputs(lengths=[30] * 8)
    logged = [entry for row in inner.log.values() for entry in row]  # the model's rounds: (drafted, right)
    model_drafted, model_accepted = sum(d for d, _ in logged), sum(r for _, r in logged)
    drafted, accepted = (sum(s[key] for s in run.stats.values()) for key in ("drafted", "accepted"))
    figures = cache.metrics()
    assert 0 < figures["accepted"] == accepted - model_accepted and model_accepted > 0
    assert figures["drafted"] == drafted - model_drafted


def test_the_policys_arms_under_a_flipping_policy(monkeypatch):
    """k auto over lookup in front of a drafter: the policy takes the arms in turn ("model" drafts with the inner
    drafter even where lookup finds, "lookup" leaves rows it misses without drafts); output stays exact."""
    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", FlippingK)
    drafter, inner = _lookup_first(ragged)
    model = FakeModel(drafter, max_batch=4, k=4)
    run = drive(model, requests(model, lengths=[30] * 8, temperature=[0.0, 0.7] * 4), k="auto")
    assert run.tokens == table_outputs(lengths=[30] * 8)
    (policy,) = model.policies.values()
    assert policy.arms == ("model", "lookup") and inner.log
    assert 0 < sum(s["front_rounds"] for s in run.stats.values()) < sum(s["rounds"] for s in run.stats.values())


def test_a_prompt_beside_decoding_rows_keeps_to_its_share_of_time(monkeypatch):
    """A fake clock: a round costs 1 s, a prompt chunk of any size 4 s (a long context's attention on a small
    model: more than INTERLEAVE_SHARE rounds even at the smallest chunk). Chunks then run every few rounds, the
    decoding row's mean time between tokens stays within 1 + INTERLEAVE_SHARE rounds, the prompt still
    finishes, in chunks grown to the cap (a chunk costs the same whatever its size), and both outputs are the
    table's."""
    import specc.runtime.scheduler as scheduler_module
    from specc.runtime.prefill import Prefill
    from specc.runtime.pacing import SHARE as INTERLEAVE_SHARE

    step = Prefill.step

    now = [0.0]
    monkeypatch.setattr(scheduler_module.time, "perf_counter", lambda: now[0])
    rounds, chunks = [], []

    def timed(fn, seconds, log):
        def run(*args, **kwargs):
            now[0] += seconds
            log.append(now[0])
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(scheduler_module, "plain_round", timed(scheduler_module.plain_round, 1.0, rounds))
    sizes = []
    monkeypatch.setattr(Prefill, "step", timed(lambda self, size=None: sizes.append(size) or step(self, size), 4.0, chunks))
    model = FakeModel(None)
    model.prefill_chunk, model.interleave_chunk = 8, 8
    long_prompt = [RNG.randrange(32) for _ in range(60)]
    scheduler = Scheduler(model, speculative=False)
    scheduler.submit(model.request(0, [1, 2, 3], 200))
    out: dict[int, list[int]] = {0: [], 1: []}
    steps = 0
    while not out[0]:
        out[0] += [t for e in scheduler.step() for t in e.token_ids]
    scheduler.submit(model.request(1, long_prompt, 4))
    gaps, last = [], now[0]
    while scheduler.busy and steps < 1000:
        steps += 1
        prefilling = scheduler.prefilling is not None or bool(scheduler.waiting)
        for e in scheduler.step():
            out[e.index] += e.token_ids
            if e.index == 0 and e.token_ids:
                if prefilling:
                    gaps.append(now[0] - last)
                last = now[0]
        if len(out[1]) == 4:
            scheduler.cancel(0)  # the long prompt is done: the decoding row has served its purpose
    assert out[1] == continuation(long_prompt, 4)
    assert out[0] == continuation([1, 2, 3], len(out[0]))
    assert len(chunks) >= 60 // 8 and max(gaps) >= 4.0  # the prompt moved, a chunk at a time
    assert sizes[-3:] == [8, 8, 8]
    assert sum(gaps) / len(gaps) <= 1 + INTERLEAVE_SHARE + 0.25, gaps
