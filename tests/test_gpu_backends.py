"""GPU backends on a real NVIDIA GPU: numerics against eager torch and ONNX Runtime, CUDA
graphs, fp16, greedy and sampling losslessness, and refusing bundles from another TensorRT.

Marked `gpu` and deselected by default: run with `pytest -m gpu` (or scripts/gpu_check.sh).
Each test skips, naming the reason, when its backend cannot run on the machine. These tests
have never run: specc's machines have no GPU and cannot install TensorRT (docs/backends.md).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import specc
from lossless_checks import (assert_greedy_lossless, assert_sampling_lossless, assert_target_only_is_hf_greedy,
                             small_vocab_bundle, token_prompts)
from specc.backends import LowerOptions, get_backend
from specc.capture.shapes import dim_ranges, example_inputs
from specc.capture.graph import capture
from specc.compiler import shape_plan
from specc.errors import BundleError
from specc.recipe import parse_recipe
from specc.speculation.sampling import SamplingParams
from specc.testing import make_tiny_model

pytestmark = pytest.mark.gpu

GPU_BACKENDS = ["aoti", "tensorrt", "torch_tensorrt"]
# batch, tokens, cache slots: decode and verify (the `step` profile) and prompts (`prefill`)
SHAPES = [(1, 1, 1), (1, 5, 7), (3, 1, 64), (3, 4, 9), (2, 40, 64), (4, 128, 128)]


def need(backend: str) -> None:
    ok, detail = get_backend(backend, check=False).availability()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not ok:
        pytest.skip(f"{backend}: {detail}")


def recipe(backend: str, precision: str = "fp32", cuda_graphs: bool = False):
    return parse_recipe({"target": {"model": "m"}, "draft": {"method": "none"}, "backend": backend, "device": "cuda",
                         "precision": precision, "speculation": {"k": 3}, "limits": {"max_batch": 4, "max_context": 128},
                         "tensorrt": {"cuda_graphs": cuda_graphs, "workspace_mb": 1024}})


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "qwen", arch="qwen2")


@pytest.fixture(scope="module")
def cuda_graph(hf_dir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval().cuda()
    return capture("target", hf, dim_ranges(4, 128))


def lowered(graph, backend: str, out, **recipe_fields):
    r = recipe(backend, **recipe_fields)
    options = LowerOptions(r.precision, "cuda", tensorrt=r.tensorrt, shapes=shape_plan(r, "target", graph))
    out.mkdir(parents=True, exist_ok=True)
    entry = get_backend(backend).lower(graph.export(), out, [i.name for i in graph.inputs], graph.outputs, options)
    entry.update(graph.signature())
    return get_backend(backend).load(out, entry, options), entry


def shape_inputs(graph, b: int, t: int, s: int, device="cuda"):
    torch.manual_seed(b * 100 + t * 10 + s)
    ex = example_inputs(graph.dims, torch.float32, batch=b, tokens=t, cache=s)
    ex["cache_len"] = torch.randint(0, s + 1, (b,))
    return [ex[i.name].to(device) for i in graph.inputs]


def max_rel_diff(ref, got) -> float:
    worst = 0.0
    for r, g in zip(ref, got):
        r, g = r.float().cpu(), g.float().cpu()
        assert r.shape == g.shape
        worst = max(worst, ((r - g).abs().max() / max(1.0, r.abs().max().item())).item())
    return worst


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_engine_matches_eager_torch(cuda_graph, backend, tmp_path):
    need(backend)
    runner, _ = lowered(cuda_graph, backend, tmp_path)
    for b, t, s in SHAPES:
        args = shape_inputs(cuda_graph, b, t, s)
        with torch.no_grad():
            ref = cuda_graph.gm(*args)
        got = runner(*args)
        assert all(g.device.type == "cuda" for g in got)
        assert max_rel_diff(ref, got) <= 1e-4, (backend, b, t, s)


def test_tensorrt_matches_onnxruntime(hf_dir, cuda_graph, tmp_path):
    need("tensorrt")
    trt_runner, _ = lowered(cuda_graph, "tensorrt", tmp_path / "trt")
    cpu_graph = capture("target", AutoModelForCausalLM.from_pretrained(hf_dir).eval(), dim_ranges(4, 128))
    ort = get_backend("onnxruntime")
    entry = ort.lower(cpu_graph.export(), tmp_path, [i.name for i in cpu_graph.inputs], cpu_graph.outputs, LowerOptions())
    entry.update(cpu_graph.signature())
    ort_runner = ort.load(tmp_path, entry, LowerOptions())
    for b, t, s in SHAPES:
        args = shape_inputs(cuda_graph, b, t, s)
        assert max_rel_diff(ort_runner(*(a.cpu() for a in args)), trt_runner(*args)) <= 1e-4, (b, t, s)


def test_tensorrt_cuda_graphs_replay_the_live_cache(cuda_graph, tmp_path):
    need("tensorrt")
    plain, _ = lowered(cuda_graph, "tensorrt", tmp_path / "plain")
    graphed, _ = lowered(cuda_graph, "tensorrt", tmp_path / "graphed", cuda_graphs=True)
    args = shape_inputs(cuda_graph, 2, 4, 64)
    for step in range(3):  # the second and third calls replay; the cache changes in place between them
        args[4].add_(0.01 * step)
        args[0].random_(0, cuda_graph.dims.vocab_size)
        assert max_rel_diff(plain(*args), graphed(*args)) == 0.0, step
    assert len(graphed.graphs) == 1
    prefill = shape_inputs(cuda_graph, 2, 40, 64)  # outside the step profile: no graph
    assert max_rel_diff(plain(*prefill), graphed(*prefill)) == 0.0 and len(graphed.graphs) == 1


@pytest.mark.parametrize("backend", ["tensorrt", "torch_tensorrt"])
def test_fp16_engine_is_within_tolerance(cuda_graph, backend, tmp_path):
    need(backend)
    runner, entry = lowered(cuda_graph, backend, tmp_path, precision="fp16")
    assert entry["precision"] == "fp16"
    for b, t, s in SHAPES:
        args = shape_inputs(cuda_graph, b, t, s)
        with torch.no_grad():
            ref = cuda_graph.gm(*args)
        assert max_rel_diff(ref, runner(*args)) <= 1e-2, (b, t, s)


@pytest.fixture(scope="module", params=GPU_BACKENDS)
def gpu_bundle(request, tmp_path_factory):
    need(request.param)
    target, bundle = small_vocab_bundle(tmp_path_factory.mktemp(request.param), request.param, device="cuda")
    return request.param, target, bundle


@pytest.mark.parametrize("batch, k", [(1, 1), (3, 2), (8, 4)])
def test_greedy_speculation_equals_target_only(gpu_bundle, batch, k):
    _, _, bundle = gpu_bundle
    assert_greedy_lossless(bundle, token_prompts(24, seed=batch), batch, k)


def test_target_only_equals_hugging_face(gpu_bundle):
    _, target, bundle = gpu_bundle
    assert_target_only_is_hf_greedy(bundle, target, token_prompts(4, seed=7))


def test_sampled_output_has_target_distribution(gpu_bundle):
    _, target, bundle = gpu_bundle
    assert_sampling_lossless(bundle, target, SamplingParams(0.8, 6, 0.9))


def test_manifest_records_engine_facts(gpu_bundle):
    backend, _, bundle = gpu_bundle
    manifest = json.loads((bundle / "manifest.json").read_text())
    target = manifest["graphs"]["target"]
    major, minor = torch.cuda.get_device_capability()
    assert target["compute_capability"] == f"{major}.{minor}"
    if backend == "tensorrt":
        import tensorrt

        assert manifest["versions"]["tensorrt"] == tensorrt.__version__
        assert [p["name"] for p in target["profiles"]] == ["step", "prefill"]
        assert target["op_coverage"]["unsupported"] == []
    if backend == "torch_tensorrt":
        assert target["fallback"]["tensorrt_engines"] >= 1


def test_bundle_from_another_tensorrt_is_refused(gpu_bundle, tmp_path):
    backend, _, bundle = gpu_bundle
    if backend != "tensorrt":
        pytest.skip("TensorRT plans only")
    import tensorrt

    copy = shutil.copytree(bundle, tmp_path / "other")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["versions"]["tensorrt"] = "9.9.9"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=rf"TensorRT 9\.9\.9; this machine has TensorRT {tensorrt.__version__}"):
        specc.load(copy, verify=False)
    manifest["versions"]["tensorrt"] = tensorrt.__version__
    manifest["versions"]["compute_capability"] = "1.0"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"compute capability 1\.0"):
        specc.load(copy, verify=False)


def test_kv_cache_stays_on_the_gpu(gpu_bundle):
    _, _, bundle = gpu_bundle
    model = specc.load(bundle)
    seen = []
    runner = model.target.step.runner
    model.target.step.runner = lambda *args: seen.append({a.device.type for a in args}) or runner(*args)
    model.generate([[1, 2, 3]], max_new_tokens=4)
    assert seen and all(devices == {"cuda"} for devices in seen)
