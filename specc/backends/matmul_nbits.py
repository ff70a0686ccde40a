"""Block-wise weight-only quantisation of an ONNX graph's linear layers onto ONNX Runtime's `MatMulNBits`.

A weight W [N out, K in] is stored as blocks of `block_size` consecutive inputs of one output row:

    W[n, k] = (q[n, k] - zp[n, b]) * scale[n, b] + offset[n, b]        b = k // block_size

q has `bits` bits (4 or 8), zp is an integer zero point, `offset` an optional float per block
(GGUF's Q4_1/Q4_K minimums, which no integer zero point can express). MatMulNBits computes the
first term; an offset adds `blocksum(x) @ offsetᵀ` (one small MatMul of K/block_size rows, the
same decomposition llama.cpp's own Q4_1/Q4_K dot products use). `BlockWeight.dequantize` is the
weight the graph multiplies by, in float32, evaluated in the order ggml dequantises, so a GGUF
tensor imported here dequantises bit for bit to what gguf-py/llama.cpp give.
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field

import numpy as np

MS_DOMAIN = "com.microsoft"


@dataclass
class BlockWeight:
    bits: int
    block_size: int
    q: np.ndarray  # uint8 [N, n_blocks, block_size], values < 2**bits (K padded with zero weights)
    scales: np.ndarray  # float32 [N, n_blocks]
    zero_points: np.ndarray  # uint8 [N, n_blocks]
    k: int  # real input size (q may be padded up to whole blocks)
    offsets: np.ndarray | None = None  # float32 [N, n_blocks], added to every weight of the block
    source: str = "rtn"  # "rtn" (quantised here from float weights) or "gguf:<type>" (blocks kept as stored)

    @property
    def n(self) -> int:
        return self.q.shape[0]

    def dequantize(self) -> np.ndarray:
        """The float32 weight [N, K] the quantised graph multiplies by."""
        w = (self.q.astype(np.float32) - self.zero_points[..., None].astype(np.float32)) * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(self.n, -1)[:, : self.k]

    def nbytes(self) -> int:
        """Bytes a pass reads for this weight: packed values, scales, zero points, offsets."""
        n_blocks = self.q.shape[1]
        zp = self.n * ((n_blocks * self.bits + 7) // 8)
        off = self.offsets.nbytes if self.offsets is not None else 0
        return self.q.size * self.bits // 8 + self.scales.nbytes + zp + off


def quantize_rtn(w: np.ndarray, bits: int, block_size: int, symmetric: bool = True) -> BlockWeight:
    """Round-to-nearest block quantisation of a float weight [N, K].

    symmetric: zero point 2**(bits-1) and scale max/-2**(bits-1) from the signed largest-magnitude
    value (the Q4_0/Q8_0 rule: all 2**bits levels used); asymmetric: scale (max-min)/(2**bits-1)
    and an integer zero point.
    """
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    n_blocks = -(-k // block_size)
    padded = np.zeros((n, n_blocks * block_size), np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, n_blocks, block_size)
    levels = (1 << bits) - 1
    if symmetric:
        idx = np.abs(blocks).argmax(-1)[..., None]
        peak = np.take_along_axis(blocks, idx, -1)[..., 0]
        scales = peak / -(1 << (bits - 1))
        zp = np.full((n, n_blocks), 1 << (bits - 1), np.uint8)
    else:
        lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
        scales = (hi - lo) / levels
        with np.errstate(divide="ignore", invalid="ignore"):
            zp = np.clip(np.rint(np.where(scales == 0, 0, -lo / scales)), 0, levels).astype(np.uint8)
    scales = scales.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(scales == 0, 0, 1 / scales).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]) + zp[..., None], 0, levels).astype(np.uint8)
    return BlockWeight(bits, block_size, q, scales, zp, k)


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 values along the last axis, low nibble first for 4 bits (MatMulNBits' layout)."""
    if bits == 8:
        return values.astype(np.uint8)
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros(values.shape[:-1] + (1,), np.uint8)], -1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


@dataclass
class QuantConfig:
    bits: int
    block_size: int = 32
    accuracy_level: int = 4
    symmetric: bool = True
    keep_float: tuple[str, ...] = ()  # module names (fnmatch patterns) left in float32
    kind: str = ""  # the recipe's target.quantize (int8, int4, fp8)
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


def quantize_linear_layers(model, config: QuantConfig) -> dict:
    """Replace every linear layer's MatMul with MatMulNBits (in place); returns a summary for the manifest:
    layer counts by format and the bytes of weights one pass reads."""
    from onnx import helper, numpy_helper

    shared: dict = {}

    def replace(node, w: np.ndarray, module: str):
        bw = _exact_import(config.imported.get(module, ()), w)
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
    pass size can flip a near-tied greedy choice. ONNX Runtime 1.32 on AVX-512 VNNI: 1 at block 32, accuracy level
    4; on an AVX2-only CPU every int4 setting gives 2 (1-row passes take a GEMV kernel of their own), so the
    runtime runs a 1-token pass as 2 rows there (runtime/step.py). Compile records this; the runtime asks again
    where it runs (row_invariance.py)."""
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


def rows_match_small_passes(model, x: np.ndarray, rows: int = 1) -> bool:
    """Does the ONNX `model` (input "x", output "y", rows on axis -2) give its first 2, 4, 6 and 9 rows of x the bits
    it gives each row alone in a pass of `rows` rows (the row and copies of it)?"""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    alone = [session.run(None, {"x": np.repeat(x[..., i:i + 1, :], rows, axis=-2)})[0][..., :1, :] for i in range(x.shape[-2])]
    single = np.concatenate(alone, axis=-2)
    return all(np.array_equal(session.run(None, {"x": x[..., :m, :]})[0], single[..., :m, :]) for m in (2, 4, 6, 9))


def _exact_import(candidates, w: np.ndarray) -> BlockWeight | None:
    """The imported blocks that dequantise bit for bit to the graph's weight, if any."""
    for bw in candidates:
        if bw.n == w.shape[0] and bw.k == w.shape[1] and np.array_equal(bw.dequantize(), w):
            return bw
    return None


def _offset_nodes(x: str, nbits_out: str, base: str, bw: BlockWeight, n_blocks: int, model, shared: dict) -> list:
    """y = MatMulNBits(x) + blocksum(x) @ offsetsᵀ, blocksum summing x over each block of inputs."""
    from onnx import helper, numpy_helper

    if bw.k != n_blocks * bw.block_size:
        raise ValueError(f"{base}: offsets need K ({bw.k}) to be whole blocks of {bw.block_size}")
    key = ("blocks", n_blocks, bw.block_size)
    if key not in shared:
        shape = numpy_helper.from_array(np.array([-1, n_blocks, bw.block_size], np.int64), f"blockshape_{n_blocks}_{bw.block_size}")
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


def fold_weight_transposes(model) -> None:
    """Replace Transpose(initializer) with a transposed initializer, so the quantiser sees a
    constant weight; a tied LM head (Transpose of the embedding) then gets quantised too."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    for node in list(model.graph.node):
        if node.op_type != "Transpose" or node.input[0] not in inits:
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        array = numpy_helper.to_array(inits[node.input[0]])
        folded = numpy_helper.from_array(np.ascontiguousarray(array.transpose(perm)), node.output[0])
        model.graph.initializer.append(folded)
        model.graph.node.remove(node)
