"""draft.vocab: a draft model whose LM head keeps only the first ids (passes/restrict_draft_vocab.py) drafts from those
tokens alone, and speculation stays lossless: greedy output equals target-only, sampled output has the target's
distribution, though the draft can never propose some of the tokens the target samples."""
from __future__ import annotations

import json

import pytest
import torch

from lossless_checks import assert_greedy_lossless, assert_sampling_lossless, small_vocab_bundle, token_prompts
from specc.errors import BundleError, RecipeError
from specc.recipe import parse_recipe
from specc.runtime.graphs import vocab_ids
from specc.speculation.sampling import SamplingParams

KEPT = 20  # of the 24-token vocabulary: the target puts a sixth of its third token's mass on the other four


@pytest.fixture(scope="module")
def restricted(tmp_path_factory):
    return small_vocab_bundle(tmp_path_factory.mktemp("vocab"), "onnxruntime", draft_extra={"vocab": KEPT})


def test_the_draft_graph_computes_the_kept_ids_only(restricted):
    import specc

    _, bundle = restricted
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["graphs"]["draft"]["vocab_ids"] == [[0, KEPT - 1]]
    assert "vocab_ids" not in manifest["graphs"]["target"]
    model = specc.load(bundle)
    draft = model.drafter.step
    assert draft.vocab_ids.tolist() == list(range(KEPT))
    from specc.runtime.kv_cache import KVCache

    cache = KVCache(draft.dims, 1, 64)
    raw = draft.runner(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache.lengths, torch.tensor([[2]]),
                       *(t for t in _empty_cache(cache, 3)))[0]
    assert raw.shape[-1] == KEPT
    logits = draft(torch.tensor([[1, 2, 3]]), cache, logit_index=torch.tensor([[2]]))[0]
    assert logits.shape[-1] == 24 and torch.isinf(logits[..., KEPT:]).all() and torch.isfinite(logits[..., :KEPT]).all()


def _empty_cache(cache, t):
    cache.ensure(t)
    return cache.k, cache.v


@pytest.mark.parametrize("batch, k", [(1, 3), (4, 2)])
def test_greedy_output_equals_target_only(restricted, batch, k):
    _, bundle = restricted
    stats = assert_greedy_lossless(bundle, token_prompts(16, seed=batch), batch, k)
    assert stats["acceptance_rate"] < 0.9


def test_sampled_output_has_the_target_distribution(restricted):
    target, bundle = restricted
    assert_sampling_lossless(bundle, target, SamplingParams(0.8, 6, 0.9))


def test_draft_vocab_is_refused_where_it_cannot_apply(tmp_path):
    with pytest.raises(RecipeError, match="draft.vocab.*draft.method model"):
        parse_recipe({"target": {"model": "m"}, "draft": {"method": "prompt_lookup", "vocab": 100}})
    with pytest.raises(RecipeError, match="draft.vocab"):
        parse_recipe({"target": {"model": "m"}, "draft": {"method": "model", "model": "d", "vocab": 0}})
    with pytest.raises(RecipeError, match="draft.vocab.*keeps the whole vocabulary.*allowed: 1 to 23"):
        small_vocab_bundle(tmp_path, "onnxruntime", draft_extra={"vocab": 24})


@pytest.mark.parametrize("runs", [[[3, 1]], [[0, 5], [5, 9]], [[0, 24]], [["0", 3]], [], "0-10", [[0, 1, 2]]])
def test_a_bundle_with_bad_vocab_ids_is_refused(runs):
    with pytest.raises(BundleError, match="vocab_ids must be ascending"):
        vocab_ids(runs, 24, "b: draft")
