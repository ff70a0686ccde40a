"""`torch`: the exported program itself, the numerical reference for every other backend.

Stored pickle-free (torch_program.py): the graph as torch's JSON schema, the tensors as
safetensors; loading checks the graph's operators and rebuilds the program without
`torch.export.load` (whose `.pt2` archives unpickle sample inputs).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.export import ExportedProgram

from ..errors import BundleError
from .base import LowerOptions, check_engine_matches, require_version
from .torch_program import PROGRAM, WEIGHTS, load_program, save_program


class TorchBackend:
    name = "torch"
    runs_bundle_code = None  # the program is checked JSON and safetensors: nothing from the bundle is executed

    def availability(self) -> tuple[bool, str]:
        return True, f"torch {torch.__version__}"

    def lower(self, program: ExportedProgram, out_dir: Path, input_names, output_names, options: LowerOptions) -> dict:
        files = save_program(program, out_dir)
        return {"entry": PROGRAM, "files": files, "versions": {"torch": torch.__version__}}

    def check_versions(self, recorded: dict) -> None:
        require_version("torch", recorded, torch.__version__, same_minor=True)

    def load(self, graph_dir: Path, entry: dict, options: LowerOptions):
        if entry["entry"] != PROGRAM or sorted(entry["files"]) != sorted([PROGRAM, WEIGHTS]):
            raise BundleError(f"torch graph {graph_dir.name}: expected files {PROGRAM} and {WEIGHTS} (entry {PROGRAM}), "
                              f"got {entry['files']} (entry {entry['entry']}); specc loads no .pt2 archives for this backend")
        program = load_program(graph_dir)
        signature = program.graph_signature
        names = list(signature.user_inputs)
        kv = next((n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder" and n.name == "k_cache"), None)
        kv_shape = [d if isinstance(d, int) else None for d in kv.shape] if kv is not None else []
        outputs = list(entry["outputs"]) if len(signature.user_outputs) == len(entry["outputs"]) else []
        check_engine_matches(entry, names, outputs, kv_shape, f"torch graph {graph_dir.name}/{PROGRAM}")
        module = program.module()
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
