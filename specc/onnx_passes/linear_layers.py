"""The linear layers of an exported ONNX graph, and what the passes that quantise them share: their
settings (`QuantConfig`), finding each layer's MatMul, replacing it, and the properties their contracts name."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import numpy as np

from .base import OnnxProperty


@dataclass
class QuantConfig:
    bits: int
    block_size: int = 32
    accuracy_level: int = 4
    symmetric: bool = True
    keep_float: tuple[str, ...] = ()  # module names (fnmatch patterns) left in float32
    kind: str = ""  # the recipe's target.quantize (int8, int4, fp8, int8-gemm)
    imported: dict = field(default_factory=dict)  # module name -> candidate BlockWeights read from a GGUF

    def keeps(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, p) for p in self.keep_float)


def linear_module(node) -> str | None:
    """The module path (e.g. layers.3.mlp.down_proj, lm_head) of an exported linear layer's MatMul."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = [s.strip(" '\"") for s in prop.value.strip("[]").split(",")]
            return scopes[-2] if len(scopes) >= 2 and scopes[-1].startswith("linear") else None
    return None


def linear_weight(node, inits: dict):
    """The constant 2-D weight [K, N] initializer a MatMul multiplies by, or None."""
    weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
    return weight if weight is not None and len(weight.dims) == 2 else None


def float_linear_modules(model) -> list[str]:
    """The modules whose linear layer still multiplies by a constant float weight."""
    inits = {i.name: i for i in model.graph.initializer}
    return [m for node in model.graph.node if linear_weight(node, inits) is not None
            for m in [linear_module(node)] if m is not None]


def replace_linear_layers(model, config: QuantConfig, replace) -> tuple[dict, int]:
    """Rewrite, in place, every MatMul of a constant [K, N] weight whose exporter scope names a linear module not
    kept in float32: `replace(node, w [N, K], module)` returns (its nodes, a label, bytes a pass reads). Returns
    (layer counts by label, float32 kept layers included; bytes of weights one pass reads)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    consumers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    new_nodes, counts = [], {}
    weight_bytes = 0
    for node in model.graph.node:
        weight = linear_weight(node, inits)
        module = linear_module(node) if weight is not None else None
        if module is None or config.keeps(module):
            new_nodes.append(node)
            if weight is not None:
                counts["float32"] = counts.get("float32", 0) + 1
                weight_bytes += int(np.prod(weight.dims)) * 4
            continue
        nodes, label, nbytes = replace(node, numpy_helper.to_array(weight).T, module)
        new_nodes.extend(nodes)
        counts[label] = counts.get(label, 0) + 1
        weight_bytes += nbytes
        consumers[node.input[1]] -= 1
        if consumers[node.input[1]] == 0:
            model.graph.initializer.remove(weight)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return counts, weight_bytes


def merge_shared_input_linears(model, config: QuantConfig) -> int:
    """Linear layers that read one activation (q, k and v; gate and up) → one MatMul over their weights side by
    side and a Split back into their outputs (in place); returns how many layers were merged into another.

    Every output channel keeps its own weights and, quantised per channel, its own scale, so every output has
    the bits it had; a pass runs one GEMM and one recombination where it ran two or three (docs/quantization.md)."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    groups: dict[str, list] = {}
    for node in model.graph.node:
        module = linear_module(node) if linear_weight(node, inits) is not None else None
        if module is not None and not config.keeps(module):
            groups.setdefault(node.input[0], []).append(node)
    merged_weights: set[str] = set()
    replaced: dict[str, list] = {}  # first member's output -> [MatMul, Split]; other members' -> []
    for x, members in groups.items():
        if len(members) < 2:
            continue
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in members]  # [K, N_i]
        name = f"{members[0].output[0]}.merged"
        w_init = numpy_helper.from_array(np.concatenate(weights, axis=1), f"{name}.weight")
        sizes = numpy_helper.from_array(np.array([w.shape[1] for w in weights], np.int64), f"{name}.sizes")
        model.graph.initializer.extend([w_init, sizes])
        matmul = helper.make_node("MatMul", [x, w_init.name], [f"{name}.out"], name=name)
        modules = "+".join(linear_module(n) for n in members)
        matmul.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=f"['', '{modules}', 'linear']")
        split = helper.make_node("Split", [matmul.output[0], sizes.name], [n.output[0] for n in members], axis=-1,
                                 name=f"{name}.outputs")
        replaced[members[0].output[0]] = [matmul, split]
        replaced.update({n.output[0]: [] for n in members[1:]})
        merged_weights.update(n.input[1] for n in members)
    if not replaced:
        return 0
    nodes = [m for node in model.graph.node for m in replaced.get(node.output[0], [node])]
    used = {name for node in nodes for name in node.input}
    for init in [i for i in model.graph.initializer if i.name in merged_weights and i.name not in used]:
        model.graph.initializer.remove(init)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return sum(1 for v in replaced.values() if not v)


def _no_initializer_transposes(model, _pass) -> bool:
    inits = {i.name for i in model.graph.initializer}
    return not any(n.op_type == "Transpose" and n.input[0] in inits for n in model.graph.node)


def _only_kept_linears_float(model, quantiser) -> bool:
    return all(quantiser.config.keeps(m) for m in float_linear_modules(model))


WEIGHT_TRANSPOSES_FOLDED = OnnxProperty(
    "weight-transposes-folded", _no_initializer_transposes,
    "no Transpose of a constant weight")  # a tied LM head reads the embedding transposed: folded, it is a weight too
LINEARS_QUANTISED = OnnxProperty(
    "linears-quantised", _only_kept_linears_float,
    "no linear layer outside keep_float multiplying by a float weight")
