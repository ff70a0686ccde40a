"""`tensorrt`: ONNX → TensorRT engines (`.plan`). Not yet implemented in this version of specc;
the backend reports itself unavailable with the reason, so recipes fail fast and clearly."""
from __future__ import annotations

from ..errors import BackendUnavailableError


class TensorRTBackend:
    name = "tensorrt"

    def availability(self) -> tuple[bool, str]:
        try:
            import tensorrt
        except ImportError:
            return False, "the tensorrt package is not installed (needs an NVIDIA GPU machine; pip install tensorrt)"
        return False, f"tensorrt {tensorrt.__version__} found, but specc's TensorRT lowering is not implemented yet"

    def check_versions(self, recorded: dict) -> None:
        raise BackendUnavailableError(self.availability()[1])


BACKEND = TensorRTBackend()
