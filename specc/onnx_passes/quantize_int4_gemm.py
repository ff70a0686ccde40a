"""quantize_int4_gemm (`target.quantize: int4-gemm`): linear layers onto specc's own kernel, `ai.specc::Int4Gemm`.

Weights are 4-bit in blocks of 32 with an fp16 scale (and an fp16 offset where the format has one): a GGUF's own
Q4_0, Q4_1 and Q4_K blocks where they dequantise bit for bit to the graph's weight, round to nearest (symmetric,
Q4_0's rule) for every other layer, a GGUF's 6- and 8-bit blocks included. Activations are quantised to int8 per
row and superblock of 256 inputs inside the kernel, and the block dot products are exact int32 sums combined in a fixed order
(specc/kernels/csrc/q4gemm.h): a row's output has the same bits in a pass of any size, on every ISA's kernel.

Layers that read one activation (q, k, v; gate, up) are merged into one operator and split after it, so a pass
quantises each activation once; every output keeps its own weights.

requires: no Transpose of a constant weight (fold_weight_transposes ran).
ensures:  no linear layer outside keep_float multiplies by a float weight; the ai.specc opset is imported.
"""
from __future__ import annotations

import numpy as np

from ..block_weights import BlockWeight, exact_match, quantize_rtn
from ..kernels import DOMAIN, OP, active_isa, register_with
from ..kernels.pack import BLOCK, LAYOUT, pack_int4, packable
from .base import OnnxPass, OnnxProperty
from .kernel_rows import rows_match_small_passes
from .linear_layers import (LINEARS_QUANTISED, WEIGHT_TRANSPOSES_FOLDED, QuantConfig, merge_shared_input_linears,
                            replace_linear_layers)


def _imports_domain(model, _pass) -> bool:
    return any(o.domain == DOMAIN for o in model.opset_import)


class QuantizeInt4Gemm(OnnxPass):
    """Linear layers onto Int4Gemm: 4-bit block-32 weights (a GGUF's own where they fit), int8 activations."""

    name = "quantize_int4_gemm"
    requires = (WEIGHT_TRANSPOSES_FOLDED,)
    ensures = (LINEARS_QUANTISED, OnnxProperty(f"opset:{DOMAIN}", _imports_domain, f"the {DOMAIN} opset imported"))

    def __init__(self, config: QuantConfig):
        self.config = config

    def apply(self, model) -> dict:
        """Manifest facts: layer counts by weight source, layers merged, bytes of weights one pass reads."""
        from onnx import helper, numpy_helper

        config = self.config
        merged = merge_shared_input_linears(model, config)

        def replace(node, w: np.ndarray, module: str):
            bw, sources = _block_weight(module, w, config)
            packed = pack_int4(bw)
            base = node.output[0]
            init = numpy_helper.from_array(packed.data, f"{base}.int4")
            model.graph.initializer.append(init)
            op = helper.make_node(OP, [node.input[0], init.name], [base], name=f"{node.name}.int4", domain=DOMAIN,
                                  N=packed.n, K=packed.k, offsets=int(packed.offsets), layout=LAYOUT)
            return [op], "+".join(sorted(set(sources))), packed.data.nbytes

        counts, weight_bytes = replace_linear_layers(model, config, replace)
        if not _imports_domain(model, self):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
        invariant = rows_independent_of_pass_size()
        return {"kind": "int4-gemm", "bits": 4, "block_size": BLOCK, "layers": counts, "merged_layers": merged,
                "weight_bytes": weight_bytes, "kernel": f"{DOMAIN}::{OP} ({active_isa()})",
                "rows_independent_of_pass_size": invariant, "min_pass_rows": 1 if invariant else None}


def rows_independent_of_pass_size(k: int = 1536, n: int = 256) -> bool:
    """Does Int4Gemm give a row the same bits in a 1-row and in a multi-row pass here, in ONNX Runtime? (It does by
    construction; compile records it and the runtime asks again, as for the other quantised kernels.)"""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    packed = pack_int4(quantize_rtn(rng.normal(size=(n, k)).astype(np.float32), 4, BLOCK, True))
    node = helper.make_node(OP, ["x", "W"], ["y"], domain=DOMAIN, N=n, K=k, offsets=0, layout=LAYOUT)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "t", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "t", n])],
                              [numpy_helper.from_array(packed.data, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    so = ort.SessionOptions()
    register_with(so)
    x = (rng.normal(size=(1, 9, k)) * rng.choice([1.0, 30.0], size=k, p=[0.99, 0.01])).astype(np.float32)
    return rows_match_small_passes(model, x, session_options=so)


def _block_weight(module: str, w: np.ndarray, config: QuantConfig) -> tuple[BlockWeight, list[str]]:
    """The 4-bit block-32 weight of a linear layer, or of layers merged into one (module names joined by '+',
    their rows in that order), and where each member's blocks came from."""
    parts, sources, row = [], [], 0
    for name in module.split("+"):
        rows = next((bw.n for bw in config.imported.get(name, ())), None) if "+" in module else w.shape[0]
        if rows is None:  # a merged layer whose members' sizes only their own weights know: round the whole
            return quantize_rtn(w, 4, BLOCK, True), ["rtn int4 block 32"]
        member = w[row:row + rows]
        bw = exact_match([c for c in config.imported.get(name, ()) if packable(c)], member)
        if bw is None:
            bw = quantize_rtn(member, 4, BLOCK, True)
            sources.append("rtn int4 block 32" + (" (gguf values differ)" if name in config.imported else ""))
        else:
            sources.append(f"{bw.source} int4 block 32")
        parts.append(bw)
        row += bw.n
    if row != w.shape[0]:
        return quantize_rtn(w, 4, BLOCK, True), ["rtn int4 block 32"]
    return (parts[0] if len(parts) == 1 else _stack_rows(parts)), sources


def _stack_rows(parts: list[BlockWeight]) -> BlockWeight:
    """Weights of the same inputs stacked by output rows, in the general form (zero points and offsets)."""
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate([p.offsets if p.offsets is not None else np.zeros_like(p.scales) for p in parts])
    return BlockWeight(4, BLOCK, np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]),
                       np.concatenate([p.zero_points for p in parts]), parts[0].k, offsets,
                       "+".join(sorted({p.source for p in parts})))
