"""Backends, imported lazily so that a missing optional package only matters when used."""
from __future__ import annotations

import importlib

from ..errors import BackendUnavailableError
from .base import Backend, LowerOptions, Runner

_MODULES = {
    "onnxruntime": "onnxruntime_backend",
    "torch": "torch_backend",
    "aoti": "aoti_backend",
    "tensorrt": "tensorrt_backend",
    "torch_tensorrt": "torch_tensorrt_backend",
}


def names() -> list[str]:
    return list(_MODULES)


def get_backend(name: str, *, check: bool = True) -> Backend:
    """The backend called `name`; with check, raise BackendUnavailableError if it cannot run here."""
    if name not in _MODULES:
        raise BackendUnavailableError(f"unknown backend {name!r}; known: {', '.join(_MODULES)}")
    backend = importlib.import_module(f".{_MODULES[name]}", __name__).BACKEND
    if check:
        ok, detail = backend.availability()
        if not ok:
            raise BackendUnavailableError(f"backend {name!r} is not available on this machine: {detail}")
    return backend


__all__ = ["Backend", "LowerOptions", "Runner", "get_backend", "names"]
