"""One focused test per ONNX pass (specc/onnx_passes): the rewrite's numerics on small graphs, its contract,
and the pipelines' order."""
from __future__ import annotations

import numpy as np
import pytest

from specc import kernels
from specc.backends.trt_coverage import check_onnx
from specc.block_weights import quantize_rtn
from specc.onnx_passes import (ALL_ONNX_PASSES, OnnxPassContractError, QuantConfig, describe_onnx_passes,
                               onnxruntime_target_pipeline, run_onnx_passes, tensorrt_target_pipeline)
from specc.onnx_passes.attend_at_cache_positions import AttendAtCachePositions
from specc.onnx_passes.attend_with_cache_kernel import AttendWithCacheKernel
from specc.onnx_passes.compute_attention_in_fp64 import ComputeAttentionInFp64
from specc.onnx_passes.fold_weight_transposes import FoldWeightTransposes
from specc.onnx_passes.quantize_int4_gemm import QuantizeInt4Gemm
from specc.onnx_passes.quantize_int8_gemm import QuantizeInt8Gemm, quantize_channels
from specc.onnx_passes.quantize_matmul_nbits import QuantizeMatMulNBits
from specc.onnx_passes.quantize_weight_only_dq import QuantizeWeightOnlyDQ


def one_linear_graph(w: np.ndarray, module: str = "layers.0.mlp.up_proj", opset: int = 23):
    """An ONNX graph y = x @ wᵀ whose MatMul carries the exporter's module scope, as specc's graphs do."""
    from onnx import TensorProto, helper, numpy_helper

    n, k = w.shape
    node = helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")
    node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=f"['', '{module}', 'linear']")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "t", n])],
                              [numpy_helper.from_array(np.ascontiguousarray(w.T), "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run_graph(model, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("bits,block,symmetric,k", [(4, 32, True, 64), (4, 32, False, 64), (4, 128, True, 96),
                                                    (8, 16, True, 64), (8, 32, False, 80), (4, 16, True, 48)])
def test_matmul_nbits_multiplies_by_the_dequantised_weight(bits, block, symmetric, k):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(40, k)).astype(np.float32)
    bw = quantize_rtn(w, bits, block, symmetric)
    step = np.abs(w).max() / (2 ** (bits - 1) - 1)
    assert np.abs(bw.dequantize() - w).max() <= step  # round to nearest: within one level of the block's scale
    model = one_linear_graph(w)
    summary = QuantizeMatMulNBits(QuantConfig(bits, block, accuracy_level=1, symmetric=symmetric))(model)
    assert summary["layers"] == {f"rtn int{bits} block {block}": 1}
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"] and not model.graph.initializer[0].name == "W"
    x = rng.normal(size=(2, 3, k)).astype(np.float32)
    np.testing.assert_allclose(run_graph(model, x), x @ bw.dequantize().T, rtol=1e-5, atol=1e-4)


def test_offsets_and_kept_layers():
    """Per-block float offsets (GGUF minimums) go through the blocksum MatMul; keep_float leaves a layer alone."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(24, 64)).astype(np.float32)
    bw = quantize_rtn(w, 4, 32, symmetric=False)
    bw.zero_points[:] = 0
    bw.offsets = rng.normal(size=bw.scales.shape).astype(np.float32)
    bw.source = "gguf:test"
    model = one_linear_graph(bw.dequantize())
    summary = QuantizeMatMulNBits(QuantConfig(4, 32, accuracy_level=1, imported={"layers.0.mlp.up_proj": [bw]}))(model)
    assert summary["layers"] == {"gguf:test int4 block 32 +offsets": 1}
    x = rng.normal(size=(1, 5, 64)).astype(np.float32)
    np.testing.assert_allclose(run_graph(model, x), x @ bw.dequantize().T, rtol=1e-5, atol=1e-4)
    kept = one_linear_graph(w, "lm_head")
    assert QuantizeMatMulNBits(QuantConfig(4, keep_float=("lm_head",)))(kept)["layers"] == {"float32": 1}


def test_int8_gemm_multiplies_by_the_channel_quantised_weight():
    """int8-gemm: y = x @ the per-channel int8 weightᵀ, with activations in two int8 parts per row (~15 bits, so a
    100x outlier channel costs the others little), each row the same bits whatever the pass holds."""
    rng = np.random.default_rng(4)
    w = rng.normal(size=(40, 96)).astype(np.float32)
    q, scale = quantize_channels(w)
    deq = q.astype(np.float32) * scale[:, None]
    assert np.abs(deq - w).max(1).max() <= (np.abs(w).max(1) / 127 / 2 * 1.0001).max()
    model = one_linear_graph(w)
    shared_input = one_linear_graph(w)
    summary = QuantizeInt8Gemm(QuantConfig(8, kind="int8-gemm"))(model)
    assert summary["layers"] == {"int8 per channel": 1} and summary["weight_bytes"] == 40 * 96 + 40 * 4
    assert summary["rows_independent_of_pass_size"] is True
    assert "MatMulInteger" in [n.op_type for n in model.graph.node] and "W" not in [i.name for i in model.graph.initializer]
    x = rng.normal(size=(2, 7, 96)).astype(np.float32)
    x[..., 5] *= 100
    y, ref = run_graph(model, x), x @ deq.T
    assert np.abs(y - ref).max() <= 2e-3 * np.abs(ref).max()
    one_at_a_time = np.concatenate([run_graph(model, x[:, i:i + 1]) for i in range(7)], axis=1)
    assert np.array_equal(y, one_at_a_time)  # rows do not depend on the pass size
    kept = QuantizeInt8Gemm(QuantConfig(8, kind="int8-gemm", keep_float=("layers.*",)))(shared_input)
    assert kept["layers"] == {"float32": 1}


def _two_linears_graph(wa: np.ndarray, wb: np.ndarray, shared: bool):
    """ya = x @ waᵀ (+ 1), yb = x @ wbᵀ, both MatMuls reading x itself (shared) or b reading a copy of x."""
    from onnx import TensorProto, helper, numpy_helper

    def linear(x, w, y, module):
        node = helper.make_node("MatMul", [x, w], [y], name=f"mm.{y}")
        node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=f"['', '{module}', 'linear']")
        return node

    nodes = [helper.make_node("Identity", ["x"], ["x2"]), linear("x", "Wa", "ya0", "layers.0.mlp.gate_proj"),
             helper.make_node("Add", ["ya0", "one"], ["ya"]),
             linear("x" if shared else "x2", "Wb", "yb", "layers.0.mlp.up_proj")]
    k = wa.shape[1]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", k])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["b", "t", w.shape[0]])
                               for y, w in (("ya", wa), ("yb", wb))],
                              [numpy_helper.from_array(np.ascontiguousarray(wa.T), "Wa"),
                               numpy_helper.from_array(np.ascontiguousarray(wb.T), "Wb"),
                               numpy_helper.from_array(np.array(1, np.float32), "one")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_int8_gemm_merges_linears_that_read_one_input_without_changing_a_bit():
    import onnxruntime as ort

    rng = np.random.default_rng(5)
    wa, wb = rng.normal(size=(24, 64)).astype(np.float32), rng.normal(size=(40, 64)).astype(np.float32)
    merged, apart = _two_linears_graph(wa, wb, shared=True), _two_linears_graph(wa, wb, shared=False)
    summary = QuantizeInt8Gemm(QuantConfig(8, kind="int8-gemm"))(merged)
    assert summary["merged_layers"] == 1 and summary["layers"] == {"int8 per channel": 1}
    assert QuantizeInt8Gemm(QuantConfig(8, kind="int8-gemm"))(apart)["merged_layers"] == 0
    assert [n.op_type for n in merged.graph.node].count("MatMulInteger") == 1
    assert not {"Wa", "Wb"} & {i.name for i in merged.graph.initializer}
    x = rng.normal(size=(2, 5, 64)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})  # noqa: E731
    for y, y_apart in zip(run(merged), run(apart)):
        assert np.array_equal(y, y_apart)
    kept = _two_linears_graph(wa, wb, shared=True)
    assert QuantizeInt8Gemm(QuantConfig(8, kind="int8-gemm", keep_float=("*up_proj",)))(kept)[
        "merged_layers"] == 0


def _run_with_kernels(model, x: np.ndarray) -> list[np.ndarray]:
    import onnxruntime as ort

    from specc.kernels import register_with

    so = ort.SessionOptions()
    register_with(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_int4_gemm_keeps_gguf_blocks_merges_shared_inputs_and_rounds_the_rest():
    """int4-gemm: a merged gate+up whose gate is a GGUF Q4_1-style weight (kept as stored) and whose up has only
    8-bit blocks (rounded to 4 bits); each output equals its own weight's Int4Gemm, rows independent of the pass."""
    from specc import kernels
    from specc.kernels.pack import pack_int4

    if not kernels.available():
        pytest.skip("specc's kernel library is not built here")
    rng = np.random.default_rng(6)
    gate = quantize_rtn(rng.normal(size=(24, 64)).astype(np.float32), 4, 32)
    gate.zero_points[:] = 0
    gate.offsets = rng.normal(size=gate.scales.shape).astype(np.float32) * 0.1
    gate.source = "gguf:Q4_1"
    wb = rng.normal(size=(40, 64)).astype(np.float32)
    up8 = quantize_rtn(wb, 8, 32)
    up8.source = "gguf:Q8_0"
    model = _two_linears_graph(gate.dequantize(), up8.dequantize(), shared=True)
    imported = {"layers.0.mlp.gate_proj": [gate], "layers.0.mlp.up_proj": [up8]}
    summary = QuantizeInt4Gemm(QuantConfig(4, kind="int4-gemm", imported=imported))(model)
    assert summary["merged_layers"] == 1 and summary["min_pass_rows"] == 1
    assert summary["layers"] == {"gguf:Q4_1 int4 block 32+rtn int4 block 32 (gguf values differ)": 1}
    assert [n.op_type for n in model.graph.node].count("Int4Gemm") == 1
    assert "ai.specc" in {o.domain for o in model.opset_import}
    x = rng.normal(size=(1, 7, 64)).astype(np.float32)
    ya, yb = _run_with_kernels(model, x)
    up4 = quantize_rtn(up8.dequantize(), 4, 32)
    assert np.array_equal(ya, kernels.gemm(x[0], pack_int4(gate))[None] + 1)
    assert np.array_equal(yb, kernels.gemm(x[0], pack_int4(up4))[None])
    rows = np.concatenate([_run_with_kernels(model, x[:, i:i + 1])[1] for i in range(7)], axis=1)
    assert np.array_equal(rows, yb)
    kept = _two_linears_graph(gate.dequantize(), wb, shared=True)
    assert QuantizeInt4Gemm(QuantConfig(4, kind="int4-gemm", keep_float=("*up_proj",)))(kept)["layers"] == {
        "rtn int4 block 32": 1, "float32": 1}


def _swiglu_graph(wg: np.ndarray, wu: np.ndarray, gate_out: bool = False):
    """y = silu(x @ wgᵀ) * (x @ wuᵀ) as the exporter writes it (Sigmoid, Mul, Mul); gate_out: the gate is also a
    graph output."""
    from onnx import TensorProto, helper, numpy_helper

    def linear(w, y, module):
        node = helper.make_node("MatMul", ["x", w], [y], name=f"mm.{y}")
        node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=f"['', '{module}', 'linear']")
        return node

    nodes = [linear("Wg", "g", "layers.0.mlp.gate_proj"), linear("Wu", "u", "layers.0.mlp.up_proj"),
             helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["g", "sg"], ["silu"]),
             helper.make_node("Mul", ["silu", "u"], ["y"])]
    k, n = wg.shape[1], wg.shape[0]
    outputs = [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["b", "t", n]) for y in ["y"] + ["g"] * gate_out]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", k])],
                              outputs, [numpy_helper.from_array(np.ascontiguousarray(wg.T), "Wg"),
                                        numpy_helper.from_array(np.ascontiguousarray(wu.T), "Wu")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_gate_in_int4_gemm_moves_swiglu_into_the_kernel():
    """The merged gate+up Int4Gemm returns silu(gate) * up: within float rounding of the Sigmoid and Muls it
    replaces, each row with the bits it has alone; a gate read elsewhere keeps the operators."""
    from specc import kernels
    from specc.onnx_passes import GateInInt4Gemm

    if not kernels.available():
        pytest.skip("specc's kernel library is not built here")
    rng = np.random.default_rng(8)
    wg, wu = rng.normal(size=(32, 64)).astype(np.float32), rng.normal(size=(32, 64)).astype(np.float32)
    config = QuantConfig(4, kind="int4-gemm")
    apart, fused = _swiglu_graph(wg, wu), _swiglu_graph(wg, wu)
    QuantizeInt4Gemm(config)(apart)
    QuantizeInt4Gemm(config)(fused)
    assert GateInInt4Gemm()(fused) == {"gated_in_kernel": 1}
    assert [n.op_type for n in fused.graph.node] == ["Int4Gemm"]
    assert not any(i.name.endswith(".sizes") for i in fused.graph.initializer)
    x = rng.normal(size=(1, 9, 64)).astype(np.float32)
    (y,), (y_apart,) = _run_with_kernels(fused, x), _run_with_kernels(apart, x)
    assert y.shape == (1, 9, 32) and np.abs(y - y_apart).max() <= 1e-5 * np.abs(y_apart).max()
    rows = np.concatenate([_run_with_kernels(fused, x[:, i:i + 1])[0] for i in range(9)], axis=1)
    assert np.array_equal(rows, y)
    shared = _swiglu_graph(wg, wu, gate_out=True)
    QuantizeInt4Gemm(config)(shared)
    assert GateInInt4Gemm()(shared) == {"gated_in_kernel": 0} and "Sigmoid" in [n.op_type for n in shared.graph.node]


def test_imported_blocks_that_do_not_match_the_weights_are_not_used():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(16, 32)).astype(np.float32)
    other = quantize_rtn(w + 1, 4, 32)
    other.source = "gguf:Q4_0"
    summary = QuantizeMatMulNBits(QuantConfig(4, 32, imported={"layers.0.mlp.up_proj": [other]}))(one_linear_graph(w))
    assert summary["layers"] == {"rtn (gguf values differ) int4 block 32": 1}


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_tensorrt_weight_only_form(kind):
    """The TensorRT route's DequantizeLinear → MatMul graph computes x @ dequantised W (ONNX Runtime as the
    reference), and passes the TensorRT operator-table check; MatMulNBits does not, with a pointer to it."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(48, 256)).astype(np.float32)
    model = one_linear_graph(w, opset=18)  # the tensorrt backend's export opset
    summary = QuantizeWeightOnlyDQ(QuantConfig(4 if kind == "int4" else 8, 64, kind=kind))(model)
    assert summary["layers"] == 1 and [n.op_type for n in model.graph.node] == ["DequantizeLinear", "MatMul"]
    x = rng.normal(size=(1, 3, 256)).astype(np.float32)
    rel = np.abs(run_graph(model, x) - x @ w.T).max() / np.abs(x @ w.T).max()
    assert rel < {"int4": 0.15, "int8": 0.02, "fp8": 0.08}[kind]
    report = check_onnx(model)
    assert report.ok, report.message()
    nbits = one_linear_graph(w, opset=18)
    QuantizeMatMulNBits(QuantConfig(4, 32))(nbits)
    assert "DequantizeLinear → MatMul" in check_onnx(nbits).message()


def _tied_head_graph(emb: np.ndarray):
    """logits = x @ embᵀ through a Transpose of the embedding, as a tied LM head exports."""
    from onnx import TensorProto, helper, numpy_helper

    v, h = emb.shape
    transpose = helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0], name="tied")
    matmul = helper.make_node("MatMul", ["x", "Et"], ["y"], name="lm")
    matmul.metadata_props.add(key="pkg.torch.onnx.name_scopes", value="['', 'lm_head', 'linear']")
    graph = helper.make_graph([transpose, matmul], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", h])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["t", v])],
                              [numpy_helper.from_array(emb, "E")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_fold_weight_transposes_makes_a_tied_head_a_weight_and_keeps_its_numbers():
    rng = np.random.default_rng(6)
    emb = rng.normal(size=(40, 32)).astype(np.float32)
    x = rng.normal(size=(3, 32)).astype(np.float32)
    model = _tied_head_graph(emb)
    before = run_graph(model, x)
    assert FoldWeightTransposes()(model) == {}
    assert [n.op_type for n in model.graph.node] == ["MatMul"]
    assert np.array_equal(run_graph(model, x), before)
    assert QuantizeMatMulNBits(QuantConfig(4, 32))(model)["layers"] == {"rtn int4 block 32": 1}


def test_quantising_before_folding_is_refused_naming_the_pass():
    """The contract catches a pipeline in the wrong order: the tied head would have stayed float."""
    emb = np.random.default_rng(7).normal(size=(40, 32)).astype(np.float32)
    for quantiser in (QuantizeMatMulNBits(QuantConfig(4, 32)), QuantizeInt8Gemm(QuantConfig(8, kind="int8-gemm")),
                      QuantizeInt4Gemm(QuantConfig(4, kind="int4-gemm")),
                      QuantizeWeightOnlyDQ(QuantConfig(8, 32, kind="int8"))):
        with pytest.raises(OnnxPassContractError, match=f"ONNX pass {quantiser.name} requires no Transpose"):
            quantiser(_tied_head_graph(emb))


def test_a_pass_that_does_not_deliver_its_promise_fails():
    class Forgetful(QuantizeMatMulNBits):
        def apply(self, model) -> dict:
            return {}

    with pytest.raises(OnnxPassContractError, match="promised no linear layer outside keep_float"):
        Forgetful(QuantConfig(4, 32))(one_linear_graph(np.ones((8, 32), np.float32)))


def _attention_graph(hq: int, hkv: int, d: int, scale: float):
    """y = Attention(q [1, Hq, T, D], k, v [1, Hkv, S, D], boolean mask [1, 1, T, S]) at opset 23."""
    from onnx import TensorProto, helper

    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"], name="attn", scale=scale)
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, hq, "t", d]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, hkv, "s", d]),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, hkv, "s", d]),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 1, "t", "s"])]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, hq, "t", d])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_attention_in_fp64_gives_a_row_the_same_bits_in_any_pass():
    """Grouped-query attention over a cache of 9 with a causal mask: the float64 decomposition matches float64
    attention computed here, and a row's output is the same bits in a 1-token pass as in a 5-token one."""
    import onnxruntime as ort

    hq, hkv, d, s, t = 4, 2, 8, 9, 5
    scale = d ** -0.5
    model = _attention_graph(hq, hkv, d, scale)
    assert ComputeAttentionInFp64()(model) == {"attention_float64": 1}
    assert "Attention" not in [n.op_type for n in model.graph.node]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(8)
    q = rng.normal(size=(1, hq, t, d)).astype(np.float32)
    k, v = (rng.normal(size=(1, hkv, s, d)).astype(np.float32) for _ in range(2))
    mask = np.arange(s)[None, :] <= np.arange(s - t, s)[:, None]  # row i sees the cache up to its own position
    y = session.run(None, {"q": q, "k": k, "v": v, "mask": mask[None, None]})[0]
    kk, vv = (np.repeat(a.astype(np.float64), hq // hkv, axis=1) for a in (k, v))
    scores = np.where(mask, q.astype(np.float64) @ kk.transpose(0, 1, 3, 2) * scale, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ vv
    assert np.abs(y - ref).max() < 1e-6
    for i in range(t):
        alone = session.run(None, {"q": q[:, :, i:i + 1], "k": k, "v": v, "mask": mask[None, None, i:i + 1]})[0]
        assert np.array_equal(alone[:, :, 0], y[:, :, i])
    causal = _attention_graph(hq, hkv, d, scale)
    causal.graph.node[0].attribute.append(__import__("onnx").helper.make_attribute("is_causal", 1))
    assert ComputeAttentionInFp64()(causal) == {"attention_float64": 0}  # left as it is, and the contract holds


def _step_attention_graph(hq: int, hkv: int, d: int, *, tree: bool = False):
    """y = Attention(q, Concat(k_cache, new_k), Concat(v_cache, new_v), boolean mask [B, 1, T, S+T]) with the step
    ABI's cache_len and position_ids inputs (and tree_mask, for a tree graph): one attention layer of a step graph."""
    from onnx import TensorProto, helper

    def info(name, shape, elem=TensorProto.FLOAT):
        return helper.make_tensor_value_info(name, elem, shape)

    nodes = [helper.make_node("Concat", ["k_cache", "new_k"], ["keys"], axis=2),
             helper.make_node("Concat", ["v_cache", "new_v"], ["values"], axis=2),
             helper.make_node("Attention", ["q", "keys", "values", "mask"], ["y"], name="attn", scale=d ** -0.5)]
    inputs = [info("q", ["b", hq, "t", d]), info("k_cache", ["b", hkv, "s", d]), info("v_cache", ["b", hkv, "s", d]),
              info("new_k", ["b", hkv, "t", d]), info("new_v", ["b", hkv, "t", d]),
              info("cache_len", ["b"], TensorProto.INT64), info("position_ids", ["b", "t"], TensorProto.INT64),
              info("mask", ["b", 1, "t", "n"], TensorProto.BOOL)]
    if tree:
        inputs.append(info("tree_mask", ["b", "t", "t"], TensorProto.BOOL))
    graph = helper.make_graph(nodes, "g", inputs, [info("y", ["b", hq, "t", d])],
                              value_info=[info("keys", ["b", hkv, "n", d]), info("values", ["b", hkv, "n", d])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def _chain_rows(session, hq: int, hkv: int, d: int, lengths: list[int], capacity: int, t: int, seed: int = 3,
                pad: int = 0):
    """A pass of t new tokens per row after `lengths` cached ones, in a cache of `capacity` slots whose slots past
    each row's length hold stale keys; every row's sequence of queries, keys and values is fixed by `seed`. `pad`
    copies of each row's last token (its position too) follow, as the runtime pads a short pass."""
    rng = np.random.default_rng(seed)
    total = 600  # every call draws the same sequences
    q_all = rng.normal(size=(len(lengths), hq, total, d)).astype(np.float32) * 3
    k_all, v_all = (rng.normal(size=(len(lengths), hkv, total, d)).astype(np.float32) for _ in range(2))
    stale = np.random.default_rng(seed + len(lengths) * 1000 + capacity + t)
    feeds = {name: np.zeros(shape, np.float32) for name, shape in (
        ("q", (len(lengths), hq, t, d)), ("k_cache", (len(lengths), hkv, capacity, d)),
        ("v_cache", (len(lengths), hkv, capacity, d)), ("new_k", (len(lengths), hkv, t, d)),
        ("new_v", (len(lengths), hkv, t, d)))}
    mask = np.zeros((len(lengths), 1, t, capacity + t), bool)
    for b, n in enumerate(lengths):
        feeds["k_cache"][b, :, :n], feeds["v_cache"][b, :, :n] = k_all[b, :, :n], v_all[b, :, :n]
        feeds["k_cache"][b, :, n:] = stale.normal(size=(hkv, capacity - n, d))
        feeds["q"][b], feeds["new_k"][b], feeds["new_v"][b] = q_all[b, :, n:n + t], k_all[b, :, n:n + t], v_all[b, :, n:n + t]
        mask[b, 0, :, :n] = True
        mask[b, 0, :, capacity:] = np.tril(np.ones((t, t), bool))
    positions = np.array(lengths, np.int64)[:, None] + np.arange(t)[None, :]
    if pad:
        for name in ("q", "new_k", "new_v"):
            feeds[name] = np.concatenate([feeds[name]] + [feeds[name][:, :, -1:]] * pad, axis=2)
        positions = np.concatenate([positions] + [positions[:, -1:]] * pad, axis=1)
        n = t + pad
        mask = np.concatenate([mask, np.zeros((len(lengths), 1, t, pad), bool)], axis=-1)
        mask = np.concatenate([mask, np.repeat(mask[:, :, -1:], pad, axis=2)], axis=2)
        mask[:, 0, :, capacity:] = np.tril(np.ones((n, n), bool))
    feeds.update(cache_len=np.array(lengths, np.int64), mask=mask, position_ids=positions)
    return session.run(None, feeds)[0], (q_all, k_all, v_all)


def _assert_attention(out: np.ndarray, sequences, lengths: list[int], d: int) -> None:
    """`out` [B, Hq, T, D] is causal attention over each row's sequences (as `_chain_rows` returns them) at positions
    length .. length + T - 1, computed here in float64, within float32 rounding."""
    q, k, v = sequences
    groups = q.shape[1] // k.shape[1]
    for b, n in enumerate(lengths):
        for j in range(out.shape[2]):
            keys, values = (np.repeat(x[b, :, :n + j + 1].astype(np.float64), groups, axis=0) for x in (k, v))
            scores = np.einsum("hd,hsd->hs", q[b, :, n + j].astype(np.float64), keys) * d ** -0.5
            p = np.exp(scores - scores.max(-1, keepdims=True))
            ref = np.einsum("hs,hsd->hd", p / p.sum(-1, keepdims=True), values)
            assert np.abs(out[b, :, j] - ref).max() < 1e-5


def test_attention_at_cache_positions_gives_a_row_the_same_bits_in_any_pass():
    """A token's row is the same bits in a 5-token verify pass, a 3-token pass and the 1-token pass after the cache
    took the tokens before it (alone, or padded with copies of itself, which come out the same bits too), whatever
    the cache's capacity, for rows of different lengths; the float32 Attention
    it replaces gives other bits (so the check can fail), and the result is attention computed here in float64."""
    import onnxruntime as ort

    hq, hkv, d = 12, 2, 64
    rewritten = _step_attention_graph(hq, hkv, d)
    assert AttendAtCachePositions()(rewritten) == {"attention_at_positions": 1}
    assert "Attention" not in [n.op_type for n in rewritten.graph.node]
    assert not [n for n in rewritten.graph.node if n.op_type == "Concat" and "k_cache" in n.input]  # no copy of it
    assert ComputeAttentionInFp64()(rewritten) == {"attention_float64": 0}  # nothing left for the fallback
    sessions = {name: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                for name, m in (("positions", rewritten), ("float32", _step_attention_graph(hq, hkv, d)))}
    lengths = [300, 517]
    for name, session in sessions.items():
        verify, (q, k, v) = _chain_rows(session, hq, hkv, d, lengths, 576, 5)
        same = []
        for capacity in (576, 640, 1024):
            for j in range(5):
                alone, _ = _chain_rows(session, hq, hkv, d, [n + j for n in lengths], capacity, 1)
                same += [np.array_equal(alone[b, :, 0], verify[b, :, j]) for b in range(2)]
            three, _ = _chain_rows(session, hq, hkv, d, [n + 1 for n in lengths], capacity, 3)
            same += [np.array_equal(three[b, :, j], verify[b, :, j + 1]) for b in range(2) for j in range(3)]
            padded, _ = _chain_rows(session, hq, hkv, d, [n + 4 for n in lengths], capacity, 1, pad=2)
            same += [np.array_equal(padded[b, :, j], verify[b, :, 4]) for b in range(2) for j in range(3)]
        if name == "positions":
            assert all(same)
        else:
            assert not all(same)
    _assert_attention(verify, (q, k, v), lengths, d)


@pytest.mark.skipif(not kernels.available(), reason="specc's kernel library is not built here")
def test_attention_with_cache_kernel_gives_a_row_the_same_bits_in_any_pass():
    """The CacheAttention operator in place of the Attention node: one node, no Concat of the cache; a token's row is
    the same bits in a 5-token pass, a 3-token pass, and the 1-token pass after the cache took the tokens before it
    (padded or not), whatever the capacity; the result is attention computed in float64. A head size the kernel does
    not take is left to attend_at_cache_positions; a tree graph takes the kernel too (test_attention_kernel.py checks
    a tree node against a chain along its path)."""
    import onnxruntime as ort

    from specc.backends.onnxruntime_backend import session_options

    hq, hkv, d = 12, 2, 64
    model = _step_attention_graph(hq, hkv, d)
    assert AttendWithCacheKernel()(model) == {"attention_in_kernel": 1}
    assert [n.op_type for n in model.graph.node] == ["CacheAttention"]
    session = ort.InferenceSession(model.SerializeToString(), session_options(own_kernels=True),
                                   providers=["CPUExecutionProvider"])
    lengths = [300, 517]
    verify, (q, k, v) = _chain_rows(session, hq, hkv, d, lengths, 576, 5)
    for capacity in (576, 1024):
        for j in range(5):
            alone, _ = _chain_rows(session, hq, hkv, d, [n + j for n in lengths], capacity, 1)
            assert all(np.array_equal(alone[b, :, 0], verify[b, :, j]) for b in range(2))
        three, _ = _chain_rows(session, hq, hkv, d, [n + 1 for n in lengths], capacity, 3)
        assert all(np.array_equal(three[b, :, j], verify[b, :, j + 1]) for b in range(2) for j in range(3))
        padded, _ = _chain_rows(session, hq, hkv, d, [n + 4 for n in lengths], capacity, 1, pad=2)
        assert all(np.array_equal(padded[b, :, j], verify[b, :, 4]) for b in range(2) for j in range(3))
    _assert_attention(verify, (q, k, v), lengths, d)
    odd = _step_attention_graph(4, 2, 40)
    assert AttendWithCacheKernel()(odd) == {"attention_in_kernel": 0}
    assert AttendAtCachePositions()(odd) == {"attention_at_positions": 1}
    assert AttendWithCacheKernel()(_step_attention_graph(hq, hkv, d, tree=True)) == {"attention_in_kernel": 1}


def test_attention_at_cache_positions_keeps_the_fused_operator_for_wide_passes():
    """fused_above=3: passes of up to 3 tokens take the positioned form (a token's row the same bits in a 3-token and
    a 1-token pass), wider ones ONNX Runtime's fused operator over [cache ; new] (an If on the pass size); both
    compute attention (float64 reference here)."""
    import onnxruntime as ort

    hq, hkv, d = 4, 2, 16
    model = _step_attention_graph(hq, hkv, d)
    assert AttendAtCachePositions(fused_above=3)(model) == {"attention_at_positions": 1, "attention_fused_above": 3}
    assert [n.op_type for n in model.graph.node].count("If") == 1
    assert not [n for n in model.graph.node if n.op_type == "Concat" and "k_cache" in n.input]  # only in the fused branch
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    lengths = [40, 57]
    three, _ = _chain_rows(session, hq, hkv, d, lengths, 64, 3)
    for j in range(3):
        alone, _ = _chain_rows(session, hq, hkv, d, [n + j for n in lengths], 64, 1)
        assert all(np.array_equal(alone[b, :, 0], three[b, :, j]) for b in range(2))
    wide, (q, k, v) = _chain_rows(session, hq, hkv, d, lengths, 64, 6)
    _assert_attention(wide, (q, k, v), lengths, d)


def test_attention_at_cache_positions_leaves_trees_and_other_nodes_to_the_float64_fallback():
    """A tree graph (siblings sit at consecutive indices, not at their depth's position), a graph without cache_len
    and an Attention node over keys that are not Concat(cache, new) are left as they are; the float64 pass then
    rewrites them, and the pair of passes leaves no float32 Attention behind."""
    tree = _step_attention_graph(4, 2, 8, tree=True)
    assert AttendAtCachePositions()(tree) == {"attention_at_positions": 0}
    assert ComputeAttentionInFp64()(tree) == {"attention_float64": 1}
    plain = _attention_graph(4, 2, 8, 8 ** -0.5)  # keys are a graph input: no cache_len, no Concat
    assert AttendAtCachePositions()(plain) == {"attention_at_positions": 0}
    assert run_onnx_passes(_attention_graph(4, 2, 8, 8 ** -0.5), [AttendAtCachePositions(), ComputeAttentionInFp64()]) == {
        "attention_at_positions": 0, "attention_float64": 1}


def test_pipelines_run_in_order_and_every_pass_is_listed():
    config = QuantConfig(4, 32, kind="int4")
    assert [type(p) for p in onnxruntime_target_pipeline(config)] == [FoldWeightTransposes, QuantizeMatMulNBits,
                                                                      AttendAtCachePositions, ComputeAttentionInFp64]
    assert [type(p).__name__ for p in onnxruntime_target_pipeline(QuantConfig(4, kind="int4-gemm"))] == [
        "FoldWeightTransposes", "QuantizeInt4Gemm", "GateInInt4Gemm", "AttendWithCacheKernel", "AttendAtCachePositions",
        "ComputeAttentionInFp64"]
    gemm = QuantConfig(8, kind="int8-gemm")
    assert [type(p) for p in onnxruntime_target_pipeline(gemm)][1] is QuantizeInt8Gemm
    assert [type(p) for p in tensorrt_target_pipeline(config)] == [FoldWeightTransposes, QuantizeWeightOnlyDQ]
    emb = np.random.default_rng(9).normal(size=(40, 32)).astype(np.float32)
    facts = run_onnx_passes(_tied_head_graph(emb), onnxruntime_target_pipeline(config))
    assert facts["layers"] == {"rtn int4 block 32": 1} and facts["attention_float64"] == 0
    assert facts["attention_at_positions"] == 0
    listing = describe_onnx_passes()
    assert all(f"{cls.name}: " in listing for cls in ALL_ONNX_PASSES)


def stacked_cache_graph(layers: int = 3):
    """y = sum over layers of k_cache[i] * (i + 1), plus Shape(k_cache)[1:2] and [0:1]: the uses a step graph
    makes of its stacked cache."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, terms = [], [], []
    for i in range(layers):
        inits += [numpy_helper.from_array(np.array(i, np.int64), f"i{i}"),
                  numpy_helper.from_array(np.array(i + 1, np.float32), f"w{i}")]
        nodes += [helper.make_node("Gather", ["k_cache", f"i{i}"], [f"g{i}"], axis=0),
                  helper.make_node("Mul", [f"g{i}", f"w{i}"], [f"t{i}"])]
        terms.append(f"t{i}")
    nodes += [helper.make_node("Sum", terms, ["y"]),
              helper.make_node("Shape", ["k_cache"], ["batch"], start=1, end=2),
              helper.make_node("Shape", ["k_cache"], ["lb"], start=0, end=2)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("k_cache", TensorProto.FLOAT, [layers, "b", 2, "s", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 2, "s", 4]),
         helper.make_tensor_value_info("batch", TensorProto.INT64, [1]),
         helper.make_tensor_value_info("lb", TensorProto.INT64, [2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_feed_cache_by_layer_gives_each_layer_its_own_input_and_keeps_the_numbers():
    import onnxruntime as ort

    from specc.backends.onnxruntime_backend import OrtRunner, abi_inputs
    from specc.onnx_passes.feed_cache_by_layer import FeedCacheByLayer

    model = stacked_cache_graph()
    cache = np.random.default_rng(0).normal(size=(3, 2, 2, 5, 4)).astype(np.float32)
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"k_cache": cache})
    assert FeedCacheByLayer()(model) == {"cache_by_layer": 3}
    assert [i.name for i in model.graph.input] == ["k_cache.0", "k_cache.1", "k_cache.2"]
    assert not [n for n in model.graph.node if n.op_type == "Gather"]
    assert not [i for i in model.graph.initializer if i.name.startswith("i")]  # the layer numbers went with them
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names, kv, layers = abi_inputs(session.get_inputs())
    assert names == ["k_cache"] and layers == {"k_cache": 3} and kv[:1] == [3]
    import torch

    after = OrtRunner(session, ["k_cache"], ["y", "batch", "lb"], layers)(torch.from_numpy(cache))
    for want, got in zip(before, after):
        np.testing.assert_array_equal(want, got.numpy())
    assert FeedCacheByLayer()(model) == {}  # nothing stacked left: a second run changes nothing


def test_feed_cache_by_layer_refuses_a_cache_read_another_way():
    from onnx import helper

    from specc.onnx_passes.feed_cache_by_layer import FeedCacheByLayer

    model = stacked_cache_graph()
    model.graph.node.append(helper.make_node("ReduceSum", ["k_cache"], ["whole"]))
    with pytest.raises(OnnxPassContractError, match="feed_cache_by_layer requires"):
        FeedCacheByLayer()(model)
