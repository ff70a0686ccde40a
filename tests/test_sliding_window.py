"""Sliding-window layers stay exact in long generations.

The runtime's cache is not a ring buffer: every slot stays, and the graph's mask hides the
slots that left a layer's window (cache part) and the new tokens too far back (new part, which
matters for prefill and verify passes longer than the window). Checked where runtimes break:
prompt + output several windows long, batch rows at different lengths, tree verification.
"""
from __future__ import annotations

import random

import pytest
import torch

import specc
from conftest import build_bundle
from specc.capture.step_decoder import StepDecoder
from specc.testing import derive_draft, make_tiny_model
from test_model_families import assert_prefix_until_eos, hf_greedy, load_hf, step_greedy

WINDOW = 4


def _prompts(n: int, lo: int, hi: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_window_masks_new_tokens_in_a_long_prefill(tmp_path):
    """One prefill of 20 tokens (5 windows) must equal HF: the window applies among new tokens too."""
    hf = load_hf(make_tiny_model(tmp_path / "m", arch="mistral", layers=2, sliding_window=WINDOW), "mistral")
    dec = StepDecoder(hf).eval()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    empty = torch.zeros(dec.n_layers, 1, dec.n_kv_heads, 0, dec.head_dim)
    with torch.no_grad():
        logits, _, _ = dec(ids, torch.arange(20)[None], torch.zeros(1, dtype=torch.long), torch.arange(20)[None], empty, empty)
        torch.testing.assert_close(logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gemma3"])
def test_window_eager_batched_long_generation(arch, tmp_path):
    """Rows of 1-12 prompt tokens decoded together for 24 tokens (6 windows) equal HF generate row by row."""
    hf = load_hf(make_tiny_model(tmp_path / "m", arch=arch, layers=2, sliding_window=WINDOW), arch)
    dec = StepDecoder(hf).eval()
    prompts = _prompts(8, 1, 12)
    got = step_greedy(dec, prompts, 24)
    assert [i for i, p in enumerate(prompts) if got[i] != hf_greedy(hf, p, 24)] == []


def test_window_tree_speculation_matches_target_only_and_hf(tmp_path):
    """Gemma 3 (sliding and global layers, window 4) compiled with a dynamic tree: verify passes
    of up to 8 tree nodes reach across the window; output equals target-only and HF generate."""
    target = make_tiny_model(tmp_path / "target", arch="gemma3", layers=2, sliding_window=WINDOW)
    draft = derive_draft(target, tmp_path / "draft", layers=1)
    tree = {"mode": "tree", "tree": {"depth": 3, "branching": 2, "max_nodes": 8}}
    bundle = build_bundle(tmp_path / "bundle", target, {"method": "model", "model": str(draft)}, backend="torch",
                          speculation=tree, limits={"max_batch": 4, "max_context": 64})
    model = specc.load(bundle)
    prompts = _prompts(8, 1, 14)
    fast = model.generate(prompts, max_new_tokens=24)
    assert model.last_stats.to_dict()["rounds"] > 0
    slow = model.generate(prompts, max_new_tokens=24, speculative=False)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    hf = load_hf(target, "gemma3")
    for prompt, c in zip(prompts, slow):
        ref = hf_greedy(hf, prompt, 24)
        assert_prefix_until_eos(c.token_ids, ref)
