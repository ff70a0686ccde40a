"""Triton model configurations (as dicts for `pbtxt.to_pbtxt`) for the models `specc triton` writes.

- the orchestrator: a python-backend model in decoupled mode (streams tokens as rounds accept them);
- engines (split layout): one model per step graph, served by Triton's `onnxruntime_onnx` or
  `tensorrt_plan` platform, or by a python-backend model running the bundle's own backend.
"""
from __future__ import annotations

from ..bundle import Manifest
from ..errors import BundleError
from ..onnx_passes.feed_cache_by_layer import CACHE_INPUTS, layer_input
from .interface import INPUTS, OUTPUTS, TensorSpec
from .pbtxt import Enum

# Triton platform of each specc backend whose engine files Triton can serve natively.
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}

_TYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32", "float16": "TYPE_FP16",
          "bfloat16": "TYPE_BF16", "bool": "TYPE_BOOL"}


def orchestrator_config(name: str, manifest: Manifest, parameters: dict[str, str]) -> dict:
    """The decoupled python-backend model that clients call (both layouts)."""
    return {
        "name": name,
        "backend": "python",
        "max_batch_size": 0,  # requests are batched by specc's scheduler, not by Triton
        "model_transaction_policy": {"decoupled": True},
        "input": [_tensor(s, optional=s.optional) for s in INPUTS],
        "output": [_tensor(s) for s in OUTPUTS],
        "instance_group": [{"kind": _kind(manifest), "count": 1}],
        "parameters": _parameters(parameters),
    }


def engine_config(name: str, manifest: Manifest, role: str, engines: str) -> dict:
    """A step graph (target or draft) as a Triton model; engines: "native" or "python"."""
    entry = manifest.graph(role).to_dict()
    config: dict = {"name": name}
    if engines == "native":
        platform = PLATFORMS.get(manifest.backend)
        if platform is None:
            raise BundleError(
                f"Triton has no platform for {manifest.backend!r} engines; the split layout with native engines "
                f"needs a bundle compiled for {' or '.join(PLATFORMS)} (or use --engines python, or the in-process layout)"
            )
        config.update(platform=platform, default_model_filename=entry["entry"])
    else:
        config["backend"] = "python"
    config.update({
        "max_batch_size": 0,  # the caches are [L, B, ...]: batch is not the first dimension
        "input": [_graph_tensor(i["name"], i["dtype"], i["shape"])
                  for i in (engine_inputs(entry) if config.get("platform") == PLATFORMS["onnxruntime"]
                            else entry["inputs"])],
        "output": [_graph_tensor(n, dtype, shape) for n, (dtype, shape) in graph_outputs(entry).items()],
        "instance_group": [{"kind": _kind(manifest), "count": 1}],
    })
    if engines == "python":
        config["parameters"] = _parameters({"role": role})
    return config


def engine_inputs(entry: dict) -> list[dict]:
    """The inputs of the graph's engine file: the ABI's, with a stacked cache the ONNX graph takes by layer
    (`cache_by_layer`, onnx_passes/feed_cache_by_layer.py) as one `[B, H, S, D]` input per layer."""
    layers = entry.get("cache_by_layer")
    out = []
    for i in entry["inputs"]:
        if layers and i["name"] in CACHE_INPUTS:
            out += [{**i, "name": layer_input(i["name"], n), "shape": i["shape"][1:]} for n in range(layers)]
        else:
            out.append(i)
    return out


def graph_outputs(entry: dict) -> dict[str, tuple[str, list]]:
    """Output dtypes and shapes of a step graph, from its input signature (the step-graph ABI)."""
    cache = next((i for i in entry["inputs"] if i["name"] == "k_cache"), None)
    if cache is None:
        raise BundleError("the graph has no k_cache input; it is not a step graph that specc triton serves")
    new_kv = ["tokens" if d == "cache" else d for d in cache["shape"]]
    shapes = {"logits": ("float32", ["batch", "rows", entry["model"]["vocab_size"]]),
              "new_k": (cache["dtype"], new_kv), "new_v": (cache["dtype"], new_kv)}
    unknown = [n for n in entry["outputs"] if n not in shapes]
    if unknown:
        raise BundleError(f"graph outputs {unknown} are not part of the step-graph ABI that specc triton serves")
    return {n: shapes[n] for n in entry["outputs"]}


def _tensor(spec: TensorSpec, optional: bool = False) -> dict:
    out = {"name": spec.name, "data_type": Enum(spec.triton_type), "dims": list(spec.dims)}
    if optional:
        out["optional"] = True
    return out


def _graph_tensor(name: str, dtype: str, shape: list) -> dict:
    if dtype not in _TYPES:
        raise BundleError(f"graph tensor {name!r} has dtype {dtype!r}, which specc triton cannot map to a Triton type")
    return {"name": name, "data_type": Enum(_TYPES[dtype]), "dims": [d if isinstance(d, int) else -1 for d in shape]}


def _kind(manifest: Manifest) -> Enum:
    return Enum("KIND_GPU" if manifest.recipe.device.startswith("cuda") else "KIND_CPU")


def _parameters(values: dict[str, str]) -> list[dict]:
    return [{"key": k, "value": {"string_value": str(v)}} for k, v in values.items()]
