"""`torch`: the exported program itself, the numerical reference for every other backend."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import torch
from torch.export import ExportedProgram

from ..errors import BundleError
from .base import LowerOptions, require_version

FILE = "graph.pt2"


def _check_no_pickled_weights(path: Path) -> None:
    """torch.export stores plain tensors as raw bytes; refuse archives that would unpickle weights."""
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            if name.endswith(".json") and ("weights_config" in name or "constants_config" in name):
                config = json.loads(zf.read(name))
                for fqn, meta in config.get("config", {}).items():
                    if meta.get("use_pickle"):
                        raise BundleError(f"{path} stores weight {fqn!r} as a pickle; specc loads no pickled weights")


class TorchBackend:
    name = "torch"

    def availability(self) -> tuple[bool, str]:
        return True, f"torch {torch.__version__}"

    def lower(self, program: ExportedProgram, out_dir: Path, input_names, output_names, options: LowerOptions) -> dict:
        path = out_dir / FILE
        torch.export.save(program, path)
        _check_no_pickled_weights(path)
        return {"entry": FILE, "files": [FILE], "versions": {"torch": torch.__version__}}

    def check_versions(self, recorded: dict) -> None:
        require_version("torch", recorded, torch.__version__, same_minor=True)

    def load(self, graph_dir: Path, entry: dict, options: LowerOptions):
        path = graph_dir / entry["entry"]
        _check_no_pickled_weights(path)
        module = torch.export.load(path).module()
        device = torch.device(options.device)
        if device.type != "cpu":
            module = module.to(device)
        return TorchRunner(module, list(entry["outputs"]))


class TorchRunner:
    def __init__(self, module: torch.nn.Module, output_names: list[str]):
        self.module, self.output_names = module, output_names

    @torch.no_grad()
    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return list(self.module(*inputs))


BACKEND = TorchBackend()
