"""`specc triton`: the repositories it writes (every config.pbtxt parsed with tritonclient's
model_config_pb2), the files it places, and its errors."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from specc.bundle import Manifest, open_bundle
from specc.cli import main
from specc.digest import sha256_of
from specc.errors import BundleError
from specc.triton import write_repository
from specc.triton.configs import engine_config
from specc.triton.interface import INPUTS, OUTPUTS, markdown_table
from specc.triton.pbtxt import Enum, to_pbtxt

ROOT = Path(__file__).resolve().parents[1]
Config = model_config_pb2.ModelConfig


def parse(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), Config())


def configs(repo: Path) -> dict[str, model_config_pb2.ModelConfig]:
    """Every model of the repository, its config parsed (and named like its directory)."""
    out = {d.name: parse(d / "config.pbtxt") for d in sorted(repo.iterdir())}
    assert all(c.name == name for name, c in out.items())
    return out


def check_orchestrator(c: model_config_pb2.ModelConfig, params: dict[str, str]) -> None:
    assert c.backend == "python" and c.max_batch_size == 0
    assert c.model_transaction_policy.decoupled
    assert [(i.name, model_config_pb2.DataType.Name(i.data_type), list(i.dims), i.optional) for i in c.input] == [
        (s.name, s.triton_type, list(s.dims), s.optional) for s in INPUTS]
    assert [(o.name, model_config_pb2.DataType.Name(o.data_type), list(o.dims)) for o in c.output] == [
        (s.name, s.triton_type, list(s.dims)) for s in OUTPUTS]
    assert [(g.kind, g.count) for g in c.instance_group] == [(model_config_pb2.ModelInstanceGroup.KIND_CPU, 1)]
    assert {k: v.string_value for k, v in c.parameters.items()} == params


def check_files(version_dir: Path, bundle: Path, rels: list[str], placed=lambda rel: f"bundle/{rel}") -> None:
    """The bundle files `rels` are in version_dir (at `placed(rel)`) with their manifest sha256."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    for rel in rels:
        assert sha256_of(version_dir / placed(rel)) == manifest["files"][rel]["sha256"], rel


def test_in_process_layout(bundles, tmp_path):
    repo = tmp_path / "repo"
    plans = write_repository(bundles["draft"], repo, name="spec")
    assert [p.name for p in plans] == ["spec"]
    check_orchestrator(configs(repo)["spec"], {"bundle": "bundle", "speculative": "true", "k": "3",
                                               "default_max_tokens": "64", "verify_bundle": "true",
                                               "bundle_id": open_bundle(bundles["draft"]).id, "trust_code": "false"})
    version = repo / "spec" / "1"
    assert "from specc.triton.serving import InProcessModel as TritonPythonModel" in (version / "model.py").read_text()
    manifest = json.loads((bundles["draft"] / "manifest.json").read_text())
    check_files(version, bundles["draft"], list(manifest["files"]))
    assert not list(tmp_path.glob(".repo.partial-*"))


def test_split_layout_native_engines(bundles, tmp_path):
    repo = tmp_path / "repo"
    write_repository(bundles["draft"], repo, name="spec", layout="split")
    found = configs(repo)
    assert list(found) == ["spec", "spec_draft", "spec_target"]
    check_orchestrator(found["spec"], {"bundle": "bundle", "speculative": "true", "k": "3", "default_max_tokens": "64",
                                       "target_model": "spec_target", "draft_model": "spec_draft",
                                       "target_cache_by_layer": "3", "draft_cache_by_layer": "2",
                                       "bundle_id": open_bundle(bundles["draft"]).id, "trust_code": "false"})
    manifest = json.loads((bundles["draft"] / "manifest.json").read_text())
    tokenizer = [rel for rel in manifest["files"] if rel.startswith("tokenizer/")]
    check_files(repo / "spec" / "1", bundles["draft"], tokenizer)
    assert sorted(p.name for p in (repo / "spec" / "1" / "bundle").iterdir()) == ["manifest.json", "tokenizer"]
    for role in ("target", "draft"):
        c, entry = found[f"spec_{role}"], manifest["graphs"][role]
        assert c.platform == "onnxruntime_onnx" and c.default_model_filename == "model.onnx" and c.max_batch_size == 0
        assert not c.HasField("model_transaction_policy")
        L, H, D, V = (entry["model"][k] for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size"))
        # the engine takes its cache one input per layer (onnx_passes/feed_cache_by_layer.py)
        assert [i.name for i in c.input] == ["input_ids", "position_ids", "cache_len", "logit_index",
                                             *[f"k_cache.{n}" for n in range(L)], *[f"v_cache.{n}" for n in range(L)]]
        assert list(c.input[4].dims) == [-1, H, -1, D] and c.input[4].data_type == model_config_pb2.TYPE_FP32
        assert [(o.name, list(o.dims)) for o in c.output] == [
            ("logits", [-1, -1, V]), ("new_k", [L, -1, H, -1, D]), ("new_v", [L, -1, H, -1, D])]
        check_files(repo / f"spec_{role}" / "1", bundles["draft"], [f"{role}/{f}" for f in entry["files"]],
                    placed=lambda rel: rel.split("/", 1)[1])
        assert not (repo / f"spec_{role}" / "1" / "model.py").exists()
        assert onnx_signature(repo / f"spec_{role}" / "1" / "model.onnx") == {
            t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in list(c.input) + list(c.output)}


def onnx_signature(path: Path) -> dict[str, tuple[str, list[int]]]:
    """What Triton's onnxruntime backend checks a config against: each graph input's and output's
    type and dims (symbolic dims as -1)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    types = {onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.FLOAT: "TYPE_FP32"}
    return {v.name: (types[v.type.tensor_type.elem_type],
                     [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim])
            for v in list(model.graph.input) + list(model.graph.output)}


def test_split_layout_python_engines_serve_any_backend(bundles, tmp_path):
    repo = tmp_path / "repo"
    write_repository(bundles["wrong"], repo, layout="split", engines="python")  # a torch bundle
    found = configs(repo)
    assert list(found) == ["wrong", "wrong_draft", "wrong_target"]
    for role in ("target", "draft"):
        c = found[f"wrong_{role}"]
        assert c.backend == "python" and not c.platform and c.parameters["role"].string_value == role
        files = sorted(p.relative_to(repo / f"wrong_{role}" / "1").as_posix()
                       for p in (repo / f"wrong_{role}" / "1").rglob("*") if p.is_file())
        assert "model.py" in files and "bundle/manifest.json" in files
        assert all(f in ("model.py", "bundle/manifest.json") or f.startswith(f"bundle/{role}/") for f in files)


def _typed(raw: dict) -> Manifest:
    """An edited manifest with its file table made to match its graphs' files (placeholder hashes)."""
    for g in raw["graphs"].values():
        raw["files"] = {rel: m for rel, m in raw["files"].items() if not rel.startswith(g["dir"] + "/")}
        raw["files"].update({f"{g['dir']}/{f}": {"sha256": "0" * 64, "bytes": 1} for f in g["files"]})
    return Manifest.from_dict(raw)


def test_engine_configs_for_tensorrt_and_quantized_onnx(bundles):
    """Config generation for engines this machine cannot build (TensorRT plans, fp16) from edited manifests."""
    manifest = json.loads((bundles["draft"] / "manifest.json").read_text())
    trt = copy.deepcopy(manifest)
    trt["backend"] = trt["recipe"]["backend"] = "tensorrt"
    trt["recipe"]["device"] = "cuda"
    entry = trt["graphs"]["target"]
    entry.update(entry="model.plan", files=["model.plan"])
    for tensor in entry["inputs"]:
        if tensor["name"].endswith("_cache"):
            tensor["dtype"] = "float16"
    c = text_format.Parse(to_pbtxt(engine_config("t", _typed(trt), "target", "native")), Config())
    assert c.platform == "tensorrt_plan" and c.default_model_filename == "model.plan"
    assert c.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    types = {t.name: model_config_pb2.DataType.Name(t.data_type) for t in list(c.input) + list(c.output)}
    assert types["k_cache"] == types["new_k"] == "TYPE_FP16" and types["logits"] == "TYPE_FP32"
    quantized = copy.deepcopy(manifest)
    quantized["graphs"]["draft"]["entry"] = "model.int8.onnx"
    quantized["graphs"]["draft"]["files"] = ["model.int8.onnx"]
    c = text_format.Parse(to_pbtxt(engine_config("d", _typed(quantized), "draft", "native")), Config())
    assert c.platform == "onnxruntime_onnx" and c.default_model_filename == "model.int8.onnx"


def test_pbtxt_strings_round_trip():
    tricky = 'a "quoted"\\ line\nnext: ünïcode'
    text = to_pbtxt({"name": tricky, "parameters": [{"key": "k", "value": {"string_value": tricky}}],
                     "input": [{"name": "x", "data_type": Enum("TYPE_FP32"), "dims": [-1, 3]}]}, header="two\nlines")
    c = text_format.Parse(text, Config())
    assert c.name == tricky and c.parameters["k"].string_value == tricky and list(c.input[0].dims) == [-1, 3]


def test_docs_list_the_inputs_and_outputs():
    doc = (ROOT / "docs" / "triton.md").read_text()
    assert markdown_table(INPUTS) in doc and markdown_table(OUTPUTS) in doc


def test_cli_writes_and_protects_repositories(bundles, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main(["triton", str(bundles["draft"]), "--repo", str(repo), "--name", "spec", "--max-new-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "spec " in out and "tritonserver --model-repository" in out
    assert configs(repo)["spec"].parameters["default_max_tokens"].string_value == "32"

    assert main(["triton", str(bundles["draft"]), "--repo", str(repo)]) == 2
    assert "exists and is not empty; pass --force" in capsys.readouterr().err

    (repo / "other").mkdir()  # somebody else's model survives --force
    (repo / "spec" / "1" / "stale.txt").write_text("old")
    assert main(["triton", str(bundles["draft"]), "--repo", str(repo), "--name", "spec", "--layout", "split", "--force"]) == 0
    assert sorted(p.name for p in repo.iterdir()) == ["other", "spec", "spec_draft", "spec_target"]
    assert not (repo / "spec" / "1" / "stale.txt").exists()


@pytest.mark.parametrize("args, message", [
    (["{missing}", "--repo", "{repo}"], "does not exist; build one with `specc compile RECIPE`"),
    (["{torch}", "--repo", "{repo}", "--layout", "split"], "Triton has no platform for 'torch' engines"),
    (["{ort}", "--repo", "{repo}", "--name", "bad name"], "model name 'bad name'"),
    (["{ort}", "--repo", "{file}"], "exists and is not a directory"),
])
def test_cli_errors(bundles, tmp_path, capsys, args, message):
    (tmp_path / "file").write_text("x")
    paths = {"missing": tmp_path / "nope", "torch": bundles["wrong"], "ort": bundles["draft"], "repo": tmp_path / "repo",
             "file": tmp_path / "file"}
    assert main(["triton"] + [a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specc: error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "repo").exists()


def test_tampered_bundle_is_refused(bundles, tmp_path):
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(bundles["draft"], bundle)
    with open(bundle / "target" / "model.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(BundleError, match="failed verification"):
        write_repository(bundle, tmp_path / "repo")
