"""Penalties, logit_bias, logprobs and JSON-schema output (runtime/rules.py, runtime/grammar.py): exact under
speculation. Greedy speculation equals the transformed target-only output; logprobs equal an eager Hugging Face
reference; grammar-constrained output parses, validates and equals constrained target-only decoding."""
from __future__ import annotations

import json

import pytest
import torch

import specc

PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3,
             "logit_bias": {"97": 4.0, "98": -100}}
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["ok", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                                                "y": {"type": "boolean"}},
                                                "required": ["x"], "additionalProperties": False},
                                      "name": {"type": "string", "maxLength": 4}},
     "required": ["inner", "name"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def prompts_few(prompts):
    return prompts[:6]


@pytest.mark.parametrize("name", ["draft", "prompt_lookup", "tree_dynamic"])
def test_penalties_greedy_speculation_equals_target_only(bundles, prompts_few, name):
    model = specc.load(bundles[name])
    fast = model.generate(prompts_few, max_new_tokens=24, **PENALTIES)
    slow = model.generate(prompts_few, max_new_tokens=24, speculative=False, **PENALTIES)
    plain = model.generate(prompts_few, max_new_tokens=24, speculative=False)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    assert [c.token_ids for c in fast] != [c.token_ids for c in plain], "the penalties must change the output"
    assert all(98 not in c.token_ids for c in fast)  # bias -100


def test_logprobs_equal_eager_reference(bundles, models_dir, prompts_few):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(models_dir / "target").eval()
    model = specc.load(bundles["draft"])
    out = model.generate(prompts_few[:3], max_new_tokens=12, logprobs=3, prompt_logprobs=True)
    for p, c in zip(model.encode(prompts_few[:3]), out):
        ids = p + c.token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        got = [lp for _, lp, _ in c.logprobs]
        want = ref[len(p) - 1:len(ids) - 1].gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got), want, atol=1e-4)
        tops = [[a for a, _ in alts] for _, _, alts in c.logprobs]
        assert tops == ref[len(p) - 1:len(ids) - 1].topk(3, -1).indices.tolist()
        prompt_lp = [lp for _, lp, _ in c.prompt_logprobs]
        want_p = ref[:len(p) - 1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(prompt_lp), want_p, atol=1e-4)
        assert c.logprobs and all(t == tok for (t, _, _), tok in zip(c.logprobs, c.token_ids))


@pytest.mark.parametrize("name", ["draft", "prompt_lookup", "tree_dynamic"])
def test_json_schema_greedy_speculation_is_valid_and_exact(bundles, name):
    jsonschema = pytest.importorskip("jsonschema")
    model = specc.load(bundles[name])
    for schema in SCHEMAS:
        fast = model.generate(["a json:", "{{"], max_new_tokens=60, json_schema=schema)
        slow = model.generate(["a json:", "{{"], max_new_tokens=60, json_schema=schema, speculative=False)
        assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
        for c in fast:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)
