"""`torch_tensorrt`: the exported program compiled by Torch-TensorRT. Not yet implemented in this version of specc;
the backend reports itself unavailable with the reason, so recipes fail fast and clearly."""
from __future__ import annotations

from ..errors import BackendUnavailableError


class TorchTensorRTBackend:
    name = "torch_tensorrt"

    def availability(self) -> tuple[bool, str]:
        try:
            import torch_tensorrt
        except ImportError:
            return False, "the torch_tensorrt package is not installed (needs an NVIDIA GPU machine)"
        return False, f"torch_tensorrt {torch_tensorrt.__version__} found, but specc's Torch-TensorRT lowering is not implemented yet"

    def check_versions(self, recorded: dict) -> None:
        raise BackendUnavailableError(self.availability()[1])


BACKEND = TorchTensorRTBackend()
