"""gate_in_int4_gemm: a gated MLP's SwiGLU, silu(gate) * up, moves into the Int4Gemm that computes gate and up side by
side (attribute glu), which then returns the gated product instead of the product (specc/kernels/csrc/glu.h).

quantize_int4_gemm merges the gate and up projections into one Int4Gemm and splits its output in two; the exported
SwiGLU then runs as a Split, a Sigmoid, and two Muls over the [tokens, 2 x intermediate] product. Through a prefill
chunk that product is larger than a core's cache, and those four operators read and write it over and over. In the
kernel, a large pass gates each tile of the product while it is still in cache, and a small one saves the four
operators' dispatch. Every pass of the graph runs the same kernel, so a row keeps the same bits in a pass of any
size; the gating's own bits are the kernel's (an exp polynomial), not ONNX Runtime's Sigmoid's.

requires: nothing (a graph without the pattern is left as it is: other activations, a product split unevenly or
  read elsewhere, halves not a multiple of 16 wide).
ensures:  no Split of an Int4Gemm into gate and up halves feeding Sigmoid(gate) * gate * up left.
"""
from __future__ import annotations

from ..kernels import DOMAIN, OP
from .base import OnnxPass, OnnxProperty
from .grouped_attention import replace_nodes

PANEL = 16  # the kernel gates whole panels of 16 columns


def _attr(node, name: str):
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def _halves_equal(model, split, n: int) -> bool:
    """Does the Split cut its last axis into two halves of n / 2?"""
    from onnx import numpy_helper

    if len(split.output) != 2 or _attr(split, "axis") != -1:
        return False
    if len(split.input) > 1 and split.input[1]:
        sizes = next((numpy_helper.to_array(i) for i in model.graph.initializer if i.name == split.input[1]), None)
        return sizes is not None and [int(s) for s in sizes] == [n // 2, n // 2]
    return _attr(split, "num_outputs") == 2


def _swiglu_after(model, node, consumers, outputs) -> tuple[list, str] | None:
    """The Split, Sigmoid and Muls of silu(gate) * up over an Int4Gemm's output, and the name of the gated result;
    None where the pattern does not hold exactly (each intermediate read by the pattern alone, none a graph output)."""
    n = _attr(node, "N")
    if node.op_type != OP or node.domain != DOMAIN or _attr(node, "glu") or not n or n % (2 * PANEL):
        return None

    def only(name: str, count: int = 1):
        users = consumers.get(name, [])
        return users if len(users) == count and name not in outputs else None

    split = only(node.output[0])
    if split is None or split[0].op_type != "Split" or not _halves_equal(model, split[0], n):
        return None
    gate, up = split[0].output
    gate_users = only(gate, 2)
    if gate_users is None:
        return None
    sigmoid = next((u for u in gate_users if u.op_type == "Sigmoid"), None)
    silu = next((u for u in gate_users if u.op_type == "Mul"), None)
    if sigmoid is None or silu is None or sorted(silu.input) != sorted([gate, sigmoid.output[0]]):
        return None
    product = only(silu.output[0])
    if (only(sigmoid.output[0]) != [silu] or product is None or product[0].op_type != "Mul"
            or sorted(product[0].input) != sorted([silu.output[0], up]) or only(up) != product):
        return None
    return [split[0], sigmoid, silu, product[0]], product[0].output[0]


def _matches(model) -> list:
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in model.graph.output}
    found = ((node, _swiglu_after(model, node, consumers, outputs)) for node in model.graph.node)
    return [(node, match) for node, match in found if match is not None]


def _none_left(model, _pass) -> bool:
    return not _matches(model)


class GateInInt4Gemm(OnnxPass):
    """Split -> Sigmoid -> Mul -> Mul (SwiGLU) over a merged gate-and-up Int4Gemm onto its glu attribute."""

    name = "gate_in_int4_gemm"
    ensures = (OnnxProperty("swiglu-in-kernel", _none_left,
                            "no SwiGLU over an Int4Gemm's gate and up halves outside the kernel"),)

    def apply(self, model) -> dict:
        """Manifest facts: {"gated_in_kernel": Int4Gemm nodes that now gate their product}."""
        from onnx import helper

        matches = _matches(model)
        gone = {id(n) for _, (nodes, _) in matches for n in nodes}
        gated = {id(node): out for node, (_, out) in matches}

        def rewrite(node) -> list | None:
            if id(node) in gone:
                return []
            if id(node) not in gated:
                return None
            node.output[0] = gated[id(node)]
            node.attribute.append(helper.make_attribute("glu", 1))
            return [node]

        replace_nodes(model, rewrite)
        used = {name for node in model.graph.node for name in node.input}
        for init in [i for i in model.graph.initializer if i.name.endswith(".sizes") and i.name not in used]:
            model.graph.initializer.remove(init)
        return {"gated_in_kernel": len(matches)}
