"""compute_attention_in_fp64: ONNX `Attention` nodes compute in float64, so that a row's result does not
depend on how many tokens the pass holds.

ONNX Runtime's float32 attention picks different GEMM kernels for one query row (decode) and
several (verify, prefill); their sums differ by ~1e-6. In a float32 graph that stays ~1e-6. In a
MatMulNBits graph at accuracy level 4 the next layer quantises its activations to int8, and a
1e-6 change that crosses a rounding boundary becomes a whole quantum (~1e-2): the target's
greedy token after a k+1-token verify could differ from the one a 1-token pass picks. In float64
the shape-dependent error is ~1e-16, and rounding back to float32 removes it: the k+1-token
verify and the 1-token decode see the same numbers, so speculation stays exact relative to the
quantised target. Attention reads only the KV cache (small next to the weights at decode time).

ensures: no 4-D, mask-only `Attention` node left computing in float32 (causal or soft-capped ones,
  which this rewrite does not decompose, stay as they are).
"""
from __future__ import annotations

import numpy as np

from .base import OnnxPass, OnnxProperty

DOUBLE, FLOAT = 11, 1  # onnx.TensorProto.DOUBLE / FLOAT


def _heads(model, node) -> tuple[int, int] | None:
    """(query heads, kv heads) from the exporter's value infos or the node's shapes, if known."""
    shapes = {}
    for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    q, k = shapes.get(node.input[0]), shapes.get(node.input[1])
    if not q or not k or len(q) != 4 or len(k) != 4 or not q[1] or not k[1]:
        return None
    return q[1], k[1]


def _rewritable(model, node) -> tuple[int, int] | None:
    """(query heads, kv heads) of an `Attention` node this pass decomposes; None for any other node."""
    from onnx import helper

    if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if (len(node.input) > 4 or len(node.output) != 1 or attrs.get("is_causal", 0) or attrs.get("softcap", 0.0)
            or not attrs.get("scale")):
        return None
    return _heads(model, node)


def _no_float32_attention(model, _pass) -> bool:
    return not any(_rewritable(model, node) for node in model.graph.node)


class ComputeAttentionInFp64(OnnxPass):
    """Attention in float64 (cast in, decomposed, cast out): rows independent of the pass size."""

    name = "compute_attention_in_fp64"
    ensures = (OnnxProperty("no-float32-attention", _no_float32_attention,
                            "no 4-D, mask-only Attention node computing in float32"),)

    def apply(self, model) -> dict:
        """Manifest facts: {"attention_float64": nodes rewritten}."""
        from onnx import helper, numpy_helper

        new_nodes, replaced = [], 0
        for node in model.graph.node:
            heads = _rewritable(model, node)
            if heads is None:
                new_nodes.append(node)
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            hq, hkv = heads
            p = f"{node.name}.fp64"
            t = lambda s: f"{p}.{s}"  # noqa: E731

            def const(name: str, values) -> str:
                model.graph.initializer.append(numpy_helper.from_array(np.array(values, np.int64), t(name)))
                return t(name)

            q_group, by_q = const("kv_shape", [0, hkv, -1, 0]), const("q_shape", [0, hq, -1, 0])
            scale = numpy_helper.from_array(np.array(attrs["scale"], np.float64), t("scale"))
            model.graph.initializer.append(scale)
            q, k, v = node.input[:3]
            nodes = [
                helper.make_node("Cast", [q], [t("q")], to=DOUBLE),
                helper.make_node("Cast", [k], [t("k")], to=DOUBLE),
                helper.make_node("Cast", [v], [t("v")], to=DOUBLE),
                helper.make_node("Reshape", [t("q"), q_group], [t("qg")]),  # [B, Hkv, G*T, D]: q heads of one kv head
                helper.make_node("Transpose", [t("k")], [t("kt")], perm=[0, 1, 3, 2]),
                helper.make_node("MatMul", [t("qg"), t("kt")], [t("sg")]),
                helper.make_node("Reshape", [t("sg"), by_q], [t("s0")]),  # [B, Hq, T, S]
                helper.make_node("Mul", [t("s0"), scale.name], [t("s1")]),
            ]
            scores = t("s1")
            if len(node.input) == 4 and node.input[3]:
                mask = node.input[3]
                if _is_bool(model, mask):
                    ninf = numpy_helper.from_array(np.array(-np.inf, np.float64), t("ninf"))
                    model.graph.initializer.append(ninf)
                    nodes.append(helper.make_node("Where", [mask, scores, ninf.name], [t("s2")]))
                else:
                    nodes += [helper.make_node("Cast", [mask], [t("m")], to=DOUBLE),
                              helper.make_node("Add", [scores, t("m")], [t("s2")])]
                scores = t("s2")
            nodes += [
                helper.make_node("Softmax", [scores], [t("p")], axis=-1),
                helper.make_node("Reshape", [t("p"), q_group], [t("pg")]),
                helper.make_node("MatMul", [t("pg"), t("v")], [t("og")]),
                helper.make_node("Reshape", [t("og"), by_q], [t("o")]),
                helper.make_node("Cast", [t("o")], [node.output[0]], to=FLOAT),
            ]
            for i, n in enumerate(nodes):
                n.name = f"{p}.{i}"
            new_nodes += nodes
            replaced += 1
        del model.graph.node[:]
        model.graph.node.extend(new_nodes)
        return {"attention_float64": replaced}


def _is_bool(model, name: str) -> bool:
    for vi in list(model.graph.value_info) + list(model.graph.input):
        if vi.name == name:
            return vi.type.tensor_type.elem_type == 9  # BOOL
    for node in model.graph.node:
        if name in node.output and node.op_type in ("Less", "Greater", "Equal", "And", "Or", "Not", "LessOrEqual",
                                                    "GreaterOrEqual"):
            return True
    return False
