"""feed_cache_by_layer: each layer reads its own cache inputs, `k_cache.<i>` and `v_cache.<i>` [B, H, S, D],
instead of selecting its slice of `k_cache` / `v_cache` [L, B, H, S, D] inside the graph.

ONNX Runtime has no views: the exported `Gather(k_cache, i)` copies the layer's slice, so every pass
copied the whole cache once more before attending to it, the largest cost of a decode step at long
contexts. Layer slices of the runtime's cache tensor are contiguous, so the runner feeds them as
separate inputs without a copy (`by_layer`); the bundle's step-graph ABI is unchanged.

requires: k_cache / v_cache have a fixed layer count, and each use of them is a Gather of a constant scalar on axis 0, or a Shape.
ensures:  no graph input k_cache / v_cache; inputs `<name>.0` ... `<name>.<L-1>` in their place, in layer order.
"""
from __future__ import annotations

import numpy as np

from .base import OnnxPass, OnnxProperty

CACHE_INPUTS = ("k_cache", "v_cache")


def layer_input(name: str, layer: int) -> str:
    """The ONNX input that holds one layer of a stacked cache input."""
    return f"{name}.{layer}"


def stacked_input(name: str) -> str | None:
    """The stacked cache input a per-layer input belongs to (`k_cache.3` -> `k_cache`); None for any other name."""
    stacked, _, layer = name.rpartition(".")
    return stacked if stacked in CACHE_INPUTS and layer.isdigit() else None


def by_layer(name: str, stacked, layers: int) -> list[tuple[str, object]]:
    """A stacked cache input's feeds for a graph that takes it by layer: (input name, its layer slice)."""
    return [(layer_input(name, i), stacked[i]) for i in range(layers)]


def _constants(model) -> dict[str, np.ndarray]:
    from onnx import helper, numpy_helper

    # small initializers only: the weights live in external data, which an index never does
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.data_location != 1}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(helper.get_attribute_value(node.attribute[0]))
    return values


def _layer_of(node, constants) -> int | None:
    """The layer a Gather on axis 0 with a constant scalar index selects; None for any other node."""
    if node.op_type != "Gather" or next((a.i for a in node.attribute if a.name == "axis"), 0) != 0:
        return None
    index = constants.get(node.input[1])
    return int(index) if index is not None and index.ndim == 0 else None


def _uses_are_layer_selects(model, _pass) -> bool:
    constants = _constants(model)
    stacked = [i for i in model.graph.input if i.name in CACHE_INPUTS]
    fixed = all(i.type.tensor_type.shape.dim[0].dim_value > 0 for i in stacked)
    return fixed and all(node.op_type == "Shape" or _layer_of(node, constants) is not None
                         for node in model.graph.node for name in node.input if name in CACHE_INPUTS)


def _no_stacked_cache_input(model, _pass) -> bool:
    return not any(i.name in CACHE_INPUTS for i in model.graph.input)


class FeedCacheByLayer(OnnxPass):
    """Stacked cache inputs split into one input per layer, fed as views of the runtime's cache."""

    name = "feed_cache_by_layer"
    requires = (OnnxProperty("cache-uses-are-layer-selects", _uses_are_layer_selects,
                             "k_cache / v_cache with a fixed layer count, read only by constant-index "
                             "Gathers on axis 0 and Shapes"),)
    ensures = (OnnxProperty("no-stacked-cache-input", _no_stacked_cache_input, "no k_cache / v_cache graph input"),)

    def apply(self, model) -> dict:
        """Manifest facts: {"cache_by_layer": L}, the layers of its stacked cache inputs, when the graph had any."""
        from onnx import helper

        stacked = {i.name: i for i in model.graph.input if i.name in CACHE_INPUTS}
        if not stacked:
            return {}
        constants = _constants(model)
        replace: dict[str, str] = {}  # a Gather's output -> the layer input that replaces it
        dropped: set[str] = set()
        nodes = []
        for node in model.graph.node:
            source = next((n for n in node.input if n in stacked), None)
            if source is None:
                nodes.append(node)
            elif node.op_type == "Shape":
                nodes += _layer_shape(node, source, stacked[source], helper)
            else:
                replace[node.output[0]] = layer_input(source, _layer_of(node, constants))
                dropped.add(node.input[1])
        for node in nodes:
            for j, name in enumerate(node.input):
                if name in replace:
                    node.input[j] = replace[name]
        for out in model.graph.output:  # a selected layer returned as it is (not a step graph's case, but valid ONNX)
            if out.name in replace:
                nodes.append(helper.make_node("Identity", [replace[out.name]], [out.name]))
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        used = {name for node in nodes for name in node.input}
        for init in [i for i in model.graph.initializer if i.name in dropped and i.name not in used]:
            model.graph.initializer.remove(init)  # a removed Gather's layer number
        inputs, layers = [], 0
        for value in model.graph.input:
            if value.name not in stacked:
                inputs.append(value)
                continue
            dims = value.type.tensor_type.shape.dim
            layers = dims[0].dim_value
            for layer in range(layers):
                inputs.append(helper.make_tensor_value_info(
                    layer_input(value.name, layer), value.type.tensor_type.elem_type,
                    [d.dim_param or d.dim_value for d in dims[1:]]))
        del model.graph.input[:]
        model.graph.input.extend(inputs)
        return {"cache_by_layer": layers}


def _layer_shape(node, source: str, value, helper) -> list:
    """Shape(stacked cache)[start:end] from layer 0's input: dims after the first shift by one, the first is L."""
    attrs = {a.name: a.i for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end")
    rank = len(value.type.tensor_type.shape.dim)
    start = start + rank if start < 0 else start
    end = rank if end is None else (end + rank if end < 0 else min(end, rank))
    layers = value.type.tensor_type.shape.dim[0].dim_value
    first = layer_input(source, 0)
    if start >= 1:
        return [helper.make_node("Shape", [first], list(node.output), name=node.name, start=start - 1, end=end - 1)]
    rest = f"{node.output[0]}.rest"
    return [helper.make_node("Constant", [], [f"{node.output[0]}.layers"], name=f"{node.name}.layers",
                             value=helper.make_tensor("layers", 7, [1], [layers])),
            helper.make_node("Shape", [first], [rest], name=node.name, start=0, end=max(end - 1, 0)),
            helper.make_node("Concat", [f"{node.output[0]}.layers", rest], list(node.output), name=f"{node.name}.cat",
                             axis=0)]
