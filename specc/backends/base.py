"""The backend interface: lower an exported step graph to files, and run those files."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch.export import ExportedProgram


@dataclass(frozen=True)
class LowerOptions:
    precision: str = "fp32"
    device: str = "cpu"
    quantize: str | None = None  # "int8": dynamic weight quantisation (onnxruntime)


class Runner(Protocol):
    """A loaded graph: positional tensors in the graph's input order, tensors out."""

    output_names: list[str]

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]: ...


class Backend(Protocol):
    name: str

    def availability(self) -> tuple[bool, str]:
        """Whether this machine can lower and run the backend, and the versions or the reason."""

    def lower(self, program: ExportedProgram, out_dir: Path, input_names: list[str], output_names: list[str],
              options: LowerOptions) -> dict:
        """Write the engine files into out_dir; returns {"entry": file, "files": [...], **facts}."""

    def load(self, graph_dir: Path, entry: dict, options: LowerOptions) -> Runner:
        """Open the engine described by a manifest graph entry."""
