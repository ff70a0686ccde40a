"""Shape profiles for TensorRT-style backends: planned from the recipe, chosen per call."""
from __future__ import annotations

import pytest

from specc.backends.profiles import PREFILL_OPT_TOKENS, Profile, ShapePlan, dim_sizes, plan_profiles, select_profile, step_tokens
from specc.capture.shapes import dim_ranges
from specc.errors import SpeccError

RANGES = {name: tuple(r) for name, r in dim_ranges(8, 2048).to_dict().items()}


def _inside_declared(profile: Profile, ranges: dict) -> bool:
    return all(ranges[d][0] <= lo <= opt <= hi <= ranges[d][1] for d, (lo, opt, hi) in profile.dims.items())


@pytest.mark.parametrize("role, mode, k, nodes, expected", [
    ("target", "chain", 4, 16, (5, 5)),
    ("target", "tree", 4, 16, (17, 17)),
    ("draft", "chain", 4, 16, (2, 1)),
    ("draft", "tree", 7, 16, (2, 1)),
])
def test_step_tokens(role, mode, k, nodes, expected):
    assert step_tokens(role, mode, k, nodes) == expected


def test_target_profiles_for_verify_and_prefill():
    step, prefill = plan_profiles(RANGES, step_tokens("target", "chain", 4, 16))
    assert step.name == "step" and prefill.name == "prefill"
    assert step.dims["tokens"] == (1, 5, 5) and step.dims["rows"] == (1, 5, 5)
    assert prefill.dims["tokens"] == (1, PREFILL_OPT_TOKENS, 2048) and prefill.dims["rows"] == (1, 1, 2048)
    for p in (step, prefill):
        assert p.dims["batch"] == (1, 8, 8)
        assert p.dims["cache"] == (1, 1024, 2048)
        assert _inside_declared(p, RANGES)


def test_draft_step_profile_is_tuned_for_one_token():
    step, _ = plan_profiles(RANGES, step_tokens("draft", "chain", 4, 16))
    assert step.dims["tokens"] == (1, 1, 2) and step.dims["rows"] == (1, 1, 2)


def test_small_limits_are_respected():
    ranges = {name: tuple(r) for name, r in dim_ranges(1, 16).to_dict().items()}
    for profile in plan_profiles(ranges, step_tokens("target", "tree", 4, 128)):
        assert _inside_declared(profile, ranges), profile
    step, prefill = plan_profiles(ranges, (129, 129))
    assert step.dims["tokens"] == (1, 16, 16) and prefill.dims["tokens"] == (1, 16, 16)
    assert step.dims["cache"] == (1, 16, 16)  # half of 16 rounds up to a 64-slot block, clamped to the limit


def test_dimensions_added_by_passes_get_their_declared_range():
    step, prefill = plan_profiles({**RANGES, "nodes": (1, 32)}, (5, 5))
    assert step.dims["nodes"] == prefill.dims["nodes"] == (1, 1, 32)


def test_select_profile_picks_the_smallest_that_fits():
    profiles = plan_profiles(RANGES, (5, 5))
    decode = {"batch": 3, "tokens": 1, "rows": 1, "cache": 128}
    assert profiles[select_profile(profiles, decode)].name == "step"
    assert profiles[select_profile(profiles, {**decode, "tokens": 5, "rows": 5})].name == "step"
    assert profiles[select_profile(profiles, {**decode, "tokens": 9, "rows": 9})].name == "prefill"  # k=8 at run time
    assert profiles[select_profile(profiles, {**decode, "tokens": 300, "rows": 1})].name == "prefill"
    with pytest.raises(SpeccError, match="no engine profile holds.*'batch': 9.*compile with larger limits"):
        select_profile(profiles, {**decode, "batch": 9})


def test_input_shapes_and_union():
    step, prefill = plan_profiles(RANGES, (5, 5))
    assert step.input_shapes(["batch", "tokens"]) == ((1, 1), (8, 5), (8, 5))
    assert step.input_shapes([3, "batch", 2, "cache", 16]) == ((3, 1, 2, 1, 16), (3, 8, 2, 1024, 16), (3, 8, 2, 2048, 16))
    plan = ShapePlan([], (step, prefill), {})
    union = plan.union()
    assert union.dims["tokens"] == (1, 5, 2048) and union.dims["rows"] == (1, 5, 2048)
    assert Profile.from_dict(step.to_dict()) == step


def test_dim_sizes_reads_and_checks_a_call():
    inputs = [{"name": "input_ids", "shape": ["batch", "tokens"]}, {"name": "k_cache", "shape": [3, "batch", 2, "cache", 16]}]
    assert dim_sizes(inputs, [(2, 5), (3, 2, 2, 64, 16)]) == {"batch": 2, "tokens": 5, "cache": 64}
    with pytest.raises(SpeccError, match="'batch' is 2 in one input and 4 in 'k_cache'"):
        dim_sizes(inputs, [(2, 5), (3, 4, 2, 64, 16)])
    with pytest.raises(SpeccError, match="axis 0 is 4, the graph fixes it at 3"):
        dim_sizes(inputs, [(2, 5), (4, 2, 2, 64, 16)])
    with pytest.raises(SpeccError, match="'input_ids' has shape"):
        dim_sizes(inputs, [(2,), (3, 2, 2, 64, 16)])


def test_compiler_plans_profiles_from_the_recipe(tmp_path):
    from transformers import AutoModelForCausalLM

    from specc.capture.graph import capture
    from specc.compiler import shape_plan
    from specc.recipe import parse_recipe
    from specc.testing import make_tiny_model

    recipe = parse_recipe({"target": {"model": "m"}, "draft": {"method": "model", "model": "d"},
                           "speculation": {"k": 3}, "limits": {"max_batch": 4, "max_context": 256}})
    hf = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m")).eval()
    graph = capture("target", hf, dim_ranges(4, 256))
    plan = shape_plan(recipe, "target", graph)
    assert [i["name"] for i in plan.inputs] == [i.name for i in graph.inputs]
    assert plan.example == {"batch": 2, "tokens": 3, "rows": 3, "cache": 5}
    step, prefill = plan.profiles
    assert step.dims["tokens"] == (1, 4, 4) and prefill.dims["tokens"] == (1, PREFILL_OPT_TOKENS, 256)
    assert shape_plan(recipe, "draft", graph).profiles[0].dims["tokens"] == (1, 1, 2)
