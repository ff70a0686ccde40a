"""ONNX from an exported step graph, shared by the `onnxruntime` and `tensorrt` backends.

Every ONNX node records where it came from. Graph passes tag the FX nodes they create
(`node.meta["custom"][PASS_TAG]`, see passes/base.py); torch.export and the ONNX
exporter's decompositions keep that field, and `export_onnx` copies it into the ONNX node's
`metadata_props` under `specc.pass`. Nodes without it come from the captured model (the
exporter's own `pkg.torch.onnx.fx_node` and `namespace` say which FX node and module).
"""
from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from pathlib import Path

import torch
from torch.export import ExportedProgram

from ..passes.base import PASS_TAG

PASS_KEY = "specc.pass"  # ONNX node metadata_props: the pass that created the node
FX_NODE_KEY = "pkg.torch.onnx.fx_node"  # written by torch.onnx: "%name : [...] = call_function[...]"


def export_onnx(program: ExportedProgram, path: Path, input_names: list[str], output_names: list[str],
                opset: int) -> None:
    """Write `program` as ONNX at `path` (weights in one external-data file beside it) and check it."""
    import onnx

    # The exporter prints progress to stdout and warns about torchvision; keep specc's own output clean.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        onnx_program = torch.onnx.export(
            program, (), dynamo=True, input_names=input_names, output_names=output_names,
            opset_version=opset, optimize=True, verbose=False,
        )
    _record_passes(onnx_program)
    onnx_program.save(str(path), external_data=True)
    onnx.checker.check_model(str(path))


def _record_passes(onnx_program) -> None:
    """Copy each FX node's pass tag onto the ONNX nodes made from it."""
    fx_nodes = {n.name: n for n in onnx_program.exported_program.graph.nodes}
    for node in onnx_program.model.graph.all_nodes():
        fx = node.meta.get("node")
        if fx is None:  # nodes rebuilt by the ONNX optimiser keep only the metadata text
            match = re.match(r"%(\S+)", node.metadata_props.get(FX_NODE_KEY, ""))
            fx = fx_nodes.get(match.group(1)) if match else None
        name = (fx.meta.get("custom") or {}).get(PASS_TAG) if fx is not None else None
        if name:
            node.metadata_props[PASS_KEY] = name


def opset_of(path: Path) -> int:
    """The default-domain opset an ONNX file imports."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


FUSED_OPS = ("Attention", "RMSNormalization", "RotaryEmbedding", "LayerNormalization")


def fused_op_counts(path: Path) -> dict[str, int]:
    """How many of the fused opset-23 operators an ONNX file uses (main graph and local functions);
    `specc inspect` sets them beside the sites the capture expected, so fallbacks show."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
    return {op: sum(n.op_type == op for n in nodes) for op in FUSED_OPS}
