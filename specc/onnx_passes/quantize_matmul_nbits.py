"""quantize_matmul_nbits: every linear layer's MatMul becomes ONNX Runtime's block-wise `MatMulNBits`.

Weights are `BlockWeight`s (specc/block_weights.py): round to nearest here, or a GGUF's own blocks
where they dequantise bit for bit to the graph's weight. MatMulNBits computes (q - zp) * scale; a
block offset (GGUF's Q4_1/Q4_K minimums) adds `blocksum(x) @ offsetᵀ` (one small MatMul of
K/block_size rows, the decomposition llama.cpp's own Q4_1/Q4_K dot products use).

requires: no Transpose of a constant weight (fold_weight_transposes ran).
ensures:  no linear layer outside keep_float multiplies by a float weight; the com.microsoft opset
  is imported. The manifest records the settings, layer counts by format, the bytes of weights one
  pass reads, and from how many rows on the kernel gives a row the same bits in any pass here.
"""
from __future__ import annotations

import logging

import numpy as np

from ..block_weights import BlockWeight, exact_match, quantize_rtn
from .base import OnnxPass, OnnxProperty
from .kernel_rows import rows_match_small_passes
from .linear_layers import LINEARS_QUANTISED, WEIGHT_TRANSPOSES_FOLDED, QuantConfig, replace_linear_layers

MS_DOMAIN = "com.microsoft"


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 values along the last axis, low nibble first for 4 bits (MatMulNBits' layout)."""
    if bits == 8:
        return values.astype(np.uint8)
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros(values.shape[:-1] + (1,), np.uint8)], -1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def _imports_ms_domain(model, _pass) -> bool:
    return any(o.domain == MS_DOMAIN for o in model.opset_import)


class QuantizeMatMulNBits(OnnxPass):
    """Linear layers onto MatMulNBits: block-wise int4/int8 weights (round to nearest, or a GGUF's own blocks)."""

    name = "quantize_matmul_nbits"
    requires = (WEIGHT_TRANSPOSES_FOLDED,)
    ensures = (LINEARS_QUANTISED, OnnxProperty(f"opset:{MS_DOMAIN}", _imports_ms_domain,
                                               f"the {MS_DOMAIN} opset imported"))

    def __init__(self, config: QuantConfig):
        self.config = config

    def apply(self, model) -> dict:
        from onnx import helper, numpy_helper

        config = self.config
        shared: dict = {}

        def replace(node, w: np.ndarray, module: str):
            bw = exact_match(config.imported.get(module, ()), w)
            if bw is None:
                bw = quantize_rtn(w, config.bits, config.block_size, config.symmetric)
                if module in config.imported:
                    bw.source = "rtn (gguf values differ)"
            label = f"{bw.source} int{bw.bits} block {bw.block_size}" + (" +offsets" if bw.offsets is not None else "")
            base = node.output[0]
            b = numpy_helper.from_array(_pack(bw.q, bw.bits), f"{base}.qweight")
            s = numpy_helper.from_array(bw.scales.reshape(-1), f"{base}.scales")
            zp = numpy_helper.from_array(_pack(bw.zero_points, bw.bits).reshape(-1), f"{base}.zero_points")
            model.graph.initializer.extend([b, s, zp])
            out = base if bw.offsets is None else f"{base}.nbits"
            nodes = [helper.make_node(
                "MatMulNBits", [node.input[0], b.name, s.name, zp.name], [out], name=f"{node.name}.nbits", domain=MS_DOMAIN,
                K=bw.k, N=bw.n, bits=bw.bits, block_size=bw.block_size, accuracy_level=config.accuracy_level)]
            if bw.offsets is not None:
                nodes += _offset_nodes(node.input[0], out, base, bw, bw.q.shape[1], model, shared)
            return nodes, label, bw.nbytes()

        counts, weight_bytes = replace_linear_layers(model, config, replace)
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        kernels = sorted(set(_nbits_shapes(model)))
        rows = [fewest_pass_rows(k, n, bits, block, config.accuracy_level) for k, n, bits, block in kernels]
        min_rows = None if None in rows else max(rows, default=1)
        if min_rows is None:
            logging.getLogger("specc").warning(
                "MatMulNBits with block %d at accuracy level %d computes a row differently in passes of different sizes "
                "on this CPU: greedy speculative output can differ from target-only output where two tokens nearly tie "
                "(docs/quantization.md)", config.block_size, config.accuracy_level)
        return {"bits": config.bits, "block_size": config.block_size, "accuracy_level": config.accuracy_level,
                "symmetric": config.symmetric, "layers": counts, "weight_bytes": weight_bytes,
                "rows_independent_of_pass_size": min_rows == 1, "min_pass_rows": min_rows}


def _nbits_shapes(model):
    from onnx import helper

    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
            yield a["K"], a["N"], a["bits"], a["block_size"]


def fewest_pass_rows(k: int, n: int, bits: int, block_size: int, accuracy_level: int) -> int | None:
    """From how many rows on does this MatMulNBits kernel give a row the same bits whatever the pass holds, on this
    machine: 1 (any pass), 2 (1-row passes differ, every larger pass agrees) or None (no pass size is enough)?

    Speculative verify runs k+1 rows where target-only decoding runs 1; a kernel that computes a row differently by
    pass size can flip a near-tied greedy choice. The answer depends on the CPU's kernels (docs/quantization.md):
    where it is 2, 1-row passes take a GEMV kernel of their own, and the runtime runs a 1-token pass as 2 rows
    (runtime/step.py). Compile records this; the runtime asks again
    where it runs (specc/hardware.py)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    bw = quantize_rtn(rng.normal(size=(n, k)).astype(np.float32), bits, block_size)
    inits = [numpy_helper.from_array(_pack(bw.q, bits), "B"), numpy_helper.from_array(bw.scales.reshape(-1), "S"),
             numpy_helper.from_array(_pack(bw.zero_points, bits).reshape(-1), "Z")]
    node = helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["y"], domain=MS_DOMAIN, K=k, N=n, bits=bits,
                            block_size=block_size, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS_DOMAIN, 1)])
    x = rng.normal(size=(9, k)).astype(np.float32)
    return next((rows for rows in (1, 2) if rows_match_small_passes(model, x, rows)), None)


def _offset_nodes(x: str, nbits_out: str, base: str, bw: BlockWeight, n_blocks: int, model, shared: dict) -> list:
    """y = MatMulNBits(x) + blocksum(x) @ offsetsᵀ, blocksum summing x over each block of inputs."""
    from onnx import helper, numpy_helper

    if bw.k != n_blocks * bw.block_size:
        raise ValueError(f"{base}: offsets need K ({bw.k}) to be whole blocks of {bw.block_size}")
    key = ("blocks", n_blocks, bw.block_size)
    if key not in shared:
        shape = numpy_helper.from_array(np.array([-1, n_blocks, bw.block_size], np.int64),
                                        f"blockshape_{n_blocks}_{bw.block_size}")
        model.graph.initializer.append(shape)
        shared[key] = shape.name
    if "axis" not in shared:
        axis = numpy_helper.from_array(np.array([-1], np.int64), "blocksum_axis")
        model.graph.initializer.append(axis)
        shared["axis"] = axis.name
    off = numpy_helper.from_array(np.ascontiguousarray(bw.offsets.T), f"{base}.offsets")
    model.graph.initializer.append(off)
    t = lambda suffix: f"{base}.{suffix}"  # noqa: E731
    return [
        helper.make_node("Reshape", [x, shared[key]], [t("blocks")], name=t("blocks")),
        helper.make_node("ReduceSum", [t("blocks"), shared["axis"]], [t("blocksum")], name=t("blocksum"), keepdims=0),
        helper.make_node("MatMul", [t("blocksum"), off.name], [t("offset_flat")], name=t("offset_flat")),
        helper.make_node("Shape", [nbits_out], [t("out_shape")], name=t("out_shape")),
        helper.make_node("Reshape", [t("offset_flat"), t("out_shape")], [t("offset")], name=t("offset")),
        helper.make_node("Add", [nbits_out, t("offset")], [base], name=t("add_offset")),
    ]
