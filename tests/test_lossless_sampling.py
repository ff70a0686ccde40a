"""Sampled speculative output has the target's distribution, end to end through a compiled
bundle; the same check fails when the acceptance rule is broken."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import specc
from specc.runtime import verifier
from specc.runtime.record import DraftPlan
from specc.speculation import sampling
from specc.speculation.sampling import RowParams, SamplingParams, probs_from_logits, sample
from specc.testing import derive_draft, make_tiny_model

from conftest import build_bundle
from stats_helpers import FAIL_P, PASS_P, chi2_pvalue, total_variation

VOCAB = 24
PROMPT = [3, 1, 4, 1, 5]
N = 6144


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("smallvocab")
    target = make_tiny_model(root / "target", seed=0, vocab_size=VOCAB, logit_scale=2.0)
    draft = derive_draft(target, root / "draft", layers=1, perturb=0.05)
    limits = {"max_batch": 512, "max_context": 64}
    chain = build_bundle(root / "chain", target, {"method": "model", "model": str(draft)}, limits=limits,
                         speculation={"k": 2})
    tree = build_bundle(root / "tree", target, {"method": "model", "model": str(draft)}, limits=limits, backend="torch",
                        speculation={"mode": "tree", "tree": {"depth": 2, "branching": 2, "max_nodes": 6}})
    early_exit = build_bundle(root / "early_exit", target, {"method": "early_exit", "layer": 1}, limits=limits,
                              backend="torch", speculation={"k": 2})
    lookup = build_bundle(root / "lookup", target, {"method": "prompt_lookup", "max_ngram": 1}, limits=limits,
                          backend="torch", speculation={"k": 2})
    lookup_first = build_bundle(root / "lookup_first", target, {"method": "model", "model": str(draft), "lookup": True,
                                                                "max_ngram": 1}, limits=limits, backend="torch",
                                speculation={"k": 2})
    return target, {"chain": chain, "tree": tree, "early_exit": early_exit, "prompt_lookup": lookup,
                    "lookup_first": lookup_first}


def exact_marginals(target, params: SamplingParams, prompt: list[int] = PROMPT):
    """P(t1), P(t2), P(t3) of the target (a model directory or a loaded HF model) with this processing, by
    enumerating contexts."""
    from transformers import AutoModelForCausalLM

    hf = target if isinstance(target, torch.nn.Module) else AutoModelForCausalLM.from_pretrained(target).eval()
    prompt = torch.tensor(prompt)

    def probs(logits):
        rows = RowParams.of([params] * logits.shape[0])
        return probs_from_logits(logits, rows.temperature, rows.top_k, rows.top_p)

    with torch.no_grad():
        p1 = probs(hf(prompt[None]).logits[:, -1])[0]
        ctx2 = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        p2_given = probs(hf(ctx2).logits[:, -1])  # [t1, t2]
        pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
        ctx3 = torch.cat([prompt.expand(len(pairs), -1), pairs], 1)
        p3_given = probs(hf(ctx3).logits[:, -1]).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2_given
    return p1.numpy(), joint12.sum(0).numpy(), (joint12[..., None] * p3_given).sum((0, 1)).numpy()


def draw(bundle, params: SamplingParams, prompt: list[int] = PROMPT, batch: int = 512, **options):
    from specc.runtime.stats import RunStats

    model = specc.load(bundle, trust_code=True)  # bundles these tests built (aoti runs code)
    out, stats = [], RunStats()
    for lo in range(0, N, batch):
        done = model.generate([prompt] * batch, max_new_tokens=3, seed=list(range(lo, lo + batch)),
                              temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, **options)
        out += [c.token_ids for c in done]
        stats.merge(model.last_stats)
    assert all(len(t) == 3 for t in out)
    return np.array(out), stats.to_dict()


PARAMS = [SamplingParams(1.0), SamplingParams(0.8, 6, 0.9)]


@pytest.mark.parametrize("mode", ["chain", "tree", "early_exit", "prompt_lookup"])
@pytest.mark.parametrize("params", PARAMS, ids=["t1.0", "t0.8-k6-p0.9"])
def test_sampled_output_has_target_distribution(small_vocab, params, mode):
    target, bundles = small_vocab
    exact = exact_marginals(target, params)
    samples, stats = draw(bundles[mode], params)
    assert 0.01 < stats["acceptance_rate"] < 0.95, "drafts must be both accepted and rejected for this test to mean anything"
    for pos in range(3):
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, (
            f"position {pos}, TV {total_variation(samples[:, pos], exact[pos]):.3f}")


LOOKUP_PROMPT = list(range(17)) + [3, 1, 4, 1, 5]


def test_lookup_first_sampled_output_has_target_distribution(small_vocab):
    """draft.lookup mixes one-hot lookup rounds and model rounds (a round is a lookup round when every
    row of the batch finds a continuation): a prompt holding most of the vocabulary and batches of
    four make both kinds common (about 65% lookup rounds)."""
    target, bundles = small_vocab
    params, prompt = PARAMS[1], LOOKUP_PROMPT
    exact = exact_marginals(target, params, prompt)
    samples, stats = draw(bundles["lookup_first"], params, prompt, batch=4)
    assert 0.2 < stats["front_rounds"] / stats["rounds"] < 0.8
    assert 0 < stats["front_acceptance_rate"] < 0.95 and 0 < stats["model_acceptance_rate"] < 0.95
    for pos in range(3):
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, (
            f"position {pos}, TV {total_variation(samples[:, pos], exact[pos]):.3f}")


@pytest.mark.heavy  # a minute; k auto's sampled exactness stays in the default run: test_adaptive_runtime.py
def test_lookup_first_arms_under_k_auto_keep_the_target_distribution(small_vocab, monkeypatch):
    """k auto on lookup in front of a draft model: the policy's arms, the model alone (also where lookup
    finds a continuation) and lookup alone (rows it misses get no drafts), taken in turn with a changing
    k, keep the target's distribution."""
    from specc.runtime.adaptive import AdaptiveK

    class Arms(AdaptiveK):
        def choose(self, rows, remaining=None, behind=None, finds=None):
            self.round_no += 1
            return DraftPlan(1 + self.round_no % 3, ("model", "lookup")[self.round_no % 2], stop_chain=True)

    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", Arms)
    target, bundles = small_vocab
    params, prompt = PARAMS[1], LOOKUP_PROMPT
    exact = exact_marginals(target, params, prompt)
    samples, stats = draw(bundles["lookup_first"], params, prompt, batch=4, k="auto")
    assert 0.2 < stats["front_rounds"] / stats["rounds"] < 0.8 and 0 < stats["accepted"] < stats["drafted"]
    assert stats["front_acceptance_rate"] is not None and stats["model_acceptance_rate"] is not None  # both drafted
    for pos in range(3):
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, (
            f"position {pos}, TV {total_variation(samples[:, pos], exact[pos]):.3f}")


def test_lookup_k_chosen_by_match_length_stays_exact(small_vocab, tmp_path, monkeypatch):
    """k auto prices prompt lookup's rounds by how long a match the rows' contexts hold (`Drafter.finds`):
    k then depends on the context, never on the round's noise, so sampled output keeps the target's
    distribution. A policy that drafts as many tokens as the longest match is long makes that dependence
    as strong as it gets; the prompt holds every two-token sequence that starts with its last token."""
    from specc.runtime.adaptive import AdaptiveK

    chosen = []

    class MatchLengthK(AdaptiveK):
        def choose(self, rows, remaining=None, behind=None, finds=None):
            chosen.append(max(finds["draft"]))
            return DraftPlan(chosen[-1], "draft", stop_chain=True)

    monkeypatch.setattr("specc.runtime.planning.AdaptiveK", MatchLengthK)
    target, _ = small_vocab
    bundle = build_bundle(tmp_path / "lookup2", target, {"method": "prompt_lookup", "max_ngram": 2},
                          limits={"max_batch": 512, "max_context": 64}, backend="torch", speculation={"k": 2})
    params, prompt = PARAMS[1], [t for x in range(VOCAB) for t in (4, x)] + [4]
    exact = exact_marginals(target, params, prompt)
    samples, stats = draw(bundle, params, prompt, k="auto")
    assert {1, 2} <= set(chosen), "rounds of one- and two-token matches"
    assert 0.01 < stats["acceptance_rate"] < 0.95
    for pos in range(3):
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, (
            f"position {pos}, TV {total_variation(samples[:, pos], exact[pos]):.3f}")


def _accept_everything(p, q, draft, n_draft, u_accept, u_next):
    rows = torch.arange(p.shape[0])
    return n_draft, sample(p[rows, n_draft], u_next)


def _accept_first_child(p, tree, u):
    """Wrong tree rule: follow the first child at every node, bonus from p."""
    path = [0]
    while tree.children.get(path[-1]):
        path.append(tree.children[path[-1]][0])
    return path, int(sample(p[path[-1]][None], u[-1:])[0])


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_broken_acceptance_rule_is_caught(small_vocab, monkeypatch, mode):
    if mode == "chain":
        monkeypatch.setattr(sampling, "accept_sampled", _accept_everything)
    else:
        monkeypatch.setattr(verifier, "accept_tree_sampled", _accept_first_child)
    target, bundles = small_vocab
    params = PARAMS[0]
    exact = exact_marginals(target, params)
    samples, _ = draw(bundles[mode], params)
    assert chi2_pvalue(samples[:, 0], exact[0]) > PASS_P  # the first token comes from prefill, untouched
    assert min(chi2_pvalue(samples[:, pos], exact[pos]) for pos in (1, 2)) < FAIL_P


def test_lookup_first_with_the_wrong_q_is_caught(small_vocab, monkeypatch):
    """Lookup rounds that report a uniform q instead of the one-hot q of their drafts break the
    distribution; the check above must see it."""
    from specc.runtime.drafters import PromptLookupDrafter

    one_hot = PromptLookupDrafter.drafts

    def uniform_q(self, found, params, device):
        p = one_hot(self, found, params, device)
        p.q = None if p.q is None else torch.full_like(p.q, 1.0 / p.q.shape[-1])
        return p

    monkeypatch.setattr(PromptLookupDrafter, "drafts", uniform_q)
    target, bundles = small_vocab
    params = PARAMS[1]
    exact = exact_marginals(target, params, LOOKUP_PROMPT)
    samples, _ = draw(bundles["lookup_first"], params, LOOKUP_PROMPT, batch=4)
    assert chi2_pvalue(samples[:, 0], exact[0]) > PASS_P  # the first token comes from prefill, untouched
    assert min(chi2_pvalue(samples[:, pos], exact[pos]) for pos in (1, 2)) < FAIL_P


def test_early_stops_of_a_draft_model_keep_the_target_distribution(small_vocab):
    """draft.stop_below: chains a draft model ends after a draft it gave < 0.5 keep the target's distribution."""
    target, bundles = small_vocab
    params = PARAMS[0]
    exact = exact_marginals(target, params)
    samples, stats = draw(bundles["chain"], params, stop_below=0.5)
    assert stats["rounds"] < stats["drafted"] < 2 * stats["rounds"], "some chains must stop early, not all at once"
    for pos in range(3):
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, (
            f"position {pos}, TV {total_variation(samples[:, pos], exact[pos]):.3f}")


def test_a_draft_window_keeps_the_target_distribution(small_vocab, monkeypatch):
    """A draft model that took in only the prompt's first token and last 2 proposes from less context (its own
    q); the acceptance rule still yields the target's distribution (the rule's twin:
    test_broken_acceptance_rule_is_caught)."""
    from specc.runtime.drafters import model as model_drafter

    monkeypatch.setattr(model_drafter, "DRAFT_WINDOW", 2)
    monkeypatch.setattr(model_drafter, "DRAFT_SINK", 1)
    target, bundles = small_vocab
    params = PARAMS[0]
    assert len(PROMPT) > 3
    exact = exact_marginals(target, params)
    samples, stats = draw(bundles["chain"], params)
    assert 0.01 < stats["acceptance_rate"] < 0.95
    for pos in range(3):
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, (
            f"position {pos}, TV {total_variation(samples[:, pos], exact[pos]):.3f}")
