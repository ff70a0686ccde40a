"""attend_at_cache_positions: a chain graph's `Attention` nodes read each key at its token's position in the
sequence and compute in float32, so that a row's result does not depend on how many tokens the pass holds.

A step graph attends over `[cache (S slots, the first cache_len valid) ; new tokens (T)]`, so a new token's
key sits at index S + j in the pass that computes it and at its position cache_len + j in every pass after.
Float32 sums taken in another order round differently, and in a quantised graph the next layer's int8
activation quantisation can turn that 1e-7 into a flipped greedy token (compute_attention_in_fp64.py says
more). This rewrite writes each new token's key and value into a copy of the cache at its position
(`position_ids`, which in a chain are the tokens' cache slots; ScatterND in place of the Concat) and permutes
the mask the same way, so every query row sums
the same keys at the same indices, in order, with only masked (zero) terms after them, whatever the pass size;
it then attends in the grouped float32 form, whose rows MatMul computes alike in passes of 1 to 64 tokens.
It copies the cache once, where the float64 fallback casts it three times over. The runtime gives every
pass room for its tokens (StepRunner); the copies of a row's last token that pad a short pass share that
token's position and values, so they write the same slot with the same bits.

A tree pass puts sibling drafts at consecutive indices, not at their depth's position, so graphs with a
`tree_mask` input are left to compute_attention_in_fp64, as are nodes whose keys are not a
`Concat(cache, new)` on the sequence axis or whose mask is not boolean (attention sinks).

requires: nothing (a graph without `cache_len` and `position_ids` inputs, or with a `tree_mask` one, is left as
  it is).
ensures:  in a chain graph, no 4-D, mask-only `Attention` node over `Concat(cache, new)` keys.
"""
from __future__ import annotations

import numpy as np

from .base import OnnxPass, OnnxProperty
from .grouped_attention import grouped_attention, is_bool, replace_nodes, rewritable, scale_of


def is_chain_graph(model) -> bool:
    names = {i.name for i in model.graph.input}
    return {"cache_len", "position_ids"} <= names and "tree_mask" not in names


def _concat_parts(model, name: str) -> tuple[str, str] | None:
    """(cache, new) when `name` is Concat(cache, new) on axis 2 (the sequence axis of [B, H, S, D])."""
    from onnx import helper

    for node in model.graph.node:
        if name in node.output and node.op_type == "Concat" and len(node.input) == 2:
            axis = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "axis")
            return (node.input[0], node.input[1]) if axis in (2, -2) else None
    return None


def cache_attention_parts(model, node) -> tuple[tuple[int, int], tuple[str, str], tuple[str, str]] | None:
    """(heads, (cached keys, new keys), (cached values, new values)) of an Attention node this pass rewrites."""
    heads = rewritable(model, node)
    if heads is None or len(node.input) != 4 or not node.input[3] or not is_bool(model, node.input[3]):
        return None
    k, v = _concat_parts(model, node.input[1]), _concat_parts(model, node.input[2])
    return (heads, k, v) if k and v else None


def _none_left(model, _pass) -> bool:
    return not is_chain_graph(model) or not any(cache_attention_parts(model, node) for node in model.graph.node)


class AttendAtCachePositions(OnnxPass):
    """Keys at their tokens' positions, attention in float32: rows independent of the pass size.

    fused_above: passes of more tokens than this (prefill chunks) keep ONNX Runtime's fused operator, which
    tiles the scores instead of writing them out (an `If` on the pass size): their rows may then differ in the
    last bits from a 1-token pass's, which a float32 target's prefill can afford and a quantised one's cannot
    (its int8 activations would turn that into different prompt KV from one chunking to another)."""

    name = "attend_at_cache_positions"
    ensures = (OnnxProperty("keys-at-positions", _none_left,
                            "no float32 Attention over [cache ; new] keys left in a chain graph"),)

    def __init__(self, fused_above: int | None = None):
        self.fused_above = fused_above

    def apply(self, model) -> dict:
        """Manifest facts: {"attention_at_positions": nodes rewritten} (and "attention_fused_above")."""
        from onnx import helper, numpy_helper

        if not is_chain_graph(model):
            return {"attention_at_positions": 0}
        shared: dict[str, str] = {}
        init = model.graph.initializer

        def const(name: str, values) -> str:
            name = f"attend_at_positions.{name}"
            if name not in shared:
                init.append(numpy_helper.from_array(np.array(values, np.int64), name))
                shared[name] = name
            return name

        def rewrite(node) -> list | None:
            found = cache_attention_parts(model, node)
            if found is None:
                return None
            heads, (cache_k, new_k), (cache_v, new_v) = found
            q, _, _, mask = node.input
            p = f"{node.name}.at_positions"
            t = lambda s: f"{p}.{s}"  # noqa: E731
            first = []  # computed once, in the main graph before the first layer that reads it, for every layer
            if "perm" not in shared:
                first += _permutation(cache_k, const, "attend_at_positions")
                shared["perm"] = "attend_at_positions.perm"
            scatter = f"attend_at_positions.scatter.{heads[1]}"
            if scatter not in shared:
                first += _scatter_index(new_k, const, scatter)
                shared[scatter] = scatter
            nodes = [
                helper.make_node("Unsqueeze", [shared["perm"], const("axes12", [1, 2])], [t("perm4")]),
                helper.make_node("Shape", [mask], [t("mask_rows")], start=0, end=3),
                helper.make_node("Shape", [cache_k], [t("slots")], start=2, end=3),
                helper.make_node("Concat", [t("mask_rows"), t("slots")], [t("mask_shape")], axis=0),
                helper.make_node("Expand", [t("perm4"), t("mask_shape")], [t("mask_index")]),
                helper.make_node("GatherElements", [mask, t("mask_index")], [t("mask")], axis=3),
                helper.make_node("ScatterND", [cache_k, scatter, new_k], [t("k")]),
                helper.make_node("ScatterND", [cache_v, scatter, new_v], [t("v")]),
            ]
            out = node.output[0] if self.fused_above is None else t("out")
            nodes += grouped_attention(model, t, q, t("k"), t("v"), t("mask"), True, heads, scale_of(node), out)
            for i, n in enumerate(nodes):
                n.name = n.name or f"{p}.{i}"
            if self.fused_above is not None:
                if "wide" not in shared:
                    first += _wider_than(q, const("fused_above", self.fused_above), "attend_at_positions.wide")
                    shared["wide"] = "attend_at_positions.wide"
                nodes = [_if_wide(shared["wide"], node, (cache_k, new_k), (cache_v, new_v), nodes, out, p)]
            return first + nodes

        replaced = replace_nodes(model, rewrite)
        drop_unused_concats(model)
        facts = {"attention_at_positions": replaced}
        return facts if self.fused_above is None else {**facts, "attention_fused_above": self.fused_above}


def _wider_than(q: str, limit: str, name: str) -> list:
    """`name`: a scalar bool, whether the pass holds more than `limit` tokens."""
    from onnx import helper

    nodes = [helper.make_node("Shape", [q], [f"{name}.t"], start=2, end=3),
             helper.make_node("Squeeze", [f"{name}.t"], [f"{name}.t0"]),
             helper.make_node("Greater", [f"{name}.t0", limit], [name])]
    for i, n in enumerate(nodes):
        n.name = f"{name}.{i}"
    return nodes


def _if_wide(wide: str, attention, keys: tuple[str, str], values: tuple[str, str], positioned: list, out: str,
             prefix: str):
    """If(wide): the original fused Attention over [cache ; new]; else the positioned nodes."""
    from onnx import TensorProto, helper

    fused = helper.make_node("Attention", [attention.input[0], f"{prefix}.keys", f"{prefix}.values",
                                           attention.input[3]], [f"{prefix}.fused"], name=f"{prefix}.fused",
                             **{a.name: helper.get_attribute_value(a) for a in attention.attribute})
    then_nodes = [helper.make_node("Concat", list(keys), [f"{prefix}.keys"], axis=2, name=f"{prefix}.keys"),
                  helper.make_node("Concat", list(values), [f"{prefix}.values"], axis=2, name=f"{prefix}.values"),
                  fused]

    def branch(name: str, nodes: list, result: str):
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(result, TensorProto.FLOAT, None)])

    return helper.make_node("If", [wide], [attention.output[0]], name=f"{prefix}.if",
                            then_branch=branch(f"{prefix}.then", then_nodes, f"{prefix}.fused"),
                            else_branch=branch(f"{prefix}.else", positioned, out))


def drop_unused_concats(model) -> None:
    """Remove the Concats of cache and new tokens nothing reads any more."""
    nodes = model.graph.node
    while True:
        used = {i for n in nodes for i in _reads(n)} | {o.name for o in model.graph.output}
        dead = [n for n in nodes if n.op_type == "Concat" and not any(o in used for o in n.output)]
        if not dead:
            return
        for n in dead:
            nodes.remove(n)


def _reads(node) -> set[str]:
    """The names a node reads, those its subgraphs read from the enclosing graph included."""
    names = set(node.input)
    for a in node.attribute:
        if a.type == a.GRAPH:
            for n in a.g.node:
                names |= _reads(n)
    return names


def _permutation(cache: str, const, prefix: str) -> list:
    """`<prefix>.perm` [B, S]: for each cache slot of the positioned keys, the index of the mask's
    [cache ; new] columns it takes.

    Slot i < cache_len keeps its own column, cache_len <= i <= the row's last position takes new token
    i - cache_len (column S + i - cache_len), and the rest keep their own (slots past cache_len, so masked).
    The copies of a row's last token that pad a short pass hold its position: no slot maps to their
    columns, so they attend to what that token attends to and compute its values."""
    from onnx import helper

    t = lambda s: f"{prefix}.{s}"  # noqa: E731
    nodes = [
        helper.make_node("Shape", [cache], [t("s")], start=2, end=3),
        helper.make_node("Squeeze", [t("s")], [t("s0")]),
        helper.make_node("Range", [const("zero", 0), t("s0"), const("one", 1)], [t("i")]),
        helper.make_node("Unsqueeze", [t("i"), const("axes0", [0])], [t("row")]),  # [1, S]
        helper.make_node("Unsqueeze", ["cache_len", const("axes1", [1])], [t("len")]),  # [B, 1]
        helper.make_node("ReduceMax", ["position_ids", const("axes1", [1])], [t("last")], keepdims=1),  # [B, 1]
        helper.make_node("Add", [t("last"), const("one", 1)], [t("end")]),
        helper.make_node("Less", [t("row"), t("len")], [t("in_cache")]),
        helper.make_node("Less", [t("row"), t("end")], [t("in_new")]),
        helper.make_node("Sub", [t("row"), t("len")], [t("j")]),
        helper.make_node("Add", [t("j"), t("s")], [t("from_new")]),
        helper.make_node("Where", [t("in_new"), t("from_new"), t("row")], [t("past")]),
        helper.make_node("Where", [t("in_cache"), t("row"), t("past")], [t("perm")]),
    ]
    for i, n in enumerate(nodes):
        n.name = f"{prefix}.perm.{i}"
    return nodes


def _scatter_index(new: str, const, name: str) -> list:
    """`name` [B, Hkv, T, 3]: (row, kv head, position) for each new token, where ScatterND puts it."""
    from onnx import helper

    t = lambda s: f"{name}.{s}"  # noqa: E731
    nodes = [
        helper.make_node("Shape", [new], [t("bht")], start=0, end=3),
        helper.make_node("Concat", [t("bht"), const("one_dim", [1])], [t("shape")], axis=0),  # [B, Hkv, T, 1]
        helper.make_node("Shape", [new], [t("b")], start=0, end=1),
        helper.make_node("Shape", [new], [t("h")], start=1, end=2),
    ]
    for axis, dims in (("b", [-1, 1, 1, 1]), ("h", [1, -1, 1, 1])):
        nodes += [helper.make_node("Squeeze", [t(axis)], [t(f"{axis}0")]),
                  helper.make_node("Range", [const("zero", 0), t(f"{axis}0"), const("one", 1)], [t(f"{axis}r")]),
                  helper.make_node("Reshape", [t(f"{axis}r"), const(f"dims_{axis}", dims)], [t(f"{axis}4")])]
    nodes += [
        helper.make_node("Unsqueeze", ["position_ids", const("axes13", [1, 3])], [t("pos4")]),  # [B, 1, T, 1]
        helper.make_node("Expand", [t("b4"), t("shape")], [t("bi")]),
        helper.make_node("Expand", [t("h4"), t("shape")], [t("hi")]),
        helper.make_node("Expand", [t("pos4"), t("shape")], [t("pi")]),
        helper.make_node("Concat", [t("bi"), t("hi"), t("pi")], [name], axis=3),
    ]
    for i, n in enumerate(nodes):
        n.name = f"{name}.{i}"
    return nodes
