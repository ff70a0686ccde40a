"""Speculation through a compiled AOTInductor bundle (CPU) is lossless: greedy and sampled.

One bundle (two AOTInductor compiles, ~40 s on 2 cores) serves every test here; the same
checks run on CUDA for aoti, tensorrt and torch_tensorrt in test_gpu_backends.py.
"""
from __future__ import annotations

import pytest

from lossless_checks import (assert_greedy_lossless, assert_sampling_lossless, assert_target_only_is_hf_greedy,
                             small_vocab_bundle, token_prompts)
from specc.speculation.sampling import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def aoti_bundle(tmp_path_factory):
    return small_vocab_bundle(tmp_path_factory.mktemp("aoti"), "aoti")


@pytest.mark.parametrize("batch, k", [(1, 1), (3, 2), (8, 4)])
def test_greedy_speculation_equals_target_only(aoti_bundle, batch, k):
    _, bundle = aoti_bundle
    assert_greedy_lossless(bundle, token_prompts(16, seed=batch), batch, k)


def test_target_only_equals_hugging_face(aoti_bundle):
    target, bundle = aoti_bundle
    assert_target_only_is_hf_greedy(bundle, target, token_prompts(4, seed=7))


def test_sampled_output_has_target_distribution(aoti_bundle):
    target, bundle = aoti_bundle
    assert_sampling_lossless(bundle, target, SamplingParams(0.8, 6, 0.9))
