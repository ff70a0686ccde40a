"""How many threads torch's own operators use on the host while rounds run.

Between two graph passes the runtime runs a few torch operators (argmax, softmax, copies) on tensors as wide as the
vocabulary, which ATen splits over its OpenMP threads. Those threads then spin for milliseconds waiting for more
work, on the very cores that ONNX Runtime's pool and specc's kernels need for the next pass: on a 2-core machine a
draft pass ran twice as long after one such operator. Graphs that do not run on torch's CPU threads therefore get
rounds with one torch thread (a vocabulary-wide operator takes tens of microseconds on one core); the count is set
back afterwards, so torch code outside the rounds keeps its threads.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

TORCH_ON_CPU = ("torch", "aoti")  # backends whose graphs run on torch's own CPU threads


def host_threads(backend: str, device: str) -> int | None:
    """torch threads for rounds of a bundle on this backend and device; None: leave torch's setting."""
    return None if backend in TORCH_ON_CPU and device == "cpu" else 1


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with n torch threads (None: as they are), then restore the count."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
