"""Losslessness checks that any backend's bundle must pass, on any device.

Shared by the AOTInductor test on CPU (test_lossless_aoti.py) and the GPU tests
(test_gpu_backends.py). One small-vocabulary bundle serves both checks: greedy speculation
equals target-only greedy (and Hugging Face greedy), and sampled speculation has the
target's exact distribution over the first three tokens.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

import specc
from conftest import build_bundle
from specc.testing import derive_draft, make_tiny_model
from stats_helpers import PASS_P, chi2_pvalue, total_variation
from test_lossless_sampling import VOCAB, draw, exact_marginals


def small_vocab_bundle(root: Path, backend: str, device: str = "cpu", draft_extra: dict | None = None,
                       **extra) -> tuple[Path, Path]:
    """(target model dir, bundle): a 24-token target and a perturbed 1-layer draft of it, batch up to 512;
    `draft_extra`: further draft fields."""
    target = make_tiny_model(root / "target", seed=0, vocab_size=VOCAB, logit_scale=2.0)
    draft = derive_draft(target, root / "draft", layers=1, perturb=0.05)
    bundle = build_bundle(root / "bundle", target, {"method": "model", "model": str(draft), **(draft_extra or {})},
                          backend=backend,
                          device=device, limits={"max_batch": 512, "max_context": 64}, speculation={"k": 2}, **extra)
    return target, bundle


def token_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(n)]


def assert_greedy_lossless(bundle: Path, prompts: list[list[int]], batch: int, k: int, max_new_tokens: int = 16,
                           **options) -> dict:
    """Speculative greedy output equals target-only greedy output for every prompt; returns the stats.
    options: further `generate` arguments of the speculative calls (stop_below)."""
    from specc.runtime.stats import RunStats

    model = specc.load(bundle, trust_code=True)  # bundles these tests built (aoti, torch_tensorrt run code)
    stats, bad = RunStats(), []
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo:lo + batch]
        fast = model.generate(chunk, max_new_tokens=max_new_tokens, k=k, **options)
        stats.merge(model.last_stats)
        slow = model.generate(chunk, max_new_tokens=max_new_tokens, speculative=False)
        bad += [lo + i for i, (a, b) in enumerate(zip(fast, slow)) if a.token_ids != b.token_ids]
    assert bad == [], f"prompts whose speculative output differs from target-only: {bad}"
    out = stats.to_dict()
    assert out["rounds"] > 0 and 0 < out["acceptance_rate"] < 1, "the draft must be partly right for the test to mean anything"
    return out


def assert_target_only_is_hf_greedy(bundle: Path, target: Path, prompts: list[list[int]], max_new_tokens: int = 12) -> None:
    """The compiled target alone reproduces Hugging Face greedy decoding (on CPU, in float32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    model = specc.load(bundle, trust_code=True)  # bundles these tests built (aoti, torch_tensorrt run code)
    for prompt in prompts:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert model.generate([prompt], max_new_tokens=max_new_tokens, speculative=False)[0].token_ids == ref


def assert_sampling_lossless(bundle: Path, target: Path, params) -> None:
    """The first three sampled tokens follow the target's exact marginals (chi-square, fixed seeds)."""
    exact = exact_marginals(target, params)
    samples, stats = draw(bundle, params)
    assert 0.05 < stats["acceptance_rate"] < 0.95, "the draft must differ from the target for this test to mean anything"
    for pos in range(3):
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, \
            f"position {pos}, TV {total_variation(samples[:, pos], exact[pos]):.3f}"
