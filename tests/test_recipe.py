"""Recipe validation: every error names the field path and what is allowed."""
from __future__ import annotations

import pytest

import specc
from specc.errors import RecipeError, RequestError
from specc.recipe import describe_schema, load_recipe, parse_recipe
from specc.runtime.scheduler import Scheduler

BASE = {"target": {"model": "m"}, "draft": {"method": "prompt_lookup"}}


def _err(data) -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(data)
    return str(info.value)


def test_minimal_recipe_gets_defaults():
    r = parse_recipe(BASE)  # max_context "model": the target's own window, resolved at compile
    assert r.backend == "onnxruntime" and r.speculation.k == "auto" and r.limits.max_context == "model"
    assert parse_recipe({**BASE, "speculation": {"k": "auto"}}).speculation.k == "auto"


@pytest.mark.parametrize("data, path, allowed", [
    ({**BASE, "backend": "tensorflow"}, "backend", "onnxruntime, torch, aoti"),
    ({**BASE, "speculation": {"k": 0}}, "speculation.k", "minimum 1"),
    ({**BASE, "speculation": {"k": "four"}}, "speculation.k", "expected an integer or 'auto'"),
    ({**BASE, "speculation": {"k": None}}, "speculation.k", "expected an integer or 'auto', got None"),
    ({**BASE, "speculation": {"mode": "star"}}, "speculation.mode", "chain, tree"),
    ({**BASE, "sampling": {"top_p": 1.5}}, "sampling.top_p", "maximum 1.0"),
    ({**BASE, "limits": {"max_batch": True}}, "limits.max_batch", "expected an integer"),
    ({**BASE, "draft": {"method": "magic"}}, "draft.method", "model, quantized, early_exit"),
    ({**BASE, "targt": {}}, "targt", "allowed here: target, draft"),
    ({**BASE, "speculation": {"kk": 3}}, "speculation.kk", "allowed here: mode, k, tree"),
    ({"draft": {"method": "none"}}, "target.model", "required"),
    ({"target": {"model": "m"}, "draft": {"method": "model"}}, "draft.model", "required"),
    ({"target": {"model": "m"}, "draft": {"method": "early_exit"}}, "draft.layer", "required"),
    ({"target": {"model": "m"}, "draft": {"method": "quantized"}}, "draft.quantize", "int8, int4"),
    ({"target": {"model": "m"}, "draft": {"method": "prompt_lookup", "quantize": "int4"}}, "draft.quantize",
     "'model', 'quantized', 'medusa' or 'eagle'"),
    ({"target": {"model": "m"}, "draft": {"method": "quantized", "quantize": "int8"}, "backend": "torch"}, "draft.quantize",
     "onnxruntime"),
    ({**BASE, "backend": "tensorrt"}, "device", "cuda"),
    ({**BASE, "precision": "fp16"}, "precision", "GPU"),
    ({**BASE, "backend": "aoti", "device": "cuda", "precision": "fp16"}, "precision", "target.dtype"),
    ({**BASE, "tensorrt": {"optimization_level": 9}}, "tensorrt.optimization_level", "maximum 5"),
    ({**BASE, "tensorrt": {"cuda_graphs": "yes"}}, "tensorrt.cuda_graphs", "true or false"),
    ({**BASE, "target": "m"}, "target", "mapping"),
    ({**BASE, "draft": {"method": "prompt_lookup", "lookup": True}}, "draft.lookup", "model, quantized, early_exit, eagle"),
    ({"target": {"model": "m"}, "draft": {"method": "quantized", "quantize": "int8", "lookup": True},
      "speculation": {"mode": "tree"}}, "draft.lookup", "speculation.mode chain"),
    ({**BASE, "draft": {"method": "prompt_lookup", "stop_below": 0.5}}, "draft.stop_below",
     "model, quantized, early_exit, eagle"),
    ({**BASE, "draft": {"method": "model", "model": "d", "stop_below": 0.5}, "speculation": {"mode": "tree"}},
     "draft.stop_below", "trees"),
    ({**BASE, "draft": {"method": "model", "model": "d", "stop_below": 1.5}}, "draft.stop_below", "maximum 1"),
])
def test_errors_name_field_and_allowed_values(data, path, allowed):
    msg = _err(data)
    assert f"'{path}'" in msg and allowed in msg


def test_empty_and_invalid_yaml_files(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "bad.yaml").write_text("target: [unclosed\n")
    with pytest.raises(RecipeError, match="empty"):
        load_recipe(tmp_path / "empty.yaml")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(tmp_path / "bad.yaml")
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")


def test_model_paths_resolve_against_recipe_folder(tmp_path):
    (tmp_path / "models" / "t").mkdir(parents=True)
    (tmp_path / "r.yaml").write_text("target: {model: models/t}\ndraft: {method: none}\n")
    r = load_recipe(tmp_path / "r.yaml")
    assert r.target.model == str((tmp_path / "models" / "t").resolve())
    (tmp_path / "c.yaml").write_text("target: {model: smollm2-135m-instruct}\ndraft: {method: none}\n")
    assert load_recipe(tmp_path / "c.yaml").target.model == "smollm2-135m-instruct"


def test_schema_description_lists_every_field():
    text = "\n".join(describe_schema())
    for field in ("target.model", "draft.method", "speculation.k", "speculation.tree.max_nodes", "sampling.top_p",
                  "limits.max_context", "backend", "precision", "tensorrt.workspace_mb", "output"):
        assert field in text


def test_example_recipes_are_valid():
    from pathlib import Path

    recipes = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        load_recipe(path)


def test_recipe_k_auto_is_the_bundles_default(models_dir, prompts, tmp_path):
    """speculation.k: auto compiles (graphs shaped for k up to AUTO_K_MAX) and generate without k runs adaptive;
    the bundle is compiled for limits.max_batch 1 (torch.export refuses a dynamic dim with min == max), so its
    rows run one at a time."""
    from conftest import build_bundle
    from specc.limits import AUTO_K_MAX

    bundle = build_bundle(tmp_path / "auto", models_dir / "target", {"method": "model", "model": str(models_dir / "draft")},
                          speculation={"k": "auto"}, limits={"max_batch": 1, "max_context": 256})
    model = specc.load(bundle)
    assert model.k == "auto" and Scheduler(model).policy.k_max == AUTO_K_MAX
    assert Scheduler(model, k=2).policy is None and Scheduler(model, speculative=False).k == 0
    fast = model.generate(prompts[:8], max_new_tokens=16)
    assert model.last_stats.to_dict()["rounds"] > 0
    assert [c.token_ids for c in fast] == [c.token_ids for c in model.generate(prompts[:8], max_new_tokens=16,
                                                                                speculative=False)]
    with pytest.raises(RequestError, match="max_batch"):
        Scheduler(model, max_batch=2)
