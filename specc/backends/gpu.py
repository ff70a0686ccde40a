"""CUDA facts the GPU backends record in bundles and check when loading them."""
from __future__ import annotations

import torch

from ..errors import BackendUnavailableError, BundleError


def cuda_device(backend: str, device: str = "cuda") -> torch.device:
    """The CUDA device to build or run on; BackendUnavailableError when torch sees none."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        where = "torch sees no CUDA device" if not torch.cuda.is_available() else f"device {device!r} is not CUDA"
        raise BackendUnavailableError(f"backend {backend!r} needs an NVIDIA GPU: {where} "
                                      f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    return dev


def device_facts(dev: torch.device) -> dict:
    """GPU name and compute capability ("9.0"), as recorded in a bundle."""
    major, minor = torch.cuda.get_device_capability(dev)
    return {"gpu": torch.cuda.get_device_name(dev), "compute_capability": f"{major}.{minor}"}


def check_same_gpu(recorded: dict, dev: torch.device, what: str) -> None:
    """Engines built for one compute capability do not run on another: say which is which."""
    built = recorded.get("compute_capability")
    here = device_facts(dev)
    if built and built != here["compute_capability"]:
        raise BundleError(
            f"{what} were built for compute capability {built} ({recorded.get('gpu', 'unknown GPU')}); this machine's "
            f"GPU is {here['gpu']} with compute capability {here['compute_capability']}. "
            "Compile the recipe again on this GPU"
        )
