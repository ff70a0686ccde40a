"""The backend interface: lower an exported step graph to files, and run those files."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch.export import ExportedProgram

from ..onnx_passes import QuantConfig
from ..recipe import TensorRTSpec
from .profiles import ShapePlan


@dataclass(frozen=True)
class LowerOptions:
    precision: str = "fp32"
    device: str = "cpu"
    quantize: str | None = None  # "int8": dynamic weight quantisation (onnxruntime)
    weight_quant: QuantConfig | None = None  # block-wise weight-only MatMulNBits (target.quantize, onnxruntime)
    # the target: attention reads each key at its token's position, so a row's bits do not depend on the pass
    # size (onnx_passes/attend_at_cache_positions.py; onnxruntime)
    keys_at_positions: bool = False
    shapes: ShapePlan | None = None  # shape profiles, for backends that build per shape range (tensorrt, torch_tensorrt)
    tensorrt: TensorRTSpec = TensorRTSpec()
    previous_dir: Path | None = None  # this graph's directory in the bundle being replaced (TensorRT reuses its timing cache)


class Runner(Protocol):
    """A loaded graph: positional tensors in the graph's input order, tensors out."""

    output_names: list[str]

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]: ...


class Backend(Protocol):
    name: str
    runs_bundle_code: str | None  # how loading runs code stored in the bundle (needs trust_code), or None

    def availability(self) -> tuple[bool, str]:
        """Whether this machine can lower and run the backend, and the versions or the reason."""

    def lower(self, program: ExportedProgram, out_dir: Path, input_names: list[str], output_names: list[str],
              options: LowerOptions) -> dict:
        """Write the engine files into out_dir; returns {"entry": file, "files": [...], **facts}."""

    def load(self, graph_dir: Path, entry: dict, options: LowerOptions) -> Runner:
        """Open the engine described by a manifest graph entry."""

    def check_versions(self, recorded: dict) -> None:
        """Raise BundleError if engines built with `recorded` versions cannot run here."""


def check_engine_matches(entry: dict, input_names: list[str], output_names: list[str], kv_shape: list, where: str) -> None:
    """The engine's own inputs, outputs and static KV-cache dims are what the manifest entry declares
    (so the runtime never feeds an engine tensors it did not declare)."""
    from ..errors import BundleError

    declared = [i["name"] for i in entry["inputs"]]
    if list(input_names) != declared or not set(entry["outputs"]) <= set(output_names):
        raise BundleError(f"{where} has inputs {list(input_names)} and outputs {list(output_names)}; its manifest "
                          f"declares {declared} and {entry['outputs']}")
    m = entry.get("model")
    if m is None or "k_cache" not in declared:  # a bare lowering (tests), or a graph without a cache (Medusa heads)
        return
    want = [m["n_layers"], None, m["n_kv_heads"], None, m["head_dim"]]
    if len(kv_shape) != 5 or any(w is not None and isinstance(d, int) and d != w for d, w in zip(kv_shape, want)):
        raise BundleError(f"{where} has a KV cache of shape {list(kv_shape)}; its manifest declares "
                          f"[{m['n_layers']}, batch, {m['n_kv_heads']}, cache, {m['head_dim']}]")


def _minor(version: str) -> tuple[int, int]:
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in version.split("+")[0].split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def require_version(package: str, recorded: dict, installed: str, same_minor: bool) -> None:
    """Engines need the same major.minor (same_minor) or at least the recorded version of a package."""
    from ..errors import BundleError

    built = recorded.get(package)
    if built is None:
        return
    ok = _minor(installed) == _minor(built) if same_minor else _minor(installed) >= _minor(built)
    if not ok:
        need = f"{package} {'.'.join(map(str, _minor(built)))}.x" if same_minor else f"{package} >= {built}"
        raise BundleError(f"bundle was built with {package} {built} and needs {need}; this machine has {package} {installed}. "
                          "Install that version or compile the recipe again here")
