"""Suffix decoding (runtime/drafters/suffix.py): lossless with the global cache holding conflicting and
garbage outputs, in chains, trees and in front of a draft model; the cache bounded and safe under
concurrent requests; recipe errors; --warm; metrics."""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

import specc
from specc.errors import RecipeError
from specc.recipe import parse_recipe
from specc.runtime.drafters import suffix
from specc.runtime.drafters.suffix import (GlobalSuffixCache, SuffixDrafter, SuffixIndex, best_path, frequency_tree)
from specc.runtime.planning import TreeSizer
from specc.speculation.sampling import SamplingParams
from specc.testing import derive_draft, make_tiny_model

from conftest import build_bundle
from stats_helpers import FAIL_P, PASS_P, chi2_pvalue, total_variation
from test_lossless_sampling import PROMPT, VOCAB, exact_marginals

LIMITS = {"max_batch": 512, "max_context": 64}


@pytest.fixture(scope="module")
def suffix_bundles(tmp_path_factory):
    """A 24-token target (the sampling checks' own) with the suffix drafter: chain (k 3), tree, and in front of
    a perturbed 1-layer draft model. Torch backend: compiles in seconds."""
    root = tmp_path_factory.mktemp("suffix")
    target = make_tiny_model(root / "target", seed=0, vocab_size=VOCAB, logit_scale=2.0)
    draft = derive_draft(target, root / "draft", layers=1, perturb=0.05)
    tree = {"mode": "tree", "tree": {"depth": 3, "branching": 2, "max_nodes": 6}}
    out = {
        "chain": build_bundle(root / "chain", target, {"method": "suffix"}, limits=LIMITS, backend="torch",
                              speculation={"k": 3}),
        "tree": build_bundle(root / "tree", target, {"method": "suffix"}, limits=LIMITS, backend="torch", speculation=tree),
        "model": build_bundle(root / "model", target, {"method": "model", "model": str(draft), "suffix": True},
                              limits=LIMITS, backend="torch", speculation={"k": 3}),
    }
    return target, out


def token_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of the small vocabulary; every third repeats itself, so the request's own index finds drafts."""
    rng = random.Random(seed)
    out = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))] for _ in range(n)]
    return [p * 3 if i % 3 == 0 else p for i, p in enumerate(out)]


# -- the index and the cache ---------------------------------------------------------------------------------
def test_index_finds_latest_occurrences_with_a_continuation():
    index = SuffixIndex()
    index.add(1, [5, 6, 7, 5, 6, 8, 5, 6])
    found = index.occurrences((5, 6))
    assert [(sid, i) for sid, i in found] == [(1, 5), (1, 2)]  # latest first; the one at the very end has no continuation
    assert index.occurrences((6, 9)) == []


def test_paths_and_trees_follow_frequency():
    continuations = [[1, 2, 3], [1, 2, 3], [1, 2, 4], [9, 9]]
    assert best_path(continuations, 8) == [1, 2, 3]
    assert best_path(continuations, 2) == [1, 2]
    assert best_path([[1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11]], 4) == []  # every token below MIN_PROB
    tree = frequency_tree(0, continuations, 5)
    # most probable first: 1 (.75), 2 (.75), 3 (.5), 9 (.25), 4 (.25)
    assert tree.tokens == [0, 1, 2, 3, 9, 4] and tree.parent == [-1, 0, 1, 2, 0, 2]
    assert frequency_tree(0, continuations, 0).size == 0


def test_global_cache_stays_within_its_limits():
    """Filled far past both limits: at most max_requests outputs and max_tokens tokens, memory flat, the most
    recently matched output kept, an output longer than the whole budget cut."""
    cache = GlobalSuffixCache(max_requests=6, max_tokens=200)
    rng = random.Random(0)
    sizes = []
    for n in range(300):
        sid = cache.open()
        cache.add(sid, [rng.randrange(50) for _ in range(30)])
        cache.add(sid, [rng.randrange(50) for _ in range(10)])
        if n == 3:
            kept = sid
            cache.add(kept, [777, 778, 779])
        if n > 3:
            assert cache.lookup((777, 778), skip=None)  # matched each time: never the least recently used
        assert len(cache.lru) <= 6 and cache.tokens <= 200 and cache.index.tokens == cache.tokens
        sizes.append(cache.index.bytes)
    assert kept in cache.lru and cache.evicted > 250
    assert max(sizes[100:]) <= 1.5 * max(sizes[:20])
    assert cache.index.dead <= cache.index.live
    big = GlobalSuffixCache(max_requests=4, max_tokens=50)
    big.add(big.open(), list(range(80)))
    assert big.tokens == 50


def test_warm_drops_ids_outside_the_vocabulary():
    cache = GlobalSuffixCache(8, 100, vocab_size=10)
    assert cache.warm([[1, 2, 30, 3], [99]]) == 3


# -- lossless ------------------------------------------------------------------------------------------------
def _assert_equal(model, prompts, truth, batch=8, **kwargs):
    """Speculative greedy output equals `truth` (target-only) for every prompt; returns (drafted, accepted)."""
    bad, drafted, accepted = [], 0, 0
    for lo in range(0, len(prompts), batch):
        fast = model.generate(prompts[lo:lo + batch], max_new_tokens=12, **kwargs)
        stats = fast.stats.to_dict()
        drafted, accepted = drafted + stats["drafted"], accepted + stats["accepted"]
        bad += [lo + i for i, c in enumerate(fast) if c.token_ids != truth[lo + i]]
    assert bad == [], f"prompts whose output differs from target-only: {bad}"
    return drafted, accepted


@pytest.mark.parametrize("kind", ["chain", "tree", "model"])
def test_greedy_equals_target_only_with_conflicting_and_garbage_outputs_cached(suffix_bundles, kind):
    """The global cache holds, for every prompt, a continuation the target does not produce (its output shifted
    by one token) and random garbage: drafts that match long and are wrong. Then the true outputs (the first
    call's), so drafts are mostly right. Every output equals target-only in both."""
    _, bundles = suffix_bundles
    model = specc.load(bundles[kind])
    prompts = token_prompts(16, seed=3)
    truth = [c.token_ids for c in model.generate(prompts, max_new_tokens=12, speculative=False)]
    rng = random.Random(1)
    model.suffix_cache.warm([p + [(t + 1) % VOCAB for t in out] for p, out in zip(prompts, truth)])
    model.suffix_cache.warm([[rng.randrange(VOCAB) for _ in range(40)] for _ in range(20)])
    drafted, accepted = _assert_equal(model, prompts, truth)
    assert drafted > 0 and accepted < drafted
    drafted, accepted = _assert_equal(model, prompts, truth)  # now also the true outputs of the same prompts
    assert accepted > 0.5 * drafted
    assert model.suffix_cache.metrics()["hits"] > 0
    assert (model.front_drafter, model.draft_label) == ({"model": ("suffix", "model+suffix")}.get(kind, (None, "suffix")))


def test_concurrent_requests_share_the_cache_without_corrupting_it(suffix_bundles):
    """Eight threads generate at once on one loaded model (as server requests do): every output equals
    target-only, and the cache holds exactly what it counts."""
    _, bundles = suffix_bundles
    model = specc.load(bundles["chain"])
    model.suffix_cache.max_requests, model.suffix_cache.max_tokens = 12, 300  # evictions while they run
    prompts = token_prompts(32, seed=5)
    truth = [c.token_ids for c in model.generate(prompts, max_new_tokens=12, speculative=False)]
    results, errors = {}, []

    def worker(w: int) -> None:
        try:
            for _ in range(2):
                for i in range(w, len(prompts), 8):
                    results.setdefault(i, []).append(model.generate([prompts[i]], max_new_tokens=12)[0].token_ids)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(out == truth[i] for i, outs in results.items() for out in outs) and len(results) == len(prompts)
    cache = model.suffix_cache
    assert cache.tokens == sum(cache.lru.values()) == cache.index.tokens <= 300 and len(cache.lru) <= 12
    assert cache.metrics()["drafted"] > 0


def draw(bundle, params: SamplingParams, n: int = 2048, batch: int = 512):
    """n samples of the first three tokens after PROMPT (a third of the sampling checks' count: the suffix
    drafter's q is a point mass, and the twins below fail by far)."""
    from specc.runtime.stats import RunStats

    model = _warm_for_sampling(specc.load(bundle))
    out, stats = [], RunStats()
    for lo in range(0, n, batch):
        done = model.generate([PROMPT] * batch, max_new_tokens=3, seed=list(range(lo, lo + batch)),
                              temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        out += [c.token_ids for c in done]
        stats.merge(model.last_stats)
    return np.array(out), stats.to_dict()


def _warm_for_sampling(model):
    """Earlier outputs after PROMPT, so rows find drafts that are sometimes right."""
    rng = random.Random(2)
    model.suffix_cache.warm([PROMPT + [rng.randrange(VOCAB) for _ in range(3)] for _ in range(40)])
    return model


@pytest.mark.parametrize("kind", ["chain", "tree", "model"])
def test_sampled_output_has_the_target_distribution(suffix_bundles, kind, monkeypatch):
    """One-hot q for the suffix drafter's deterministic drafts (chains; a single path per sampled row in tree
    rounds, cut by the tree sizer; in front of a draft model, mixed with the model's rounds: small batches, so
    that every row of a batch finds a match often enough for both kinds to be common). The cache also takes
    every row's sampled output as the test runs. The sizer keeps its measured costs but not its measured
    acceptance: the garbage in this cache would soon make it draft nothing, and a check without drafts means
    nothing."""
    monkeypatch.setattr(TreeSizer, "observe", lambda self, record: self.line.add(record.k, record.seconds))
    target, bundles = suffix_bundles
    params = SamplingParams(1.0)
    exact = exact_marginals(target, params)
    samples, stats = draw(bundles[kind], params, **({"n": 1024, "batch": 16} if kind == "model" else {}))
    assert 0.01 < stats["acceptance_rate"] < 0.95, "drafts must be both accepted and rejected for this test to mean anything"
    if kind == "model":  # the statistics split the suffix drafter's rounds from the model's
        assert 0.1 < stats["front_rounds"] / stats["rounds"] < 0.9
        assert stats["front_acceptance_rate"] is not None and stats["model_acceptance_rate"] is not None
    for pos in range(3):
        tv = total_variation(samples[:, pos], exact[pos])
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, f"position {pos}, TV {tv:.3f}"


def test_chain_drafts_with_the_wrong_q_are_caught(suffix_bundles, monkeypatch):
    """The twin: the same drafts reported with a uniform q instead of their one-hot q."""
    one_hot = suffix.one_hot_proposal

    def uniform_q(*args, **kwargs):
        p = one_hot(*args, **kwargs)
        p.q = None if p.q is None else torch.full_like(p.q, 1.0 / p.q.shape[-1])
        return p

    monkeypatch.setattr(suffix, "one_hot_proposal", uniform_q)
    target, bundles = suffix_bundles
    params = SamplingParams(1.0)
    exact = exact_marginals(target, params)
    samples, _ = draw(bundles["chain"], params)
    assert chi2_pvalue(samples[:, 0], exact[0]) > PASS_P  # the first token comes from prefill, untouched
    assert min(chi2_pvalue(samples[:, pos], exact[pos]) for pos in (1, 2)) < FAIL_P


def test_frequency_trees_for_sampled_rows_would_break_the_distribution(suffix_bundles, monkeypatch):
    """Why sampled rows get a single path: the whole frequency tree with each node's q the point mass at its
    first child (what a deterministic tree offers the i.i.d. rule) is caught."""
    def broken(self, batch, shape, params):
        trees = []
        for seq in batch.seqs:
            m = self.match(seq)
            tree = frequency_tree(seq.out[-1], m.continuations or [], m.budget(shape.size))
            for parent, kids in tree.children.items():
                tree.q[parent] = torch.zeros(self.vocab_size)
                tree.q[parent][tree.tokens[kids[0]]] = 1.0
            trees.append(tree)
        return trees

    monkeypatch.setattr(SuffixDrafter, "propose_tree", broken)
    target, bundles = suffix_bundles
    params = SamplingParams(1.0)
    exact = exact_marginals(target, params)
    samples, _ = draw(bundles["tree"], params)
    assert min(chi2_pvalue(samples[:, pos], exact[pos]) for pos in (1, 2)) < FAIL_P


# -- recipe, CLI, metrics --------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft, field, words", [
    ({"method": "suffix", "suffix": True}, "draft.suffix", "already is the drafter"),
    ({"method": "prompt_lookup", "suffix": True}, "draft.suffix", "in front of a draft model"),
    ({"method": "model", "model": "m", "suffix": True, "lookup": True}, "draft.suffix", "draft.lookup"),
    ({"method": "model", "model": "m", "suffix_tokens": 10}, "draft.suffix_tokens", "only applies"),
    ({"method": "suffix", "model": "m"}, "draft.model", "only used with"),
])
def test_recipe_errors(draft, field, words):
    with pytest.raises(RecipeError) as err:
        parse_recipe({"target": {"model": "t"}, "draft": draft})
    assert err.value.path == field and words in str(err.value)


def test_recipe_allows_suffix_trees_and_suffix_in_front():
    parse_recipe({"target": {"model": "t"}, "draft": {"method": "suffix", "suffix_requests": 8},
                  "speculation": {"mode": "tree"}})
    parse_recipe({"target": {"model": "t"}, "draft": {"method": "eagle", "head": "h", "suffix": True}})


def test_warm_flag_checks_its_file_before_loading(suffix_bundles, tmp_path, monkeypatch, capsys):
    from specc.cli import main

    _, bundles = suffix_bundles
    monkeypatch.setattr("specc.runtime.model.load", lambda *a, **k: pytest.fail("loaded before --warm was checked"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"prompt": "no completion"}\n')
    for path, words in ((bad, "line 2"), (tmp_path / "none.jsonl", "does not exist")):
        for command in (["generate", str(bundles["chain"]), "--prompt", "x"], ["bench", str(bundles["chain"]), "--prompt", "x"]):
            assert main(command + ["--warm", str(path)]) == 2
            assert words in capsys.readouterr().err


def test_warm_flag_seeds_the_cache(suffix_bundles, tmp_path, capsys):
    from specc.cli import main

    _, bundles = suffix_bundles
    warm = tmp_path / "warm.jsonl"
    # the byte tokenizer gives the small vocabulary's ids to the characters ! to 8; the rest are dropped
    warm.write_text('{"text": "garbage \\u0007 text"}\n\n{"prompt": "p", "completion": "0123(0123)"}\n')
    assert main(["generate", str(bundles["chain"]), "--prompt", "0123", "--max-new-tokens", "4", "--warm", str(warm)]) == 0
    assert "10 tokens of 2 earlier outputs in the suffix cache" in capsys.readouterr().err


def test_metrics_export_the_cache(suffix_bundles):
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from specc.serving.metrics import Metrics

    cache = GlobalSuffixCache(4, 100)
    cache.warm([[1, 2, 3, 4]])
    metrics = Metrics(4, 2)
    metrics.watch_suffix(cache)
    text = generate_latest(metrics.registry).decode()
    assert "specc:suffix_cache_tokens 4.0" in text and "specc:suffix_cache_bytes" in text
    assert "specc:suffix_mean_match_length" in text and "specc:suffix_tokens_per_pass" in text


def test_server_keeps_the_cache_across_concurrent_requests_and_shows_it(suffix_bundles):
    """`specc serve` on a suffix bundle: 8 clients at once (token-id prompts), every completion equal to
    target-only, the cache growing across requests and reported in /metrics."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from concurrent.futures import ThreadPoolExecutor

    from test_serving import Server, httpx

    from specc.serving.app import create_app

    _, bundles = suffix_bundles
    model = specc.load(bundles["chain"])
    prompts = token_prompts(16, seed=7)
    truth = [c.token_ids for c in model.generate(prompts, max_new_tokens=10, speculative=False)]
    server = Server(create_app(model, name="tiny", k=3))
    try:
        def ask(i: int) -> list[int]:
            body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 10, "temperature": 0}
            r = server.post("/v1/completions", body)
            assert r.status_code == 200, r.text
            return model.tokenizer(r.json()["choices"][0]["text"], add_special_tokens=False)["input_ids"]

        with ThreadPoolExecutor(8) as pool:
            for _ in range(2):
                got = list(pool.map(ask, range(len(prompts))))
                assert got == truth
        text = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    tokens = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("specc:suffix_cache_tokens"))
    hits = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("specc:suffix_hits"))
    assert tokens >= sum(map(len, truth)) and hits > 0
