"""`tensorrt`: ONNX → TensorRT engines (`.plan`) built with the TensorRT Python API; NVIDIA GPUs.

Lowering one graph:

1. ONNX export at OPSET 18, inside TensorRT 10's parser range (9..20). Below opset 23 the
   exporter writes attention and RMSNorm as MatMul/Softmax/ReduceMean/... nodes, which every
   TensorRT 10 parses (opset 23's Attention, RMSNormalization and RotaryEmbedding are not in
   TensorRT 10.1's table).
2. The op-coverage check (trt_coverage.py) against TensorRT's supported-operator table: a
   graph TensorRT cannot parse fails here, naming the node and the pass that produced it.
3. `OnnxParser`; every parser error is reported with its node and that node's origin.
4. A builder config with the recipe's precision (fp16/bf16 flags; fp32 with TF32 off, so
   the engine passes specc's 1e-4 numerics check), the workspace limit, the builder
   optimisation level, a timing cache (saved in the bundle and reused by the next compile
   to the same output), and one optimization profile per `ShapePlan` profile (profiles.py).

The bundle records the TensorRT version, the GPU and its compute capability, and the
profile ranges; a plan only loads in the TensorRT release and on the compute capability
that built it, and loading elsewhere fails naming both. TensorRT is imported lazily: this
module imports on any machine.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.export import ExportedProgram

from ..errors import BackendUnavailableError, BundleError, SpeccError
from ..onnx_passes import run_onnx_passes, tensorrt_target_pipeline
from .base import LowerOptions
from .gpu import check_same_gpu, cuda_device, device_facts
from .onnx_export import export_onnx
from .profiles import Profile
from .trt_coverage import check_onnx, origin

OPSET = 18
ONNX_FILE = "model.onnx"  # intermediate: removed once the engine is built
PLAN = "model.plan"
TIMING_CACHE = "timing.cache"
PRECISION_FLAGS = {"fp32": (), "fp16": ("FP16",), "bf16": ("BF16",)}

log = logging.getLogger("specc.tensorrt")


class TensorRTBuildError(SpeccError):
    """TensorRT's parser or builder rejected a graph."""


MISSING = ("the tensorrt package is not installed (on a machine with an NVIDIA GPU: pip install tensorrt; "
           "or use backend aoti, torch or onnxruntime)")


def import_tensorrt():
    """The tensorrt module, or BackendUnavailableError saying how to get it."""
    try:
        import tensorrt
    except ImportError:
        raise BackendUnavailableError(f"backend 'tensorrt' cannot run here: {MISSING}") from None
    return tensorrt


def release(version: str) -> tuple[int, ...]:
    """major.minor.patch of a TensorRT version string: plans load only in the same release."""
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:3])


def check_tensorrt_release(recorded: dict, installed: str) -> None:
    """BundleError naming both versions when engines come from another TensorRT release."""
    built = recorded.get("tensorrt")
    if built and release(built) != release(installed):
        raise BundleError(
            f"the bundle's TensorRT engines were built with TensorRT {built}; this machine has TensorRT {installed}. "
            f"A TensorRT plan loads only in the release that built it: install tensorrt=={built} "
            "or compile the recipe again here"
        )


def make_logger(trt):
    """A TensorRT logger that keeps errors (for the exception message) and forwards the rest to logging."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
                log.error(msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.warning(msg)
            else:
                log.debug(msg)

    return Logger()


class TensorRTBackend:
    name = "tensorrt"
    runs_bundle_code = None  # plans hold GPU kernels; host code in a plan (lean runtime, plugins) stays disallowed

    def availability(self) -> tuple[bool, str]:
        try:
            import tensorrt as trt
        except ImportError:
            return False, MISSING
        if not torch.cuda.is_available():
            return False, f"tensorrt {trt.__version__} is installed, but torch sees no CUDA device"
        facts = device_facts(torch.device("cuda"))
        return True, f"tensorrt {trt.__version__}, {facts['gpu']} (compute capability {facts['compute_capability']})"

    def check_versions(self, recorded: dict) -> None:
        check_tensorrt_release(recorded, import_tensorrt().__version__)
        check_same_gpu(recorded, cuda_device(self.name), "the bundle's TensorRT engines")

    def lower(self, program: ExportedProgram, out_dir: Path, input_names, output_names, options: LowerOptions) -> dict:
        trt = import_tensorrt()
        dev = cuda_device(self.name, options.device)
        if options.shapes is None:
            raise ValueError("the tensorrt backend needs LowerOptions.shapes (the compiler plans them)")
        onnx_path = out_dir / ONNX_FILE
        export_onnx(program, onnx_path, input_names, output_names, OPSET)
        weight_only = _weight_only(onnx_path, options) if options.weight_quant is not None else None
        coverage = check_onnx(onnx_path, source=f"the {out_dir.name} graph (ONNX opset {OPSET})")
        coverage.raise_if_unsupported()
        previous = options.previous_dir / TIMING_CACHE if options.previous_dir else None
        timing = previous.read_bytes() if previous and previous.is_file() else b""
        plan, timing = build_engine(trt, onnx_path, options, timing)
        for path in out_dir.iterdir():  # the ONNX files were only the parser's input
            path.unlink()
        (out_dir / PLAN).write_bytes(plan)
        (out_dir / TIMING_CACHE).write_bytes(timing)
        facts = device_facts(dev)
        return {
            "entry": PLAN, "files": [PLAN, TIMING_CACHE],
            "versions": {"tensorrt": trt.__version__, **facts}, **facts,
            "opset": OPSET, "precision": options.precision,
            "profiles": [p.to_dict() for p in options.shapes.profiles],
            "workspace_mb": options.tensorrt.workspace_mb, "optimization_level": options.tensorrt.optimization_level,
            "cuda_graphs": options.tensorrt.cuda_graphs, "timing_cache_reused": bool(previous and previous.is_file()),
            "op_coverage": coverage.summary(),
            **({"weight_only": weight_only} if weight_only else {}),
        }

    def load(self, graph_dir: Path, entry: dict, options: LowerOptions):
        from .trt_runner import TrtRunner

        trt = import_tensorrt()
        dev = cuda_device(self.name, options.device)
        where = f"TensorRT engine {graph_dir.name}/{entry['entry']}"
        check_same_gpu(entry, dev, where)
        logger = make_logger(trt)
        runtime = trt.Runtime(logger)
        if hasattr(runtime, "engine_host_code_allowed"):
            runtime.engine_host_code_allowed = False  # TensorRT's default, kept explicit: no host code from a plan
        engine = runtime.deserialize_cuda_engine((graph_dir / entry["entry"]).read_bytes())  # on the current device
        if engine is None:
            built = entry.get("versions", {}).get("tensorrt", "an unknown version")
            raise BundleError(f"TensorRT {trt.__version__} could not load {where} (built with TensorRT {built} for "
                              f"{entry.get('gpu', 'an unknown GPU')}): {' '.join(logger.errors) or 'no reason given'}")
        profiles = [Profile.from_dict(p) for p in entry["profiles"]]
        return TrtRunner(trt, engine, entry["inputs"], list(entry["outputs"]), profiles, dev,
                         cuda_graphs=bool(entry.get("cuda_graphs")), keepalive=(runtime, logger))


def _weight_only(onnx_path: Path, options: LowerOptions) -> dict:
    """target.quantize on TensorRT: rewrite the exported ONNX in place into DequantizeLinear → MatMul form
    (`tensorrt_target_pipeline`, specc/onnx_passes)."""
    import onnx

    model = onnx.load(str(onnx_path))
    summary = run_onnx_passes(model, tensorrt_target_pipeline(options.weight_quant))
    for path in onnx_path.parent.iterdir():
        path.unlink()
    onnx.save(model, str(onnx_path), save_as_external_data=True, location=onnx_path.name + ".data")
    return summary


def build_engine(trt, onnx_path: Path, options: LowerOptions, timing_cache: bytes) -> tuple[bytes, bytes]:
    """Parse the ONNX file and build a serialized engine; returns (plan, timing cache)."""
    logger = make_logger(trt)
    builder = trt.Builder(logger)
    # explicit batch is the only mode in TensorRT 10; weight-only DequantizeLinear graphs build strongly typed
    # (TensorRT keeps the graph's INT4/INT8/FP8 weights and float compute types instead of choosing its own)
    strongly_typed = options.weight_quant is not None
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise TensorRTBuildError(f"TensorRT's ONNX parser rejected {onnx_path.parent.name}/{onnx_path.name}:",
                                 details=parser_errors(parser, onnx_path))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.tensorrt.workspace_mb << 20)
    config.builder_optimization_level = options.tensorrt.optimization_level
    for flag in () if strongly_typed else PRECISION_FLAGS[options.precision]:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if options.precision == "fp32":
        config.clear_flag(trt.BuilderFlag.TF32)
    config.set_timing_cache(config.create_timing_cache(timing_cache), False)
    signatures = {i["name"]: i for i in options.shapes.inputs}
    for profile in options.shapes.profiles:
        trt_profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            name = network.get_input(i).name
            if name not in signatures:
                raise TensorRTBuildError(f"the ONNX graph has an input {name!r} the step graph does not declare "
                                         f"(declared: {', '.join(signatures)})")
            trt_profile.set_shape(name, *profile.input_shapes(signatures[name]["shape"]))
        config.add_optimization_profile(trt_profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TensorRTBuildError(f"TensorRT could not build an engine from {onnx_path.parent.name}/{onnx_path.name}: "
                                 + (" ".join(logger.errors) or "the builder gave no reason"))
    return bytes(plan), bytes(config.get_timing_cache().serialize())


def parser_errors(parser, onnx_path: Path) -> list[str]:
    """Every error of a failed parse, one line each, with its node and where that node came from."""
    import onnx

    nodes = list(onnx.load(str(onnx_path), load_external_data=False).graph.node)
    by_name = {n.name: n for n in nodes}
    lines = []
    for i in range(parser.num_errors):
        err = parser.get_error(i)
        name = err.node_name() if hasattr(err, "node_name") else ""
        node = by_name.get(name) or (nodes[err.node()] if 0 <= err.node() < len(nodes) else None)
        where = f"node {node.name!r} ({node.op_type}) from {origin(node)}" if node is not None else "the graph"
        lines.append(f"{where}: {err.code()}: {err.desc()}")
    return lines


BACKEND = TensorRTBackend()
