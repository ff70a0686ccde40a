"""quantize_weight_only_dq (TensorRT's `target.quantize`): each linear layer's constant weight becomes
`DequantizeLinear(quantised weight, scale) → MatMul`, the explicit-quantisation form TensorRT 10 fuses
into a weight-only GEMM (the form TensorRT Model Optimizer's int4_awq and fp8 exports use):

    int4  symmetric blocks of `block_size` along K (INT4 values -8..7, one scale per block and
          output column; DequantizeLinear axis 0 with `block_size`, ONNX opset 21)
    int8  symmetric, one scale per output column (axis 1)
    fp8   FLOAT8E4M3FN, one scale per output column (axis 1), scale = max|w| / 448

TensorRT requires zero points to be zero, so there are none. The block values come from
round-to-nearest (block_weights.quantize_rtn); AWQ's activation-aware per-channel scale search
needs calibration activations and is not implemented: `int4` here is the int4-AWQ *format*
without the AWQ search. This pass only rewrites ONNX (it runs on any machine; the tests check it
with ONNX Runtime's reference semantics and the TensorRT operator table); building the engine
happens in tensorrt_backend.build_engine with a strongly typed network (TensorRT follows the
graph's types, as weight-only INT4/FP8 needs). The engine build itself is not covered by the CPU tests.

requires: no Transpose of a constant weight (fold_weight_transposes ran).
ensures:  no linear layer outside keep_float multiplies by a float weight; the default opset is one
  whose DequantizeLinear takes the weights' type and blocks.
"""
from __future__ import annotations

import numpy as np

from ..block_weights import quantize_rtn
from .base import OnnxPass, OnnxProperty
from .linear_layers import LINEARS_QUANTISED, WEIGHT_TRANSPOSES_FOLDED, QuantConfig, linear_module, linear_weight

KINDS = ("int4", "int8", "fp8")
OPSET_BLOCKED_DQ = 21  # DequantizeLinear gains block_size (and INT4) in opset 21
OPSET_FP8 = 19  # float8 types
FP8_MAX = 448.0


def _pack_int4(values: np.ndarray) -> bytes:
    """ONNX INT4 raw data: two signed 4-bit values per byte, the first in the low nibble."""
    flat = (values.astype(np.int8).reshape(-1) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()


def quantise_weight(w_kn: np.ndarray, kind: str, block_size: int) -> tuple:
    """(quantised TensorProto fields (data_type, dims, raw bytes), scale array, DequantizeLinear attributes)
    for a weight stored as MatMul's right operand [K, N]."""
    from onnx import TensorProto

    k, n = w_kn.shape
    if kind == "int4":
        if k % block_size:
            raise ValueError(f"int4 blocks of {block_size} need K ({k}) to be a multiple")
        bw = quantize_rtn(w_kn.T, 4, block_size, symmetric=True)  # [N, K/bs, bs]
        q = (bw.q.astype(np.int16) - 8).reshape(n, k).T  # [K, N], -8..7
        return (TensorProto.INT4, [k, n], _pack_int4(q)), bw.scales.T.copy(), {"axis": 0, "block_size": block_size}
    peak = np.abs(w_kn).max(0)
    if kind == "int8":
        scale = np.where(peak == 0, 1.0, peak / 127).astype(np.float32)
        q = np.clip(np.rint(w_kn / scale), -127, 127).astype(np.int8)
        return (TensorProto.INT8, [k, n], q.tobytes()), scale, {"axis": 1}
    if kind == "fp8":
        from onnx.numpy_helper import saturate_cast

        scale = np.where(peak == 0, 1.0, peak / FP8_MAX).astype(np.float32)
        import ml_dtypes

        q = saturate_cast(w_kn / scale, ml_dtypes.float8_e4m3fn)
        return (TensorProto.FLOAT8E4M3FN, [k, n], q.tobytes()), scale, {"axis": 1}
    raise ValueError(f"weight-only kind {kind!r}; allowed: {', '.join(KINDS)}")


def _needed_opset(kind: str) -> int:
    return {"int4": OPSET_BLOCKED_DQ, "fp8": OPSET_FP8}.get(kind, 0)


def _opset_fits(model, quantiser) -> bool:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return opset >= _needed_opset(quantiser.config.kind)


class QuantizeWeightOnlyDQ(OnnxPass):
    """Linear layers into DequantizeLinear → MatMul form (int4 blocks, int8 or fp8 per channel) for TensorRT."""

    name = "quantize_weight_only_dq"
    requires = (WEIGHT_TRANSPOSES_FOLDED,)
    ensures = (LINEARS_QUANTISED, OnnxProperty("opset-for-dq", _opset_fits,
                                               "a default opset whose DequantizeLinear takes the weights' type "
                                               f"(int4 blocks: {OPSET_BLOCKED_DQ}, fp8: {OPSET_FP8})"))

    def __init__(self, config: QuantConfig):
        if config.kind not in KINDS:
            raise ValueError(f"weight-only kind {config.kind!r}; allowed: {', '.join(KINDS)}")
        self.config = config

    def apply(self, model) -> dict:
        """Manifest facts: {"kind", "block_size", "layers", "kept", "weight_bytes"}."""
        from onnx import helper, numpy_helper

        kind, block_size = self.config.kind, self.config.block_size
        inits = {i.name: i for i in model.graph.initializer}
        new_nodes, layers, kept, weight_bytes = [], 0, [], 0
        for node in model.graph.node:
            weight = linear_weight(node, inits)
            module = linear_module(node) if weight is not None else None
            if module is None or self.config.keeps(module):
                if module is not None:
                    kept.append(module)
                new_nodes.append(node)
                continue
            w = numpy_helper.to_array(weight).astype(np.float32)
            (dtype, dims, raw), scale, attrs = quantise_weight(w, kind, block_size)
            base = node.output[0]
            q = helper.make_tensor(f"{base}.wq", dtype, dims, raw, raw=True)
            s = numpy_helper.from_array(scale.astype(numpy_helper.to_array(weight).dtype), f"{base}.wscale")
            model.graph.initializer.extend([q, s])
            model.graph.initializer.remove(weight)
            inits.pop(weight.name)
            new_nodes.append(helper.make_node("DequantizeLinear", [q.name, s.name], [f"{base}.w"], name=f"{base}.dq",
                                              **attrs))
            new_nodes.append(helper.make_node("MatMul", [node.input[0], f"{base}.w"], [base], name=node.name))
            layers += 1
            weight_bytes += len(raw) + s.ByteSize()
        del model.graph.node[:]
        model.graph.node.extend(new_nodes)
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx") and o.version < _needed_opset(kind):
                o.version = _needed_opset(kind)
        return {"kind": kind, "block_size": block_size if kind == "int4" else None, "layers": layers, "kept": kept,
                "weight_bytes": weight_bytes}
