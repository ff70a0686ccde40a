"""How close decoding is to the memory-bandwidth limit: weights read per target pass × passes/s,
against what a plain copy achieves on this machine."""
from __future__ import annotations

import time
from pathlib import Path

from ..hardware import usable_cores


def copy_bandwidth(threads: int | None = None, megabytes: int = 256, repeats: int = 5) -> float:
    """GB/s of a large tensor copy (bytes read + bytes written), best of `repeats`, with `threads` threads."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads or usable_cores())
    try:
        src = torch.ones(megabytes * (1 << 20) // 4)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * src.numel() * 4 / best / 1e9


def linear_macs_per_row(bundle) -> int | None:
    """Multiply-adds of the target graph's linear layers for one row of a pass (sum of N x K over its MatMuls of
    a constant weight, quantised or not), read from the graph; None for graphs that are not ONNX."""
    entry = bundle.graph("target")
    path = bundle.path / entry.dir / entry.entry
    return onnx_linear_macs_per_row(path) if path.suffix == ".onnx" else None


def onnx_linear_macs_per_row(path: Path) -> int:
    """Multiply-adds of the linear layers of the ONNX graph at `path` for one row of a pass."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    macs = 0
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type in ("Int4Gemm", "MatMulNBits"):
            macs += int(attrs["N"]) * int(attrs["K"])
        elif node.op_type in ("MatMul", "MatMulInteger") and len(dims.get(node.input[1], [])) == 2:
            macs += int(dims[node.input[1]][0]) * int(dims[node.input[1]][1])
    return macs


def specc_weight_bytes(bundle) -> int:
    """Bytes of weights a target pass reads: the MatMulNBits summary when quantised, else the graph's files
    (float32 weights dominate them; the embedding table, of which a pass reads a few rows, is included)."""
    entry = bundle.graph("target")
    if entry.facts.get("weight_quant"):
        return int(entry.facts["weight_quant"]["weight_bytes"])
    files = bundle.manifest.files
    return sum(files[f"{entry.dir}/{f}"].bytes for f in entry.files if f"{entry.dir}/{f}" in files)
