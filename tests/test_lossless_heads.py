"""Medusa and EAGLE heads (EAGLE-3 checkpoints too) are lossless: greedy output equals target-only
(chain and tree, batch > 1) and sampled output has the target's distribution; the sampling check fails
for a broken rule."""
from __future__ import annotations

import pytest
import torch

from conftest import build_bundle
from adaptive_helpers import FlippingK
from heads_helpers import make_random_head, write_eagle3_checkpoint
from lossless_checks import assert_greedy_lossless, token_prompts
from specc.runtime.drafters import heads as head_drafters, loops as draft_loops
from specc.speculation import sampling
from specc.testing import make_tiny_model
from stats_helpers import FAIL_P, PASS_P, chi2_pvalue, total_variation
from test_lossless_sampling import PARAMS, VOCAB, draw, exact_marginals

DYNAMIC = {"mode": "tree", "tree": {"depth": 3, "branching": 2, "max_nodes": 6}}
STATIC = {"mode": "tree", "tree": {"paths": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}}


@pytest.fixture(scope="module")
def head_bundles(tmp_path_factory):
    """Random heads on a 24-token target; the EAGLE chain bundle runs on ONNX Runtime, the rest on torch."""
    root = tmp_path_factory.mktemp("heads")
    target = make_tiny_model(root / "target", seed=0, vocab_size=VOCAB, logit_scale=2.0)
    medusa = {"method": "medusa", "head": str(make_random_head("medusa", target, root / "medusa", n_heads=3))}
    eagle = {"method": "eagle", "head": str(make_random_head("eagle", target, root / "eagle", scale=1.0))}
    eagle3 = {"method": "eagle", "head": str(write_eagle3_checkpoint(target, root / "eagle3", scale=0.5, layer_ids=[1, 1, 1],
                                                                     draft_vocab=list(range(2, VOCAB))))}
    limits = {"max_batch": 512, "max_context": 64}
    return target, {
        "medusa_chain": build_bundle(root / "mc", target, medusa, limits=limits, backend="torch", speculation={"k": 3}),
        "eagle_chain": build_bundle(root / "ec", target, eagle, limits=limits, speculation={"k": 3}),
        "eagle_int4": build_bundle(root / "e4", target, {**eagle, "quantize": "int4"}, limits=limits, speculation={"k": 3}),
        "medusa_int8": build_bundle(root / "m8", target, {**medusa, "quantize": "int8"}, limits=limits,
                                    speculation={"k": 3}),
        "eagle_lookup": build_bundle(root / "el", target, {**eagle, "lookup": True, "min_ngram": 1}, limits=limits,
                                     backend="torch", speculation={"k": 3}),
        "medusa_tree": build_bundle(root / "mt", target, medusa, limits=limits, backend="torch", speculation=STATIC),
        "eagle_tree": build_bundle(root / "et", target, eagle, limits=limits, backend="torch", speculation=DYNAMIC),
        "eagle3_chain": build_bundle(root / "e3c", target, eagle3, limits=limits, speculation={"k": 3}),
    }


@pytest.mark.parametrize("name", ["medusa_chain", "eagle_chain", "medusa_tree", "eagle_tree", "eagle_lookup", "eagle_int4",
                                  "medusa_int8", "eagle3_chain"])
def test_greedy_equals_target_only(head_bundles, name):
    _, bundles = head_bundles
    if name in ("eagle_int4", "medusa_int8"):  # draft.quantize: the head's own graph is quantised, the target is not
        import specc

        bundle = specc.load(bundles[name]).bundle
        assert bundle.graph("draft").quantize == name[-4:] and bundle.graph("target").quantize is None
    stats = assert_greedy_lossless(bundles[name], token_prompts(16), batch=4, k=None)
    assert stats["rounds"] > 0
    if name == "eagle_lookup":  # prompt lookup drafts some rounds, the head the others
        assert 0 < stats["front_rounds"] < stats["rounds"]


@pytest.mark.parametrize("name", ["eagle_tree", "medusa_tree"])
def test_reranked_trees_greedy_equal_target_only(head_bundles, monkeypatch, name):
    """EAGLE-2 style: each level grows its 2 best nodes, 6 drafted, the 3 most likely verified; the
    rerank really prunes (trees of more than 3 nodes come to it) and output stays target-only's."""
    from specc.runtime import verifier
    from specc.speculation.tree import TreeShape

    sizes, real = [], verifier.rerank
    monkeypatch.setattr(verifier, "rerank", lambda t, n: sizes.append(t.size) or real(t, n))
    _, bundles = head_bundles
    shape = TreeShape(None, depth=3, branching=2, max_nodes=6, verify_nodes=3)
    assert_greedy_lossless(bundles[name], token_prompts(8), batch=4, k=None, tree=shape)
    assert max(sizes) > 3


def test_eagle_behind_lookup_greedy_under_flipping_k(head_bundles, monkeypatch):
    """k auto, with a policy that changes k (0 included) and the arm (lookup alone, the head alone)
    every round: the head's features stay in step whatever drafted the rounds before."""
    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", FlippingK)
    _, bundles = head_bundles
    stats = assert_greedy_lossless(bundles["eagle_lookup"], token_prompts(16), batch=4, k="auto")
    assert 0 < stats["front_rounds"] < stats["rounds"]


def test_eagle_features_stay_in_step_under_flipping_k(head_bundles, monkeypatch):
    """After every round, plain ones (k = 0) and lookup's included, each row's head cache and its features not
    yet entered cover exactly the tokens the target committed: the head never pairs a token with another's feature."""
    import specc
    from specc.runtime.scheduler import Scheduler

    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", FlippingK)
    _, bundles = head_bundles
    model = specc.load(bundles["eagle_lookup"])
    scheduler = Scheduler(model, k="auto", max_batch=4)
    for i, ids in enumerate(token_prompts(8)):
        scheduler.submit(model.new_request(i, ids, 16, model.sampling_params(), i, k=scheduler.lookahead))
    plain = 0
    while scheduler.busy:
        scheduler.step()
        plain += scheduler.last_round is not None and scheduler.last_round.k == 0
        if scheduler.batch is not None:
            head = scheduler.batch.draft_state
            entered = head.lengths + torch.tensor([len(t) for t in head.todo])
            assert entered.tolist() == scheduler.batch.cache.lengths.tolist()
    assert plain > 0


# trees: per-row Python tree growth over 512 rows
@pytest.mark.parametrize("name", ["medusa_chain", "eagle_chain", "eagle_lookup", "eagle3_chain",
                                  pytest.param("eagle_tree", marks=[pytest.mark.slow, pytest.mark.heavy]),
                                  pytest.param("medusa_tree", marks=[pytest.mark.slow, pytest.mark.heavy])])
def test_sampled_output_has_target_distribution(head_bundles, name):
    target, bundles = head_bundles
    params = PARAMS[1] if name.endswith("chain") else PARAMS[0]
    exact = exact_marginals(target, params)
    samples, stats = draw(bundles[name], params)
    assert 0.01 < stats["acceptance_rate"] < 0.95, "drafts must be both accepted and rejected for this test to mean anything"
    for pos in range(3):
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, (
            f"position {pos}, TV {total_variation(samples[:, pos], exact[pos]):.3f}")


def _accept_everything(p, q, draft, n_draft, u_accept, u_next):
    rows = torch.arange(p.shape[0])
    return n_draft, sampling.sample(p[rows, n_draft], u_next)


def _uniform_q(choose):
    """Drafts drawn from the head's q but reported with a uniform q: a wrong acceptance ratio."""
    def wrong(logits, params, noise):
        tok, q = choose(logits, params, noise)
        return tok, None if q is None else torch.full_like(q, 1.0 / q.shape[-1])
    return wrong


def _report_uniform_q(monkeypatch) -> None:
    """Every head's drafts (Medusa's own loop, the shared chain loop of EAGLE) reported with a uniform q."""
    for module in (head_drafters, draft_loops):
        monkeypatch.setattr(module, "choose", _uniform_q(module.choose))


# EAGLE-3 drafts with the same code
@pytest.mark.parametrize("name,broken", [("medusa_chain", "accept_all"), ("eagle_chain", "wrong_q")])
def test_broken_rule_is_caught(head_bundles, monkeypatch, name, broken):
    if broken == "accept_all":
        monkeypatch.setattr(sampling, "accept_sampled", _accept_everything)
    else:
        _report_uniform_q(monkeypatch)
    target, bundles = head_bundles
    params = PARAMS[0]
    exact = exact_marginals(target, params)
    samples, _ = draw(bundles[name], params)
    assert chi2_pvalue(samples[:, 0], exact[0]) > PASS_P  # the first token comes from prefill, untouched
    assert min(chi2_pvalue(samples[:, pos], exact[pos]) for pos in (1, 2)) < FAIL_P


STOP = 0.5  # draft.stop_below in the early-stop checks: the random heads give some drafts more, some less


def test_early_stops_greedy_equals_target_only(head_bundles):
    """draft.stop_below: a row's chain ends after a draft the head was unsure of; output stays target-only's."""
    _, bundles = head_bundles
    full = assert_greedy_lossless(bundles["eagle_chain"], token_prompts(16), batch=4, k=None)
    stopped = assert_greedy_lossless(bundles["eagle_chain"], token_prompts(16), batch=4, k=None, stop_below=STOP)
    assert full["drafted"] == 3 * full["rounds"]
    assert stopped["rounds"] < stopped["drafted"] < 3 * stopped["rounds"], "some chains must stop early, not all at once"
    behind_lookup = assert_greedy_lossless(bundles["eagle_lookup"], token_prompts(16), batch=4, k=None, stop_below=STOP)
    assert 0 < behind_lookup["front_rounds"] < behind_lookup["rounds"]


@pytest.mark.parametrize("broken", [None, "wrong_q"])
def test_early_stops_keep_the_target_distribution(head_bundles, monkeypatch, broken):
    """Sampled with early stops: the target's distribution; the same check fails for drafts reported with a wrong q."""
    if broken:
        _report_uniform_q(monkeypatch)
    target, bundles = head_bundles
    params = PARAMS[1]
    exact = exact_marginals(target, params)
    samples, stats = draw(bundles["eagle_chain"], params, stop_below=STOP)
    assert stats["rounds"] < stats["drafted"] < 3 * stats["rounds"], "some chains must stop early, not all at once"
    p = [chi2_pvalue(samples[:, pos], exact[pos]) for pos in range(3)]
    if broken:
        assert p[0] > PASS_P and min(p[1:]) < FAIL_P
    else:
        assert min(p) > PASS_P, f"p-values {p}"


@pytest.mark.parametrize("name", ["eagle_chain", "medusa_chain", "eagle_tree"])
def test_chunked_prefill_greedy_equals_target_only(head_bundles, monkeypatch, name):
    """Prompts entered in chunks of 3 (the target's prefill, EAGLE's first entries): still the target's output."""
    from specc.runtime import engine

    monkeypatch.setattr(engine, "DEFAULT_CHUNK", 3)
    _, bundles = head_bundles
    assert_greedy_lossless(bundles[name], token_prompts(16), batch=4, k=None)



def test_eagle_behind_the_suffix_front_gets_the_prompts_features(head_bundles, tmp_path):
    """EAGLE with the suffix drafter in front (draft.suffix) needs the target's features of every prompt token,
    as EAGLE alone does: a prompt whose first blocks the prefix cache could hold is still prefilled whole, and
    the head's entries for it equal a cold prefill's (the cache would have handed it zero features there)."""
    import specc
    from adaptive_helpers import admit
    from specc.runtime.record import DraftPlan
    from specc.runtime.scheduler import Scheduler

    target, _ = head_bundles
    head = make_random_head("eagle", target, tmp_path / "eagle", scale=1.0)
    bundle = build_bundle(tmp_path / "es", target, {"method": "eagle", "head": str(head), "suffix": True},
                          backend="torch", limits={"max_batch": 2, "max_context": 256}, speculation={"k": 3})
    prompt = [(7 * i + i // 24) % VOCAB for i in range(150)]  # two whole prefix-cache blocks and more

    def entries(model) -> tuple:
        """The prompt's prefix-cache hit, and the head's entries once its first round has entered the prompt."""
        scheduler = Scheduler(model, k=3)
        scheduler.submit(model.new_request(0, prompt, 4, model.sampling_params(), 0, k=scheduler.lookahead))
        (event,) = admit(scheduler)
        batch = scheduler.batch
        scheduler.drafter.model.propose(batch, batch.params, DraftPlan(2))  # EAGLE's round, whatever the front finds
        cache = batch.draft_state
        n = len(prompt) - 1
        assert int(cache.lengths[0]) >= n
        return event.cached_tokens, cache.k[..., :n, :].clone(), cache.v[..., :n, :].clone()

    warm, cold = specc.load(bundle), specc.load(bundle)
    assert warm.drafter.front is not None and warm.drafter.method.prompt_features
    first, second, fresh = entries(warm), entries(warm), entries(cold)  # the second prompt was the first one's
    assert (first[0], second[0], fresh[0]) == (0, 0, 0)
    assert fresh[1].abs().sum() > 0
    for a, b in zip(second[1:], fresh[1:]):
        assert torch.equal(a, b)
