"""quantize_int8_gemm (`target.quantize: int8-gemm`): linear layers onto ONNX Runtime's integer GEMM (`MatMulInteger`).

Weights are int8 with one scale per output channel (round to nearest of the float weight: for a
GGUF source, its dequantised values). Activations are quantised per row, in two 7-bit parts: with
s = max|x| / 63 over the row,

    x ≈ s · (hi + lo / 126)      hi = round(x / s),  lo = round((x / s - hi) · 126)

(about 13 bits relative to the row's largest value, so outlier channels do not flatten the
others). hi and lo rows go through one `MatMulInteger` as 2T rows of the pass (uint8, zero point 64)
and are recombined in float32: y = (acc_hi + acc_lo / 126) · s · scale_w.

Why 7 bits: without VNNI or AMX, ONNX Runtime's AVX2 u8 x s8 kernel adds pairs of products in 16
bits with saturation (`vpmaddubsw`), so two uint8 activations near 255 times weights near 127
overflow and the GEMM is wrong. Activations below 128 keep every pair under 2^15 on every CPU, so
a bundle computes the same bits wherever it runs.

Why an integer GEMM: at accuracy level 4, `MatMulNBits` pays for every extra row of a pass, while
the integer GEMM on AVX-512 VNNI reads the packed weights once per pass however many rows it holds
(docs/quantization.md), which is what a k+1-token verify wants. Rows are independent of the pass
size by construction: every step is a per-row or element-wise operation and the GEMM accumulates
exactly in int32, so a k+1-token verify gives each row the bits a 1-token decode gives it.

requires: no Transpose of a constant weight (fold_weight_transposes ran).
ensures:  no linear layer outside keep_float multiplies by a float weight.
"""
from __future__ import annotations

import itertools
import logging

import numpy as np

from .base import OnnxPass
from .kernel_rows import rows_match_small_passes
from .linear_layers import (LINEARS_QUANTISED, WEIGHT_TRANSPOSES_FOLDED, QuantConfig, merge_shared_input_linears,
                            replace_linear_layers)

QMAX = 63  # |hi|, |lo| <= 63: uint8 activations in [1, 127] around zero point 64 (see above)
LO = 2.0 * QMAX  # the low part's resolution: one step of hi in LO steps


def quantize_channels(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 weight [N, K] (values in [-127, 127]) and its float32 scale per output channel [N]."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(1) / 127
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def _activation_nodes(x: str, p: str, consts: dict) -> list:
    """x [..., T, K] float → p.xq [..., 2T, K] uint8 (hi rows then lo rows, zero point 64) and p.sx [..., T, 1]."""
    from onnx import helper

    t = lambda s: f"{p}.{s}"  # noqa: E731
    nodes = [
        helper.make_node("Abs", [x], [t("abs")]),
        helper.make_node("ReduceMax", [t("abs"), consts["last"]], [t("amax")], keepdims=1),
        helper.make_node("Max", [t("amax"), consts["tiny"]], [t("amax1")]),
        helper.make_node("Div", [t("amax1"), consts["qmax"]], [t("sx")]),
        helper.make_node("Div", [x, t("sx")], [t("xs")]),
        helper.make_node("Round", [t("xs")], [t("hi")]),
        helper.make_node("Sub", [t("xs"), t("hi")], [t("rest")]),
        helper.make_node("Mul", [t("rest"), consts["lo"]], [t("rest_lo")]),
        helper.make_node("Concat", [t("hi"), t("rest_lo")], [t("both")], axis=-2),
        # round half to even (lo; hi is already whole) and + 64, as Round, Add and Cast would do, in one operator
        helper.make_node("QuantizeLinear", [t("both"), consts["one"], consts["zp"]], [t("xq")]),
    ]
    for i, n in enumerate(nodes):
        n.name = f"{p}.{i}"
    return nodes


def _gemm_nodes(p: str, base: str, out: str, q_name: str, s_name: str, consts: dict) -> list:
    """p.xq @ int8 weight → out [..., T, N] float32."""
    from onnx import helper

    t = lambda s: f"{base}.{s}"  # noqa: E731
    return [
        helper.make_node("MatMulInteger", [f"{p}.xq", q_name, consts["zp"]], [t("acc")], name=t("mmi")),
        helper.make_node("Cast", [t("acc")], [t("accf")], to=1, name=t("cast")),
        helper.make_node("Split", [t("accf")], [t("acc_hi"), t("acc_lo")], axis=-2, num_outputs=2, name=t("split")),
        helper.make_node("Mul", [t("acc_lo"), consts["inv_lo"]], [t("acc_lo1")], name=t("scale_lo")),
        helper.make_node("Add", [t("acc_hi"), t("acc_lo1")], [t("acc_sum")], name=t("sum")),
        helper.make_node("Mul", [t("acc_sum"), s_name], [t("y_w")], name=t("scale_w")),
        helper.make_node("Mul", [t("y_w"), f"{p}.sx"], [out], name=t("scale_x")),
    ]


def _constants(model) -> dict:
    from onnx import numpy_helper

    values = {"last": np.array([-1], np.int64), "tiny": np.array(1e-30, np.float32), "qmax": np.array(QMAX, np.float32),
              "lo": np.array(LO, np.float32), "inv_lo": np.array(1 / LO, np.float32), "one": np.array(1, np.float32),
              "zp": np.array(QMAX + 1, np.uint8)}
    names = {}
    for key, value in values.items():
        names[key] = f"int8_gemm.{key}"
        model.graph.initializer.append(numpy_helper.from_array(value, names[key]))
    return names


class QuantizeInt8Gemm(OnnxPass):
    """Linear layers onto the integer GEMM: int8 weights per channel, activations in two 7-bit parts per row."""

    name = "quantize_int8_gemm"
    requires = (WEIGHT_TRANSPOSES_FOLDED,)
    ensures = (LINEARS_QUANTISED,)

    def __init__(self, config: QuantConfig):
        self.config = config

    def apply(self, model) -> dict:
        """Manifest facts: layer counts, layers merged, bytes of weights one pass reads, row independence."""
        from onnx import numpy_helper

        config = self.config
        merged = merge_shared_input_linears(model, config)  # from here on, one GEMM per activation
        consts = _constants(model)
        activations = itertools.count()

        def replace(node, w: np.ndarray, module: str):
            q, scale = quantize_channels(w)
            base = node.output[0]
            q_init = numpy_helper.from_array(np.ascontiguousarray(q.T), f"{base}.int8")
            s_init = numpy_helper.from_array(scale, f"{base}.channel_scales")
            model.graph.initializer.extend([q_init, s_init])
            p = f"int8_gemm.x{next(activations)}"
            nodes = (_activation_nodes(node.input[0], p, consts)
                     + _gemm_nodes(p, node.name, base, q_init.name, s_init.name, consts))
            return nodes, "int8 per channel", q.size + scale.nbytes

        counts, weight_bytes = replace_linear_layers(model, config, replace)
        invariant = rows_independent_of_pass_size()
        if not invariant:
            logging.getLogger("specc").warning(
                "the int8 GEMM computed a row differently in 1-token and multi-token passes on this CPU: greedy speculative "
                "output can differ from target-only output where two tokens nearly tie")
        return {"kind": config.kind, "bits": 8, "layers": counts, "merged_layers": merged, "weight_bytes": weight_bytes,
                "kernel": "MatMulInteger (u8 activations x s8 weights)", "rows_independent_of_pass_size": invariant,
                "min_pass_rows": 1 if invariant else None}


def rows_independent_of_pass_size(k: int = 1536, n: int = 256) -> bool:
    """Does the int8 GEMM give a row the same bits in a 1-row and in a multi-row pass on this machine?
    (It should by construction; compile checks and records it as for MatMulNBits.)"""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    q, scale = quantize_channels(rng.normal(size=(n, k)).astype(np.float32))
    graph = helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "t", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "t", n])],
                              [numpy_helper.from_array(np.ascontiguousarray(q.T), "W"), numpy_helper.from_array(scale, "S")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    consts = _constants(model)
    model.graph.node.extend(_activation_nodes("x", "a", consts) + _gemm_nodes("a", "g", "y", "W", "S", consts))
    x = (rng.normal(size=(1, 9, k)) * rng.choice([1.0, 30.0], size=k, p=[0.99, 0.01])).astype(np.float32)
    return rows_match_small_passes(model, x)
