"""specc's TensorRT glue without TensorRT: errors when it is missing, and the lowering code
driven against a *recording fake* of the TensorRT Python API.

The fake only records what specc asks for (profiles, flags, workspace) and returns bytes; it
proves nothing about real TensorRT. The real build and run are tested in
tests/test_gpu_backends.py, behind the `gpu` marker.
"""
from __future__ import annotations

import dataclasses
import sys
import types

import onnx
import pytest
import torch
from transformers import AutoModelForCausalLM

from specc.backends import LowerOptions, gpu, tensorrt_backend, torch_tensorrt_backend
from specc.backends.tensorrt_backend import PLAN, TIMING_CACHE, TensorRTBuildError
from specc.capture.shapes import dim_ranges
from specc.capture.graph import capture
from specc.cli import main
from specc.compiler import compile_recipe, shape_plan
from specc.errors import BackendUnavailableError, BundleError
from specc.passes.base import GraphPass
from specc.recipe import TensorRTSpec, parse_recipe
from specc.testing import make_tiny_model

FAKE_GPU = {"gpu": "Fake GPU", "compute_capability": "9.0"}


class FakeTensorRT(types.ModuleType):
    """Records the calls specc makes; the parser rejects the first ONNX node for which `fail_node(node)` holds."""

    def __init__(self, version="10.1.0", fail_node=None):
        super().__init__("tensorrt")
        self.__version__, self.fail_node, self.calls = version, fail_node, []
        fake = self

        class ILogger:
            class Severity:
                INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

            def __init__(self):
                pass

        class Network:
            def __init__(self):
                self.inputs = []

            @property
            def num_inputs(self):
                return len(self.inputs)

            def get_input(self, i):
                return types.SimpleNamespace(name=self.inputs[i])

        class ParserError:
            def __init__(self, name):
                self.name = name

            def node_name(self):
                return self.name

            def node(self):
                return -1

            def code(self):
                return "UNSUPPORTED_NODE"

            def desc(self):
                return "fake parser failure"

        class OnnxParser:
            def __init__(self, network, logger):
                self.network, self.errors = network, []

            def parse_from_file(self, path):
                model = onnx.load(path, load_external_data=False)
                self.network.inputs = [i.name for i in model.graph.input]
                failing = [n.name for n in model.graph.node if fake.fail_node and fake.fail_node(n)]
                self.errors = [ParserError(failing[0])] if failing else []
                return not self.errors

            @property
            def num_errors(self):
                return len(self.errors)

            def get_error(self, i):
                return self.errors[i]

        class Profile:
            def __init__(self):
                self.shapes = {}

            def set_shape(self, name, lo, opt, hi):
                self.shapes[name] = (lo, opt, hi)

        class Config:
            def __init__(self):
                self.flags, self.profiles, self.builder_optimization_level = set(["TF32"]), [], None

            def set_memory_pool_limit(self, pool, size):
                fake.calls.append(("workspace", pool, size))

            def set_flag(self, flag):
                self.flags.add(flag)

            def clear_flag(self, flag):
                self.flags.discard(flag)

            def create_timing_cache(self, data):
                fake.calls.append(("timing cache in", bytes(data)))
                return data

            def set_timing_cache(self, cache, ignore_mismatch):
                pass

            def get_timing_cache(self):
                return types.SimpleNamespace(serialize=lambda: b"TIMING")

            def add_optimization_profile(self, profile):
                self.profiles.append(profile)

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                return Network()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                fake.calls.append(("build", config))
                return b"PLAN"

        class Runtime:
            def __init__(self, logger):
                self.logger = logger

            def deserialize_cuda_engine(self, data):
                self.logger.log(ILogger.Severity.ERROR, "The engine plan file is not compatible with this version of TensorRT")
                return None

        self.ILogger, self.OnnxParser, self.Builder, self.Runtime = ILogger, OnnxParser, Builder, Runtime
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
        self.BuilderFlag = types.SimpleNamespace(FP16="FP16", BF16="BF16", TF32="TF32")

    def built_config(self):
        return next(c[1] for c in self.calls if c[0] == "build")


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a GPU exists, for code paths that only record its facts."""
    for module in (gpu, tensorrt_backend):
        monkeypatch.setattr(module, "cuda_device", lambda backend, device="cuda": torch.device("cpu"), raising=False)
        monkeypatch.setattr(module, "device_facts", lambda dev: dict(FAKE_GPU))


def install(monkeypatch, fake):
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    return fake


@pytest.fixture(scope="module")
def recipe():
    return parse_recipe({"target": {"model": "m"}, "draft": {"method": "none"}, "backend": "tensorrt", "device": "cuda",
                         "precision": "fp16", "speculation": {"k": 3}, "limits": {"max_batch": 4, "max_context": 256},
                         "tensorrt": {"workspace_mb": 512, "optimization_level": 2, "cuda_graphs": True}})


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("m") / "llama")).eval()


def _lower(graph, recipe, out, previous=None):
    options = LowerOptions(recipe.precision, "cuda", tensorrt=recipe.tensorrt, shapes=shape_plan(recipe, "target", graph),
                           previous_dir=previous)
    out.mkdir(parents=True, exist_ok=True)
    return options, tensorrt_backend.BACKEND.lower(graph.export(), out, [i.name for i in graph.inputs], graph.outputs, options)


# -- without TensorRT ----------------------------------------------------------------------

def test_missing_tensorrt_fails_at_once_with_how_to_get_it(models_dir, tmp_path, capsys):
    recipe = parse_recipe({"target": {"model": str(models_dir / "target")}, "draft": {"method": "none"},
                           "backend": "tensorrt", "device": "cuda"})
    with pytest.raises(BackendUnavailableError, match="tensorrt package is not installed.*pip install tensorrt"):
        compile_recipe(recipe, output=tmp_path / "b", progress=False)
    assert not (tmp_path / "b").exists() and list(tmp_path.iterdir()) == []
    (tmp_path / "r.yaml").write_text(f"target: {{model: {models_dir / 'target'}}}\ndraft: {{method: none}}\n"
                                     "backend: torch_tensorrt\ndevice: cuda\n")
    assert main(["compile", str(tmp_path / "r.yaml"), "-q"]) == 2
    assert "torch_tensorrt package is not installed" in capsys.readouterr().err


def test_doctor_reports_gpu_backends(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for name in ("tensorrt", "torch_tensorrt", "aoti"):
        assert f"| {name} " in out
    assert "tensorrt package is not installed" in out or "tensorrt 1" in out


def test_gpu_backends_need_cuda_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(BackendUnavailableError, match="needs an NVIDIA GPU: torch sees no CUDA device"):
        gpu.cuda_device("aoti")


# -- against the recording fake ---------------------------------------------------------------

def test_lowering_records_profiles_precision_and_versions(monkeypatch, fake_gpu, recipe, hf_model, tmp_path):
    fake = install(monkeypatch, FakeTensorRT())
    graph = capture("target", hf_model, dim_ranges(4, 256))
    options, entry = _lower(graph, recipe, tmp_path / "target")
    assert sorted(p.name for p in (tmp_path / "target").iterdir()) == [PLAN, TIMING_CACHE]  # the ONNX is gone
    assert (tmp_path / "target" / PLAN).read_bytes() == b"PLAN"
    assert entry["versions"] == {"tensorrt": "10.1.0", **FAKE_GPU} and entry["compute_capability"] == "9.0"
    assert [p["name"] for p in entry["profiles"]] == ["step", "prefill"]
    assert entry["profiles"][0]["dims"]["tokens"] == [1, 4, 4] and entry["cuda_graphs"] is True
    assert entry["op_coverage"]["unsupported"] == [] and entry["opset"] == tensorrt_backend.OPSET

    config = fake.built_config()
    assert config.flags == {"FP16", "TF32"} and config.builder_optimization_level == 2
    assert ("workspace", "WORKSPACE", 512 << 20) in fake.calls
    assert len(config.profiles) == 2
    for trt_profile, profile in zip(config.profiles, options.shapes.profiles):
        assert set(trt_profile.shapes) == {i.name for i in graph.inputs}
        for spec in options.shapes.inputs:
            assert trt_profile.shapes[spec["name"]] == profile.input_shapes(spec["shape"])
    assert config.profiles[0].shapes["input_ids"] == ((1, 1), (4, 4), (4, 4))
    assert config.profiles[1].shapes["k_cache"][2] == (2, 4, 2, 256, 16)  # [L, B, H_kv, S, D] at max

    from specc.cli.format import fact_lines

    text = "\n".join(fact_lines(entry))  # what `specc inspect` prints for this graph's backend facts
    assert "profile   step: batch 1..4 (opt 4), cache 1..256 (opt 128), tokens 1..4 (opt 4)" in text
    assert "gpu       Fake GPU (compute capability 9.0), precision fp16" in text
    assert "checked against TensorRT 10.1's operator table: 0 unsupported" in text

    # a second compile to the same output starts from the bundle's timing cache; fp32 turns TF32 off
    fake.calls.clear()
    _lower(graph, dataclasses.replace(recipe, precision="fp32"), tmp_path / "again", previous=tmp_path / "target")
    assert ("timing cache in", b"TIMING") in fake.calls
    assert fake.built_config().flags == set()


class AddOne(GraphPass):
    """Adds 1 to the logits (only for this test)."""

    name = "add_one"

    def apply(self, graph) -> str:
        logits, *rest = graph.output_nodes()
        (out,) = graph.gm.graph.find_nodes(op="output")
        with graph.gm.graph.inserting_before(out):
            logits = graph.gm.graph.call_function(torch.ops.aten.add.Tensor, (logits, 1.0))
        graph.set_outputs(graph.outputs, [logits, *rest])
        return "logits + 1"


def test_parser_errors_name_the_node_and_its_pass(monkeypatch, fake_gpu, recipe, hf_model, tmp_path):
    graph = capture("target", hf_model, dim_ranges(4, 256))
    AddOne()(graph)
    made_by_pass = lambda node: any(p.key == "specc.pass" for p in node.metadata_props)
    install(monkeypatch, FakeTensorRT(fail_node=made_by_pass))
    with pytest.raises(TensorRTBuildError, match=r"rejected target/model.onnx:\n  node '\w+' \(Add\) from pass add_one: "
                                                 r"UNSUPPORTED_NODE: fake parser failure"):
        _lower(graph, recipe, tmp_path / "target")


def test_other_tensorrt_release_is_named_with_ours(monkeypatch, fake_gpu):
    install(monkeypatch, FakeTensorRT(version="10.3.0"))
    with pytest.raises(BundleError, match=r"built with TensorRT 10\.1\.0; this machine has TensorRT 10\.3\.0"):
        tensorrt_backend.BACKEND.check_versions({"tensorrt": "10.1.0", **FAKE_GPU})
    tensorrt_backend.BACKEND.check_versions({"tensorrt": "10.3.0.26", **FAKE_GPU})  # same release, other build


def test_other_gpu_is_named_with_ours(monkeypatch, fake_gpu):
    install(monkeypatch, FakeTensorRT())
    recorded = {"tensorrt": "10.1.0", "gpu": "NVIDIA A100", "compute_capability": "8.0"}
    with pytest.raises(BundleError, match=r"compute capability 8\.0 \(NVIDIA A100\).*Fake GPU with compute capability 9\.0"):
        tensorrt_backend.BACKEND.check_versions(recorded)


def test_undeserialisable_plan_names_both_versions(monkeypatch, fake_gpu, tmp_path):
    install(monkeypatch, FakeTensorRT(version="10.3.0"))
    (tmp_path / PLAN).write_bytes(b"PLAN")
    entry = {"entry": PLAN, "versions": {"tensorrt": "10.1.0"}, **FAKE_GPU}
    with pytest.raises(BundleError, match=r"TensorRT 10\.3\.0 could not load .*built with TensorRT 10\.1\.0.*not compatible"):
        tensorrt_backend.BACKEND.load(tmp_path, entry, LowerOptions(device="cuda"))


# -- Torch-TensorRT: argument choice and fallback report ---------------------------------------

V212 = {"min_block_size", "workspace_size", "optimization_level", "truncate_double", "disable_tf32", "attn_bias_is_causal",
        "enabled_precisions", "enable_autocast", "autocast_low_precision_type"}
V213 = V212 - {"enabled_precisions"}


@pytest.mark.parametrize("params, precision, expected", [
    (V212, "fp16", {"enabled_precisions": {torch.float32, torch.float16}}),
    (V213, "fp16", {"enable_autocast": True, "autocast_low_precision_type": torch.float16}),
    (V213, "bf16", {"enable_autocast": True, "autocast_low_precision_type": torch.bfloat16}),
    (V213, "fp32", {"disable_tf32": True}),
])
def test_torch_tensorrt_compile_arguments(params, precision, expected):
    kwargs = torch_tensorrt_backend.compile_kwargs(params,
                                                   LowerOptions(precision, "cuda", tensorrt=TensorRTSpec(min_block_size=3)), "x")
    assert kwargs["attn_bias_is_causal"] is False and kwargs["min_block_size"] == 3
    assert expected.items() <= kwargs.items()
    assert set(kwargs) <= params


def test_torch_tensorrt_without_precision_api_says_so():
    with pytest.raises(BackendUnavailableError, match="cannot ask it for fp16"):
        torch_tensorrt_backend.compile_kwargs({"min_block_size"}, LowerOptions("fp16", "cuda"), "9.9")


def test_fallback_report_counts_ops_left_to_torch():
    acc, fallback, top = torch.fx.Graph(), torch.fx.Graph(), torch.fx.Graph()
    x = fallback.placeholder("x")
    fallback.output(fallback.call_function(torch.ops.aten.cumsum.default,
                                           (fallback.call_function(torch.ops.aten.abs.default, (x,)), 0)))
    acc.output(acc.placeholder("x"))
    x = top.placeholder("x")
    y = top.call_module("_run_on_acc_0", (x,))
    top.output(top.call_module("_run_on_gpu_1", (top.call_function(torch.ops.aten.neg.default, (y,)),)))
    root = torch.nn.Module()
    root._run_on_acc_0 = torch.fx.GraphModule(torch.nn.Module(), acc)
    root._run_on_gpu_1 = torch.fx.GraphModule(torch.nn.Module(), fallback)
    report = torch_tensorrt_backend.fallback_report(torch.fx.GraphModule(root, top))
    assert report == {"tensorrt_engines": 1, "torch_fallback_nodes": 3,
                      "torch_fallback_ops": {"aten.abs.default": 1, "aten.cumsum.default": 1, "aten.neg.default": 1}}



# -- the runner's bookkeeping, against a fake engine ------------------------------------------

class FakeContext:
    def __init__(self, dims):
        self.dims, self.shapes, self.addresses, self.log = dims, {}, {}, []

    def set_optimization_profile_async(self, index, stream):
        self.log.append(("profile", index))

    def set_input_shape(self, name, shape):
        self.shapes[name] = shape

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr

    def get_tensor_shape(self, name):
        b, t = self.shapes["input_ids"]
        r = self.shapes["logit_index"][1]
        d = self.dims
        return (b, r, d.vocab_size) if name == "logits" else (d.n_layers, b, d.n_kv_heads, t, d.head_dim)

    def execute_async_v3(self, stream):
        self.log.append(("execute", dict(self.shapes)))
        return True


def test_runner_selects_profiles_and_binds_tensors_in_place(monkeypatch, recipe, hf_model):
    from specc.backends.profiles import Profile
    from specc.backends.trt_runner import TrtRunner
    from specc.capture.shapes import example_inputs

    fake = FakeTensorRT()
    fake.DataType = types.SimpleNamespace(FLOAT="f32", HALF="f16", INT32="i32", INT64="i64", BOOL="b", INT8="i8",
                                          UINT8="u8", BF16="bf16")
    graph = capture("target", hf_model, dim_ranges(4, 256))
    plan = shape_plan(recipe, "target", graph)
    contexts = []
    engine = types.SimpleNamespace(
        num_optimization_profiles=2,
        get_tensor_dtype=lambda name: "i64" if name in ("input_ids", "position_ids", "cache_len", "logit_index") else "f32",
        create_execution_context=lambda *strategy: contexts.append(FakeContext(graph.dims)) or contexts[-1])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    profiles = [Profile.from_dict(p.to_dict()) for p in plan.profiles]
    runner = TrtRunner(fake, engine, plan.inputs, graph.outputs, profiles, torch.device("cpu"))

    verify = example_inputs(graph.dims, torch.float32, batch=2, tokens=4, cache=64)
    args = [verify[i.name] for i in graph.inputs]
    args[3] = torch.arange(4).expand(2, -1)  # a view, as the runtime passes it
    logits, new_k, new_v = runner(*args)
    ctx = contexts[0]
    assert ctx.log[0] == ("profile", 0) and ctx.log[-1][0] == "execute"
    assert ctx.shapes["k_cache"] == (2, 2, 2, 64, 16) and ctx.addresses["k_cache"] == args[4].data_ptr()  # no copy
    assert ctx.addresses["logits"] == logits.data_ptr() and logits.shape == (2, 4, graph.dims.vocab_size)
    assert new_k.shape == (2, 2, 2, 4, 16) and logits.dtype == torch.float32

    prompt = example_inputs(graph.dims, torch.float32, batch=2, tokens=40, cache=64)
    runner(*[prompt[i.name] for i in graph.inputs])
    assert ("profile", 1) in ctx.log  # 40 tokens only fit the prefill profile
    with pytest.raises(Exception, match="no engine profile holds"):
        too_many = example_inputs(graph.dims, torch.float32, batch=5, tokens=1, cache=64)
        runner(*[too_many[i.name] for i in graph.inputs])
