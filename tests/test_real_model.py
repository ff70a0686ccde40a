"""SmolLM2-135M-Instruct from the offline catalog: compile, then greedy speculation must equal
target-only greedy and Hugging Face greedy. Downloads ~93 MB the first time (cached after).
About two minutes (the compile is most of it): outside the default run, `pytest -m "real_model"`."""
from __future__ import annotations

import pytest
import torch

import specc
from specc.compiler import compile_recipe
from specc.recipe import parse_recipe

pytestmark = [pytest.mark.real_model, pytest.mark.heavy]

PROMPTS = [
    ("def fibonacci(n):\n", False),
    ("import os\n\ndef list_python_files(root):\n", False),
    ("What is the capital of France?", True),
    ("Give me three tips for writing clean code.", True),
]


@pytest.fixture(scope="module")
def smollm_bundle(tmp_path_factory):
    recipe = parse_recipe({
        "target": {"model": "smollm2-135m-instruct"},
        "draft": {"method": "quantized", "quantize": "int8"},
        "speculation": {"k": 3},
        "limits": {"max_batch": 4, "max_context": 256},
    })
    return compile_recipe(recipe, output=tmp_path_factory.mktemp("smollm") / "bundle", progress=False)


def test_greedy_speculation_equals_target_only(smollm_bundle):
    model = specc.load(smollm_bundle)
    for chat in (False, True):
        prompts = [p for p, c in PROMPTS if c == chat]
        fast = model.generate(prompts, max_new_tokens=40, chat=chat)
        stats = model.last_stats.to_dict()
        slow = model.generate(prompts, max_new_tokens=40, chat=chat, speculative=False)
        assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
        assert stats["acceptance_rate"] > 0.4, stats  # an int8 copy of the target agrees most of the time


@pytest.mark.parametrize("drafting", ["prompt_lookup", "lookup_first"])
def test_lookup_drafting_equals_target_only(smollm_bundle, drafting):
    """The quickstart's prompt lookup, and lookup in front of the int8 copy (draft.lookup), on the real model."""
    from specc.runtime.drafters import FrontDrafter, PromptLookupDrafter
    from specc.runtime.drafters.base import with_method

    model = specc.load(smollm_bundle, verify=False)
    lookup = with_method(PromptLookupDrafter(3, 1, model.target.dims.vocab_size), "prompt_lookup")
    model.drafter = lookup if drafting == "prompt_lookup" else FrontDrafter(lookup, model.drafter)
    prompts = [p for p, chat in PROMPTS if not chat]
    fast = model.generate(prompts, max_new_tokens=40)
    stats = model.last_stats.to_dict()
    slow = model.generate(prompts, max_new_tokens=40, speculative=False)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    assert stats["accepted"] > 0
    if drafting == "lookup_first":
        assert 0 < stats["front_rounds"] < stats["rounds"]


def test_target_only_equals_hugging_face(smollm_bundle):
    from transformers import AutoModelForCausalLM

    from specc.models.load import resolve_source

    hf = AutoModelForCausalLM.from_pretrained(resolve_source("smollm2-135m-instruct")).eval()
    model = specc.load(smollm_bundle, verify=False)
    prompt = PROMPTS[0][0]
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    got = model.generate([prompt], max_new_tokens=24)[0].token_ids
    assert got == ref[: len(got)]
