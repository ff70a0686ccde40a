"""Lookahead decoding (runtime/drafters/lookahead.py): the tree layout of both branches, the pool's bounds and
seeding, greedy output equal to target-only (with its own pool, a pool that is always wrong and one that is
always right, on ONNX Runtime and torch (AOTInductor: heavy), under k auto's gate, behind the suffix drafter), the sampled
distribution with its broken-rule twin, k auto's gate, recipe errors."""
from __future__ import annotations

import numpy as np
import pytest

import specc
from specc.errors import RecipeError, RequestError
from specc.limits import lookahead_nodes
from specc.recipe import parse_recipe
from specc.runtime import verifier
from specc.runtime.adaptive import CostLine
from specc.runtime.drafters.lookahead import LookaheadDrafter, LookaheadRow, NgramPool
from specc.runtime.planning import PLAIN, VERIFY, WHOLE, LookaheadGate
from specc.runtime.record import RoundRecord
from specc.speculation.sampling import SamplingParams, sample
from specc.speculation.tree import TreeShape
from specc.testing import make_tiny_model

from conftest import build_bundle
from stats_helpers import FAIL_P, PASS_P, chi2_pvalue, total_variation
from test_lossless_sampling import PROMPT, VOCAB, exact_marginals

ANY_TREE = TreeShape()  # a tree asked for: every round verifies the drafter's whole tree (no gate)


class _Seq:
    def __init__(self, prompt, out=()):
        self.prompt, self.out, self.draft_memo = list(prompt), list(out), {}

    @property
    def tokens(self):
        return self.prompt + self.out


# -- the pool and the layout ------------------------------------------------------------------------------------
def test_pool_keeps_the_newest_g_per_first_token_and_a_bounded_number_of_first_tokens():
    pool = NgramPool(3, per_key=2, keys=4)
    for gram in ([1, 2, 3], [1, 4, 5], [1, 6, 7], [1, 4, 5]):
        pool.add(gram)
    assert pool.guesses(1) == [(4, 5), (6, 7)]  # newest first; (2, 3) dropped, the repeat moved to the front
    for key in range(10, 20):
        pool.add([key, 0, 0])
    assert len(pool.tails) == 4 and pool.size <= 8 and pool.guesses(1) == []  # least recently used dropped


def test_pool_is_seeded_from_the_prompt_and_reads_each_n_gram_once():
    row = LookaheadRow(_Seq([5, 6, 7, 5, 6, 8]), window=2, ngram=3, verify_ngrams=4)
    row.sync([5, 6, 7, 5, 6, 8])
    assert row.pool.guesses(5) == [(6, 8), (6, 7)] and row.pool.guesses(6) == [(7, 5)] and row.pool.size == 4
    row.sync([5, 6, 7, 5, 6, 8, 9])  # the output's n-grams join; the prompt's are not read again
    assert row.pool.guesses(6) == [(8, 9), (7, 5)] and row.pool.size == 5


@pytest.mark.parametrize("window, ngram", [(1, 2), (4, 3), (3, 5), (5, 2)])
def test_lanes_sit_at_their_positions_while_the_window_fills_and_slides(window, ngram):
    """Every lane token keeps its absolute position from round to round (the root advancing one token a round),
    the tree never exceeds lookahead_nodes, siblings are distinct, and a full window slides one token a round."""
    seq = _Seq(list(range(20, 40)))
    row = LookaheadRow(seq, window, ngram, verify_ngrams=2)
    row.sync(seq.tokens)
    placed = {}  # (lane, absolute position) -> token, from the last round
    for r in range(ngram + 3):
        tree = row.tree(root=100 + r)
        assert tree.size <= lookahead_nodes(window, ngram, 2) and tree.fixed
        for kids in tree.children.values():
            assert len({tree.tokens[c] for c in kids}) == len(kids)
        now = {}
        for i, end in enumerate(tree.lane_ends):
            path = tree.ancestors(end)[::-1]
            lane = row.lanes[i][1:] if row.full else row.lanes[i]
            nodes = path[len(path) - len(lane):] if lane else []
            now.update({(i, r + tree.depth[n]): tree.tokens[n] for n in nodes})
        for key, token in now.items():
            if key in placed:
                assert placed[key] == token, f"round {r}: lane token moved"
        placed = now
        full = row.full
        guessed = [1000 + r * 100 + n for n in range(len(tree.tokens))]
        before = [list(lane) for lane in row.lanes]
        row.advance(100 + r, guessed)
        nexts = [guessed[e] for e in tree.lane_ends]
        if full:
            assert row.lanes == [lane[1:] + [n] for lane, n in zip(before, nexts)]
            assert all((tuple(lane[1:] + [n])) in row.pool.guesses((100 + r) if i == 0 else lane[0])
                       for i, (lane, n) in enumerate(zip(before, nexts)))
        else:
            assert row.lanes == [lane + [n] for lane, n in zip(before, nexts)]
        row.last = None
    assert row.full and all(len(lane) == ngram - 1 for lane in row.lanes)


# -- greedy: equal to target-only ----------------------------------------------------------------------------------
def _reference(model, prompts, max_new_tokens=20):
    return [c.token_ids for c in model.generate(prompts, max_new_tokens=max_new_tokens, speculative=False)]


def _mismatches(model, prompts, truth, batch, **kwargs):
    from specc.runtime.stats import RunStats

    bad, stats = [], RunStats()
    for lo in range(0, len(prompts), batch):
        fast = model.generate(prompts[lo:lo + batch], max_new_tokens=20, **kwargs)
        stats.merge(model.last_stats)
        bad += [lo + i for i, c in enumerate(fast) if c.token_ids != truth[lo + i]]
    return bad, stats.to_dict()


@pytest.mark.parametrize("name, batch", [("lookahead", 1), ("lookahead", 4), ("lookahead_torch", 3)])
def test_greedy_equals_target_only(bundles, prompts, name, batch):
    model = specc.load(bundles[name])
    truth = _reference(model, prompts)
    bad, stats = _mismatches(model, prompts, truth, batch, tree=ANY_TREE)
    assert bad == []
    assert 0 < stats["acceptance_rate"] < 1 and stats["drafted"] > 0
    bad, _ = _mismatches(model, prompts, truth, batch)  # k auto: the gate cuts rounds
    assert bad == []


def _rewrite_drafts(monkeypatch, model, prompts, truth, shift):
    """Every drafted node's token replaced by the target's own token at its position plus `shift` (0: always
    right, as far as the target-only output goes; 1: always wrong)."""
    propose, vocab = LookaheadDrafter.propose_tree, model.target.dims.vocab_size
    truth_of = {tuple(ids): t for ids, t in zip(model.encode(prompts), truth)}

    def rewritten(self, batch, shape, params):
        trees = propose(self, batch, shape, params)
        for seq, tree in zip(batch.seqs, trees):
            truth = truth_of[tuple(seq.prompt)]
            for node in range(1, len(tree.tokens)):
                at = len(seq.out) - 1 + tree.depth[node]
                tree.tokens[node] = (truth[at] + shift) % vocab if at < len(truth) else tree.tokens[node]
        return trees

    monkeypatch.setattr(LookaheadDrafter, "propose_tree", rewritten)


def test_a_pool_that_is_always_wrong_accepts_nothing_and_still_matches(bundles, prompts, monkeypatch):
    model = specc.load(bundles["lookahead"])
    truth = _reference(model, prompts)
    _rewrite_drafts(monkeypatch, model, prompts, truth, shift=1)
    bad, stats = _mismatches(model, prompts, truth, 4, tree=ANY_TREE)
    assert bad == []
    assert stats["drafted"] > 0 and stats["accepted"] == 0 and stats["tokens_per_target_pass"] == 1.0


def test_a_pool_that_is_always_right_accepts_whole_paths(bundles, prompts, monkeypatch):
    model = specc.load(bundles["lookahead"])
    truth = _reference(model, prompts)
    _rewrite_drafts(monkeypatch, model, prompts, truth, shift=0)
    bad, stats = _mismatches(model, prompts, truth, 4, tree=ANY_TREE)
    assert bad == []
    assert stats["tokens_per_target_pass"] > 2.5


def test_behind_the_suffix_drafter_repeated_traffic_is_found(models_dir, prompts, tmp_path):
    """draft.suffix: true puts the suffix index in front: the second pass over the same prompts drafts from the
    first pass's outputs; every output equals target-only in both."""
    bundle = build_bundle(tmp_path / "b", models_dir / "target", {"method": "lookahead", "suffix": True},
                          backend="torch", speculation={"mode": "tree"})
    model = specc.load(bundle)
    assert model.draft_label == "lookahead+suffix"
    some = prompts[:12]
    truth = _reference(model, some)
    passes = []
    for _ in range(2):
        bad, stats = _mismatches(model, some, truth, 1, tree=ANY_TREE)
        assert bad == []
        passes.append(stats["tokens_per_target_pass"])
    assert model.suffix_cache.metrics()["drafted"] > 0 and passes[1] > passes[0] + 0.5


@pytest.mark.heavy
def test_greedy_equals_target_only_on_aoti(models_dir, prompts, tmp_path):
    """AOTInductor runs the same tree graph (two compiles: minutes on 2 cores, so outside the default run)."""
    bundle = build_bundle(tmp_path / "b", models_dir / "target", {"method": "lookahead", "window": 3, "verify_ngrams": 2},
                          backend="aoti", speculation={"mode": "tree"})
    model = specc.load(bundle, trust_code=True)
    some = prompts[:12]
    truth = _reference(model, some)
    for kwargs in ({}, {"tree": ANY_TREE}):
        bad, stats = _mismatches(model, some, truth, 3, **kwargs)
        assert bad == [] and stats["drafted"] > 0


def test_k_must_be_auto(bundles):
    model = specc.load(bundles["lookahead_torch"])
    with pytest.raises(RequestError, match="k must be 'auto'"):
        model.generate(["ab"], max_new_tokens=2, k=3)
    assert len(model.generate(["ab"], max_new_tokens=3, k="auto")[0].token_ids) == 3


# -- sampling: the target's distribution --------------------------------------------------------------------------
def draw(bundle, params: SamplingParams, n: int = 2048, batch: int = 512):
    """n samples of the first three tokens after PROMPT, every round verifying the whole tree (a third of the
    sampling checks' count, as the suffix drafter's: the broken twin below fails by far)."""
    from specc.runtime.stats import RunStats

    model, out, stats = specc.load(bundle), [], RunStats()
    for lo in range(0, n, batch):
        done = model.generate([PROMPT] * batch, max_new_tokens=3, seed=list(range(lo, lo + batch)),
                              temperature=params.temperature, tree=ANY_TREE)
        out += [c.token_ids for c in done]
        stats.merge(model.last_stats)
    return np.array(out), stats.to_dict()


@pytest.fixture(scope="module")
def small_vocab_lookahead(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookahead_sampling")
    target = make_tiny_model(root / "target", seed=0, vocab_size=VOCAB, logit_scale=2.0)
    bundle = build_bundle(root / "bundle", target, {"method": "lookahead", "window": 3, "ngram": 3, "verify_ngrams": 3},
                          backend="torch", limits={"max_batch": 512, "max_context": 64}, speculation={"mode": "tree"})
    return target, bundle


def test_sampled_output_has_the_target_distribution(small_vocab_lookahead):
    target, bundle = small_vocab_lookahead
    params = SamplingParams(1.0)
    exact = exact_marginals(target, params)
    samples, stats = draw(bundle, params)
    assert 0.01 < stats["acceptance_rate"] < 0.95, "drafts must be both accepted and rejected for this test to mean anything"
    for pos in range(3):
        tv = total_variation(samples[:, pos], exact[pos])
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, f"position {pos}, TV {tv:.3f}"


def _no_residual(p, tree, u):
    """Wrong: each candidate accepted with its probability under p, never removed from it after a rejection."""
    path = [0]
    while True:
        r = p[path[-1]]
        for c in tree.children.get(path[-1], []):
            if u[c] < r[tree.tokens[c]]:
                path.append(c)
                break
        else:
            return path, int(sample(r[None], u[-1:])[0])


def test_the_rule_without_its_residual_is_caught(small_vocab_lookahead, monkeypatch):
    monkeypatch.setattr(verifier, "accept_tree_fixed", _no_residual)
    target, bundle = small_vocab_lookahead
    params = SamplingParams(1.0)
    exact = exact_marginals(target, params)
    samples, _ = draw(bundle, params, n=4096)
    assert chi2_pvalue(samples[:, 0], exact[0]) > PASS_P  # the first token comes from prefill, untouched
    assert min(chi2_pvalue(samples[:, pos], exact[pos]) for pos in (1, 2)) < FAIL_P


# -- k auto's gate --------------------------------------------------------------------------------------------------
def _trees(rows=1):
    seq = _Seq(list(range(30)) * 2)
    row = LookaheadRow(seq, 4, 3, 4)
    row.sync(seq.tokens)
    return [row.tree(root=5) for _ in range(rows)]


def _run(gate, seconds_per_node, accepted_whole, rounds=400):
    """Rounds of a fake model: a plain step costs 1 s, each verified node seconds_per_node more."""
    levels = []
    for _ in range(rounds):
        trees, cut = gate.size(_trees(), [True])
        width = max(t.size for t in trees)
        levels.append(cut.level)
        gate.observe(RoundRecord(k=width, accepted=[accepted_whole if cut.level == WHOLE else 0],
                                 seconds=1.0 + seconds_per_node * width, cut=cut))
    return levels


def test_gate_falls_back_to_plain_steps_where_a_wide_pass_does_not_pay():
    levels = _run(LookaheadGate(), seconds_per_node=0.2, accepted_whole=1)  # a 15-node pass costs 4x, yields 2 tokens
    assert levels[0] == PLAIN
    assert levels[100:].count(PLAIN) / 300 > 0.97  # probes at doubling gaps only
    # what the probes and first measurements cost, against plain decoding all along: within 5 %
    spent = sum(1.0 + (0.2 * 15 if level == WHOLE else 0.0) for level in levels)
    made = sum(2 if level == WHOLE else 1 for level in levels)
    assert (made / spent) >= 0.95


def test_gate_keeps_whole_trees_where_they_pay():
    levels = _run(LookaheadGate(), seconds_per_node=0.01, accepted_whole=2)
    assert levels[20:].count(WHOLE) / len(levels[20:]) > 0.9


def test_gate_verifies_only_the_pool_where_lanes_cost_more_than_they_find():
    gate = LookaheadGate()
    gate.gain[VERIFY], gate.gain[WHOLE] = 1.0, 1.05
    line = gate.lines.setdefault(1, CostLine(0.9))
    for width in (0, 8, 15):
        line.add(width, 1.0 + 0.1 * width)
    gate.plain_seen.add(1)
    trees = _trees()
    kept, cut = gate.size(trees, [True])
    assert cut.level == VERIFY and kept[0].size == trees[0].guesses > 0


# -- recipe ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft, speculation, field, words", [
    ({"method": "lookahead"}, {"mode": "chain"}, "speculation.mode", "speculation.mode tree"),
    ({"method": "lookahead"}, {"mode": "tree", "tree": {"max_nodes": 8}}, "speculation.tree", "does not apply"),
    ({"method": "lookahead", "window": 0}, {"mode": "tree"}, "draft.window", "below the minimum 1"),
    ({"method": "lookahead", "ngram": 1}, {"mode": "tree"}, "draft.ngram", "below the minimum 2"),
    ({"method": "lookahead", "verify_ngrams": 17}, {"mode": "tree"}, "draft.verify_ngrams", "above the maximum 16"),
    ({"method": "lookahead", "window": 16, "ngram": 8, "verify_ngrams": 16}, {"mode": "tree"}, "draft.window",
     "at most 128"),
    ({"method": "prompt_lookup", "window": 8}, {"k": 3}, "draft.window", "only applies with draft.method lookahead"),
    ({"method": "lookahead", "lookup": True}, {"mode": "tree"}, "draft.lookup", "not 'lookahead'"),
])
def test_recipe_errors(draft, speculation, field, words):
    with pytest.raises(RecipeError) as err:
        parse_recipe({"target": {"model": "t"}, "draft": draft, "speculation": speculation})
    assert err.value.path == field and words in str(err.value)


def test_recipe_defaults_follow_tensorrt_llm():
    r = parse_recipe({"target": {"model": "t"}, "draft": {"method": "lookahead"}, "speculation": {"mode": "tree"}})
    assert (r.draft.window, r.draft.ngram, r.draft.verify_ngrams) == (4, 3, 4)
    assert lookahead_nodes(4, 3, 4) == 15
