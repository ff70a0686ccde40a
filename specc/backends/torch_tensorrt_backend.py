"""`torch_tensorrt`: the post-pass ExportedProgram compiled by Torch-TensorRT; NVIDIA GPUs.

`torch_tensorrt.dynamo.compile` converts what it can to TensorRT engines and leaves the rest
to torch; the result is saved with `torch_tensorrt.save(..., output_format="exported_program")`
and loaded with `torch.export.load` (importing torch_tensorrt registers the engine op).

- Shapes: Torch-TensorRT takes one range per input, the union of the graph's profiles
  (profiles.py) with opt from `step`.
- Precision: Torch-TensorRT up to 2.12 takes `enabled_precisions`; 2.13 replaced it with
  `enable_autocast` + `autocast_low_precision_type`. The installed version's signature
  decides. fp32 turns TF32 off (specc's numerics check allows 1e-4).
- `attn_bias_is_causal=False`: by default Torch-TensorRT (>= 2.11) assumes an SDPA bias mask
  is causal and may replace it by `is_causal`; the step graph's mask also hides invalid cache
  slots, so that rewrite would be wrong.
- The ops left to torch (`min_block_size` from the recipe) are reported in the manifest.
"""
from __future__ import annotations

import inspect
import operator
from pathlib import Path

import torch
from torch.export import Dim, ExportedProgram

from ..errors import BackendUnavailableError
from .base import LowerOptions, require_version
from .gpu import check_same_gpu, cuda_device, device_facts
from .tensorrt_backend import check_tensorrt_release

FILE = "trt_graph.pt2"
LOW_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16}


def import_torch_tensorrt():
    """The torch_tensorrt module, or BackendUnavailableError saying why not and how to get it."""
    try:
        import torch_tensorrt
    except ImportError:
        raise BackendUnavailableError(
            "the torch_tensorrt package is not installed (on a machine with an NVIDIA GPU: pip install "
            f"torch-tensorrt matching torch {torch.__version__.split('+')[0]}; or use backend aoti, torch or onnxruntime)"
        ) from None
    except Exception as exc:  # installed but broken (for instance TensorRT's libraries missing)
        raise BackendUnavailableError(f"torch_tensorrt is installed but does not import: {exc}") from None
    return torch_tensorrt


def compile_kwargs(params: set[str], options: LowerOptions, version: str) -> dict:
    """Keyword arguments for `torch_tensorrt.dynamo.compile`, for the parameters this version has."""
    spec = options.tensorrt
    kwargs = {"min_block_size": spec.min_block_size, "workspace_size": spec.workspace_mb << 20,
              "optimization_level": spec.optimization_level, "truncate_double": True,
              "attn_bias_is_causal": False, "disable_tf32": options.precision == "fp32"}
    low = LOW_PRECISION.get(options.precision)
    if low is not None:
        if "enabled_precisions" in params:
            kwargs["enabled_precisions"] = {torch.float32, low}
        elif "enable_autocast" in params:
            kwargs.update(enable_autocast=True, autocast_low_precision_type=low)
        else:
            raise BackendUnavailableError(f"torch_tensorrt {version} has neither enabled_precisions nor enable_autocast; "
                                          f"specc cannot ask it for {options.precision}")
    return {k: v for k, v in kwargs.items() if k in params}


def fallback_report(gm: torch.fx.GraphModule) -> dict:
    """How the compiled module splits: TensorRT engines, and the ops left to torch (counted by target)."""
    engines, ops = [], {}

    def count(graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.op == "call_function" and node.target is not operator.getitem:
                ops[str(node.target)] = ops.get(str(node.target), 0) + 1

    count(gm.graph)
    for name, child in gm.named_children():
        if name.startswith("_run_on_acc"):
            engines.append(name)
        elif isinstance(child, torch.fx.GraphModule):
            count(child.graph)
    return {"tensorrt_engines": len(engines), "torch_fallback_nodes": sum(ops.values()),
            "torch_fallback_ops": dict(sorted(ops.items()))}


class TorchTensorRTBackend:
    name = "torch_tensorrt"
    runs_bundle_code = ("Torch-TensorRT programs are .pt2 archives that torch.export.load unpickles (pickles run code) "
                        "and that embed TensorRT engines")

    def availability(self) -> tuple[bool, str]:
        try:
            tt = import_torch_tensorrt()
        except BackendUnavailableError as exc:
            return False, str(exc)
        if not torch.cuda.is_available():
            return False, f"torch_tensorrt {tt.__version__} is installed, but torch sees no CUDA device"
        return True, f"torch_tensorrt {tt.__version__}, {device_facts(torch.device('cuda'))['gpu']}"

    def check_versions(self, recorded: dict) -> None:
        tt = import_torch_tensorrt()
        require_version("torch_tensorrt", recorded, tt.__version__, same_minor=True)
        import tensorrt

        check_tensorrt_release(recorded, tensorrt.__version__)
        check_same_gpu(recorded, cuda_device(self.name), "the bundle's Torch-TensorRT engines")

    def lower(self, program: ExportedProgram, out_dir: Path, input_names, output_names, options: LowerOptions) -> dict:
        tt = import_torch_tensorrt()
        import tensorrt

        dev = cuda_device(self.name, options.device)
        if options.shapes is None:
            raise ValueError("the torch_tensorrt backend needs LowerOptions.shapes (the compiler plans them)")
        plan, profile = options.shapes, options.shapes.union()
        inputs = []
        for spec in plan.inputs:
            lo, opt, hi = profile.input_shapes(spec["shape"])
            inputs.append(tt.Input(min_shape=lo, opt_shape=opt, max_shape=hi, dtype=getattr(torch, spec["dtype"]),
                                   name=spec["name"]))
        params = set(inspect.signature(tt.dynamo.compile).parameters)
        compiled = tt.dynamo.compile(program, arg_inputs=inputs, device=dev,
                                     **compile_kwargs(params, options, tt.__version__))
        examples = [torch.zeros(plan.example_shape(s["shape"]), dtype=getattr(torch, s["dtype"]), device=dev)
                    for s in plan.inputs]
        dims = {d: Dim(d, min=lo, max=hi) for d, (lo, _, hi) in profile.dims.items()}
        dynamic = tuple({a: dims[d] for a, d in enumerate(s["shape"]) if isinstance(d, str)} or None for s in plan.inputs)
        tt.save(compiled, str(out_dir / FILE), output_format="exported_program", arg_inputs=examples,
                dynamic_shapes=dynamic, retrace=True)
        facts = device_facts(dev)
        return {
            "entry": FILE, "files": [FILE],
            "versions": {"torch_tensorrt": tt.__version__, "tensorrt": tensorrt.__version__, **facts}, **facts,
            "precision": options.precision, "profile": profile.to_dict(),
            "min_block_size": options.tensorrt.min_block_size, "fallback": fallback_report(compiled),
        }

    def load(self, graph_dir: Path, entry: dict, options: LowerOptions):
        import_torch_tensorrt()  # registers the TensorRT engine op that the saved program calls
        dev = cuda_device(self.name, options.device)
        check_same_gpu(entry, dev, f"Torch-TensorRT program {graph_dir.name}/{entry['entry']}")
        module = torch.export.load(graph_dir / entry["entry"]).module()
        return TorchTensorRTRunner(module, list(entry["outputs"]), dev)


class TorchTensorRTRunner:
    def __init__(self, module: torch.nn.Module, output_names: list[str], device: torch.device):
        self.module, self.output_names, self.device = module, output_names, device

    @torch.no_grad()
    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return list(self.module(*(t.to(self.device) for t in inputs)))


BACKEND = TorchTensorRTBackend()
