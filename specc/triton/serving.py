"""Python-backend models that serve a bundle under Triton; the `model.py` files that
`specc triton` writes import one of these as `TritonPythonModel`.

- `InProcessModel` (layout in-process): loads the whole bundle with the specc runtime.
- `SplitModel` (layout split): the same orchestrator, but its target and draft graphs are other
  Triton models, called with BLS (Business Logic Scripting); it keeps the KV caches itself.
- `EngineModel` (layout split, `--engines python`): one step graph run by the bundle's backend.

`triton_python_backend_utils` exists only inside Triton's python-backend stub; it is imported
when Triton calls `initialize`.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import torch

from ..bundle import Bundle, open_bundle, read_manifest
from ..errors import SpeccError
from ..onnx_passes.feed_cache_by_layer import CACHE_INPUTS, by_layer
from ..runtime.graphs import open_runner
from ..runtime.model import SpecModel, load
from ..runtime.rules import fault_log
from .orchestrator import Orchestrator
from .repository import BUNDLE_DIR


class EngineError(RuntimeError):
    """A Triton-served step graph answered a BLS request with an error."""


def _pb():
    return importlib.import_module("triton_python_backend_utils")


def _setup(args: dict) -> tuple[dict[str, str], Path]:
    """The model's string parameters and its version directory."""
    config = json.loads(args["model_config"])
    params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
    return params, Path(args["model_repository"]) / args["model_version"]


def _pins(params: dict[str, str]) -> dict:
    """open_bundle's expect_id and trust_code from the model's parameters (written by `specc triton`)."""
    return {"expect_id": params.get("bundle_id") or None, "trust_code": params.get("trust_code", "false") == "true"}


def open_partial_bundle(path: Path, prefixes: tuple[str, ...], params: dict[str, str]) -> Bundle:
    """A bundle directory that holds only the manifest's files under `prefixes` (the split layout
    spreads a bundle over several models); its id is checked against the model's `bundle_id`,
    those files against their sha256, and any file present must be listed."""
    return open_bundle(path, prefixes=prefixes, **_pins(params))


class _OrchestratorModel:
    """Decoupled model: `execute` queues requests, the orchestrator's thread streams the responses."""

    def initialize(self, args: dict) -> None:
        self.pb = _pb()
        params, version_dir = _setup(args)
        model = self.load_model(version_dir / params.get("bundle", BUNDLE_DIR), params)
        logger = self.pb.Logger
        self.orchestrator = Orchestrator(
            model, self.pb, speculative=params.get("speculative", "true") == "true",
            k=(params["k"] if params["k"] == "auto" else int(params["k"])) if params.get("k") else None,
            default_max_tokens=int(params.get("default_max_tokens", 64)), log=logger.log_error,
        )

    def load_model(self, bundle_dir: Path, params: dict[str, str]) -> SpecModel:
        raise NotImplementedError

    def execute(self, requests: list) -> None:
        for request in requests:
            self.orchestrator.submit(request)
        return None

    def finalize(self) -> None:
        self.orchestrator.close()


class InProcessModel(_OrchestratorModel):
    """The whole bundle in this process, on any specc backend."""

    def load_model(self, bundle_dir: Path, params: dict[str, str]) -> SpecModel:
        return load(bundle_dir, verify=params.get("verify_bundle", "true") == "true", **_pins(params))


class SplitModel(_OrchestratorModel):
    """Target and draft are other Triton models; each graph call is a BLS request."""

    def load_model(self, bundle_dir: Path, params: dict[str, str]) -> SpecModel:
        manifest = read_manifest(bundle_dir)
        bundle = open_partial_bundle(bundle_dir, (manifest.tokenizer.dir + "/",), params)
        roles = ["target"] + ([manifest.draft.graph] if manifest.draft.graph else [])
        engines = {role: params[f"{role}_model"] for role in roles}
        device = torch.device(manifest.recipe.device)
        layers = {role: int(params.get(f"{role}_cache_by_layer", 0)) for role in roles}
        return SpecModel(bundle, open_graph=lambda b, role: BLSRunner(self.pb, engines[role], b.graph(role), device,
                                                                      layers[role]))


class BLSRunner:
    """A step graph served by another Triton model (the `Runner` protocol of specc backends)."""

    def __init__(self, pb, model_name: str, entry: dict, device: torch.device, cache_by_layer: int = 0):
        self.pb, self.model_name, self.device = pb, model_name, device
        self.input_names = [i.name for i in entry.inputs]
        self.output_names = list(entry.outputs)
        self.cache_by_layer = cache_by_layer  # the engine takes k_cache / v_cache as one input per layer

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        pb = self.pb
        tensors = []
        for name, t in zip(self.input_names, inputs):
            if self.cache_by_layer and name in CACHE_INPUTS:
                tensors += [_to_pb(pb, n, layer) for n, layer in by_layer(name, t, self.cache_by_layer)]
            else:
                tensors.append(_to_pb(pb, name, t))
        request = pb.InferenceRequest(model_name=self.model_name, requested_output_names=self.output_names,
                                      inputs=tensors)
        response = request.exec()
        if response.has_error():
            raise EngineError(f"model {self.model_name!r}: {response.error().message()}")
        return [_from_pb(pb.get_output_tensor_by_name(response, n), self.device) for n in self.output_names]


class EngineModel:
    """One step graph of a bundle (parameter `role`), run by the bundle's backend in this process."""

    def initialize(self, args: dict) -> None:
        self.pb = _pb()
        params, version_dir = _setup(args)
        bundle_dir = version_dir / params.get("bundle", BUNDLE_DIR)
        self.role = role = params["role"]
        entry = read_manifest(bundle_dir).graph(role)
        bundle = open_partial_bundle(bundle_dir, (entry.dir + "/",), params)
        self.runner = open_runner(bundle, role)
        self.device = torch.device(bundle.recipe.device)
        self.input_names = [i.name for i in entry.inputs]
        self.output_names = list(entry.outputs)

    def execute(self, requests: list) -> list:
        return [self._run(request) for request in requests]

    def _run(self, request):
        pb = self.pb
        try:
            inputs = [_from_pb(pb.get_input_tensor_by_name(request, n), self.device) for n in self.input_names]
            outputs = self.runner(*inputs)
            return pb.InferenceResponse(output_tensors=[_to_pb(pb, n, t) for n, t in zip(self.output_names, outputs)])
        except SpeccError as exc:  # the request's tensors are at fault: the caller reads why
            return pb.InferenceResponse(error=pb.TritonError(str(exc)))
        except Exception as exc:  # the traceback goes to the log, the caller gets its reference
            reference, line = fault_log(f"specc: engine {self.role!r} failed", exc)
            pb.Logger.log_error(line)
            return pb.InferenceResponse(error=pb.TritonError(f"engine {self.role!r} failed (reference {reference} in "
                                                             "the server's log)"))


def _to_pb(pb, name: str, t: torch.Tensor):
    if t.is_cuda:
        return pb.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(t.contiguous()))
    return pb.Tensor(name, np.ascontiguousarray(t.detach().numpy()))


def _from_pb(tensor, device: torch.device) -> torch.Tensor:
    if tensor.is_cpu():  # a copy: the array may live in shared memory that Triton reuses
        return torch.from_numpy(np.array(tensor.as_numpy())).to(device)
    return torch.utils.dlpack.from_dlpack(tensor.to_dlpack()).to(device)
