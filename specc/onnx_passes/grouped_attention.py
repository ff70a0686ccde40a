"""Shared by the attention passes: which `Attention` nodes they decompose, and the grouped-query form they emit.

The grouped form computes a kv head's query heads as rows of one MatMul (`[B, Hkv, G*T, D]` against
`[B, Hkv, D, S]`), so keys and values are never repeated per query head.
"""
from __future__ import annotations

import numpy as np

BOOL, DOUBLE, FLOAT = 9, 11, 1  # onnx.TensorProto.BOOL / DOUBLE / FLOAT


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


def rewritable(model, node) -> tuple[int, int] | None:
    """(query heads, kv heads) of a 4-D, mask-only `Attention` node the passes decompose; None for any other node
    (causal or soft-capped ones stay as they are)."""
    from onnx import helper

    if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if (len(node.input) > 4 or len(node.output) != 1 or attrs.get("is_causal", 0) or attrs.get("softcap", 0.0)
            or not attrs.get("scale")):
        return None
    return _heads(model, node)


def no_float32_attention(model, _pass) -> bool:
    return not any(rewritable(model, node) for node in model.graph.node)


def scale_of(node) -> float:
    from onnx import helper

    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == "scale")


def is_bool(model, name: str) -> bool:
    for vi in list(model.graph.value_info) + list(model.graph.input):
        if vi.name == name:
            return vi.type.tensor_type.elem_type == BOOL
    for node in model.graph.node:
        if name in node.output and node.op_type in ("Less", "Greater", "Equal", "And", "Or", "Not", "LessOrEqual",
                                                    "GreaterOrEqual"):
            return True
    return False


def replace_nodes(model, rewrite) -> int:
    """Rebuild the graph's node list in order, each node replaced by `rewrite(node)` (a list of nodes) or kept where
    that is None; returns how many nodes were replaced."""
    new_nodes, replaced = [], 0
    for node in model.graph.node:
        nodes = rewrite(node)
        if nodes is None:
            new_nodes.append(node)
            continue
        new_nodes += nodes
        replaced += 1
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return replaced


def grouped_attention(model, t, q: str, k: str, v: str, mask: str | None, bool_mask: bool, heads: tuple[int, int],
                      scale: float, out: str, dtype: int = FLOAT) -> list:
    """Nodes computing `out` = softmax(q kᵀ · scale + mask) v in `dtype` (q, k, v already in it), the mask boolean
    (where to attend) or additive (cast to `dtype`). `t(s)` names this rewrite's tensors; constants go into
    `model`'s initializers."""
    from onnx import helper, numpy_helper

    hq, hkv = heads
    np_dtype = np.float64 if dtype == DOUBLE else np.float32

    def const(name: str, array: np.ndarray) -> str:
        model.graph.initializer.append(numpy_helper.from_array(array, t(name)))
        return t(name)

    q_group = const("kv_shape", np.array([0, hkv, -1, 0], np.int64))
    by_q = const("q_shape", np.array([0, hq, -1, 0], np.int64))
    nodes = [
        helper.make_node("Reshape", [q, q_group], [t("qg")]),  # [B, Hkv, G*T, D]: the q heads of one kv head
        helper.make_node("Transpose", [k], [t("kt")], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", [t("qg"), t("kt")], [t("sg")]),
        helper.make_node("Reshape", [t("sg"), by_q], [t("s0")]),  # [B, Hq, T, S]
        helper.make_node("Mul", [t("s0"), const("scale", np.array(scale, np_dtype))], [t("s1")]),
    ]
    scores = t("s1")
    if mask:
        if bool_mask:
            nodes.append(helper.make_node("Where", [mask, scores, const("ninf", np.array(-np.inf, np_dtype))],
                                          [t("s2")]))
        else:
            nodes += [helper.make_node("Cast", [mask], [t("m")], to=dtype),
                      helper.make_node("Add", [scores, t("m")], [t("s2")])]
        scores = t("s2")
    return nodes + [
        helper.make_node("Softmax", [scores], [t("p")], axis=-1),
        helper.make_node("Reshape", [t("p"), q_group], [t("pg")]),
        helper.make_node("MatMul", [t("pg"), v], [t("og")]),
        helper.make_node("Reshape", [t("og"), by_q], [out]),
    ]
