"""`aoti`: AOTInductor `.pt2` packages (a compiled shared library with the weights inside),
CPU or CUDA, loaded with `torch._inductor.aoti_load_package`.

The program is traced on the recipe's device (see compiler), so Inductor emits C++ kernels
for a CPU trace and Triton/CUDA kernels for a CUDA trace. CUDA packages hold kernels for
the GPU that compiled them: the bundle records its compute capability and loading on
another fails naming both.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.export import ExportedProgram

from .base import LowerOptions, require_version
from .gpu import check_same_gpu, cuda_device, device_facts

FILE = "graph.pt2"


class AotiBackend:
    name = "aoti"
    runs_bundle_code = "AOTInductor packages are compiled shared libraries (.so) that are loaded and run as native code"

    def availability(self) -> tuple[bool, str]:
        compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        if compiler is None:
            return False, "no C++ compiler on PATH (AOTInductor compiles C++)"
        if torch.cuda.is_available():
            facts = device_facts(torch.device("cuda"))
            return True, f"torch {torch.__version__}, CPU and CUDA {torch.version.cuda} ({facts['gpu']})"
        return True, f"torch {torch.__version__}, CPU only (no CUDA device)"

    def check_versions(self, recorded: dict) -> None:
        require_version("torch", recorded, torch.__version__, same_minor=True)

    def lower(self, program: ExportedProgram, out_dir: Path, input_names, output_names, options: LowerOptions) -> dict:
        from torch._inductor import aoti_compile_and_package

        facts = {}
        if torch.device(options.device).type == "cuda":
            facts = device_facts(cuda_device(self.name, options.device))
        aoti_compile_and_package(program, package_path=str(out_dir / FILE))
        return {"entry": FILE, "files": [FILE], "versions": {"torch": torch.__version__},
                "device": options.device, **facts}

    def load(self, graph_dir: Path, entry: dict, options: LowerOptions):
        from torch._inductor import aoti_load_package

        device_index = -1
        if torch.device(entry.get("device", "cpu")).type == "cuda":
            dev = cuda_device(self.name, options.device)
            check_same_gpu(entry, dev, f"AOTInductor package {graph_dir.name}/{entry['entry']}")
            device_index = dev.index if dev.index is not None else torch.cuda.current_device()
        package = aoti_load_package(str(graph_dir / entry["entry"]), device_index=device_index)
        return AotiRunner(package, list(entry["outputs"]))


class AotiRunner:
    def __init__(self, compiled, output_names: list[str]):
        self.compiled, self.output_names = compiled, output_names

    @torch.no_grad()
    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        # The kernels assume the dense strides of the traced examples; the runtime passes views
        # (verify's logit_index is an expanded arange, stride 0), which they would misread.
        return list(self.compiled(*(t.contiguous() for t in inputs)))


BACKEND = AotiBackend()
