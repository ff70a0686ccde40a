"""`aoti`: AOTInductor `.pt2` packages (a compiled shared library with the weights inside),
CPU or CUDA, loaded with `torch._inductor.aoti_load_package`."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.export import ExportedProgram

from .base import LowerOptions, require_version

FILE = "graph.pt2"


class AotiBackend:
    name = "aoti"

    def availability(self) -> tuple[bool, str]:
        compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        if compiler is None:
            return False, "no C++ compiler on PATH (AOTInductor compiles C++)"
        cuda = f", CUDA {torch.version.cuda}" if torch.cuda.is_available() else ", CPU only"
        return True, f"torch {torch.__version__}{cuda}"

    def check_versions(self, recorded: dict) -> None:
        require_version("torch", recorded, torch.__version__, same_minor=True)

    def lower(self, program: ExportedProgram, out_dir: Path, input_names, output_names, options: LowerOptions) -> dict:
        from torch._inductor import aoti_compile_and_package

        # The program was traced on options.device (see compiler), so Inductor emits kernels for it.
        aoti_compile_and_package(program, package_path=str(out_dir / FILE))
        return {"entry": FILE, "files": [FILE], "versions": {"torch": torch.__version__},
                "device": options.device}

    def load(self, graph_dir: Path, entry: dict, options: LowerOptions):
        from torch._inductor import aoti_load_package

        return AotiRunner(aoti_load_package(str(graph_dir / entry["entry"])), list(entry["outputs"]))


class AotiRunner:
    def __init__(self, compiled, output_names: list[str]):
        self.compiled, self.output_names = compiled, output_names

    @torch.no_grad()
    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return list(self.compiled(*inputs))


BACKEND = AotiBackend()
