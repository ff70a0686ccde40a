"""The TensorRT op-coverage check on real exported step graphs and on deliberately bad ones.

No TensorRT here: the check reads TensorRT's supported-operator table (a JSON file in the
package), so it runs in CI. It proves that the opset the tensorrt backend exports at yields
only operators TensorRT 10 parses, and that a rejected node is named with the pass (or the
captured module) that produced it.
"""
from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto, helper
from transformers import AutoModelForCausalLM

from specc.backends import tensorrt_backend
from specc.backends.onnx_export import PASS_KEY, export_onnx
from specc.backends.onnxruntime_backend import OPSET as ORT_OPSET
from specc.backends.trt_coverage import TensorRTCoverageError, check_onnx, load_table
from specc.capture.shapes import dim_ranges
from specc.capture.graph import capture
from specc.cli import main
from specc.passes.base import GraphPass
from specc.testing import make_tiny_model


class InvertCacheLen(GraphPass):
    """A pass that adds an operator TensorRT lacks (BitwiseNot) to the logits; only for this test."""

    name = "invert_cache_len"

    def apply(self, graph) -> str:
        gm = graph.gm
        logits, *rest = graph.output_nodes()
        (out,) = gm.graph.find_nodes(op="output")
        with gm.graph.inserting_before(out):
            inverted = gm.graph.call_function(torch.ops.aten.bitwise_not.default, (graph.placeholder("cache_len"),))
            shaped = gm.graph.call_function(torch.ops.aten.view.default, (inverted, [-1, 1, 1]))
            logits = gm.graph.call_function(torch.ops.aten.add.Tensor, (logits, shaped))
        graph.set_outputs(graph.outputs, [logits, *rest])
        return "adds ~cache_len to the logits"


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("m") / "llama")).eval()


def _export(graph, path, opset):
    export_onnx(graph.export(), path, [i.name for i in graph.inputs], graph.outputs, opset)
    return path


@pytest.fixture(scope="module")
def trt_onnx(hf_model, tmp_path_factory):
    """The step graph exported the way the tensorrt backend exports it."""
    graph = capture("target", hf_model, dim_ranges(4, 128))
    return _export(graph, tmp_path_factory.mktemp("trt") / "model.onnx", tensorrt_backend.OPSET)


def test_table_names_its_source_and_version():
    table = load_table()
    assert table["source"].startswith("https://github.com/onnx/onnx-tensorrt/") and table["source_commit"]
    assert table["tensorrt_version"] == "10.1" and (table["opset_min"], table["opset_max"]) == (9, 20)
    assert {"MatMul", "Softmax", "ReduceMean", "Gather", "Where"} <= set(table["operators"])
    assert "BitwiseNot" in table["unsupported"]


def test_tensorrt_opset_graph_is_fully_supported(trt_onnx):
    report = check_onnx(trt_onnx)
    assert report.ok, report.message()
    assert report.opset == tensorrt_backend.OPSET
    assert {"MatMul", "Softmax", "ReduceMean"} <= set(report.op_counts)  # attention and RMSNorm, decomposed
    assert not {"Attention", "RMSNormalization", "RotaryEmbedding"} & set(report.op_counts)
    assert report.summary()["unsupported"] == []


def test_opset23_graph_fails_naming_fused_nodes_and_modules(hf_model, tmp_path):
    graph = capture("target", hf_model, dim_ranges(4, 128))
    report = check_onnx(_export(graph, tmp_path / "model.onnx", ORT_OPSET))
    assert not report.ok
    assert any("opset 23 is outside" in p for p in report.problems)
    assert {"Attention", "RMSNormalization", "RotaryEmbedding"} <= {f.op_type for f in report.findings}
    assert {f.origin for f in report.findings if f.op_type == "Attention"} == {
        "captured model (layers.0.self_attn)", "captured model (layers.1.self_attn)"}
    with pytest.raises(TensorRTCoverageError, match=r"node '\S+' \(RMSNormalization\) from captured model"):
        report.raise_if_unsupported()


def test_unsupported_node_names_the_pass_that_made_it(hf_model, tmp_path):
    graph = capture("target", hf_model, dim_ranges(4, 128))
    InvertCacheLen()(graph)
    path = _export(graph, tmp_path / "model.onnx", tensorrt_backend.OPSET)
    tagged = [n for n in onnx.load(str(path), load_external_data=False).graph.node
              if any(p.key == PASS_KEY for p in n.metadata_props)]
    assert {n.op_type for n in tagged} >= {"BitwiseNot", "Add"}
    report = check_onnx(path)
    assert [(f.op_type, f.origin) for f in report.findings] == [("BitwiseNot", "pass invert_cache_len")]
    assert "listed as unsupported for TensorRT 10.1" in str(report.findings[0])
    assert main(["trt-check", str(path)]) == 1


def _model(nodes, inputs, outputs, initializers=(), opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_types_constant_inputs_and_domains_are_checked():
    i64 = lambda name: helper.make_tensor_value_info(name, TensorProto.INT64, [2, 2])
    f32 = lambda name, shape=(2, 2): helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))
    model = _model(
        [helper.make_node("MatMul", ["a", "b"], ["c"], name="int_matmul"),
         helper.make_node("ReduceMean", ["x", "axes"], ["m"], name="mean_dynamic_axes"),
         helper.make_node("ReduceMean", ["x", "const_axes"], ["m2"], name="mean_const_axes"),
         helper.make_node("FusedThing", ["x"], ["y"], name="custom", domain="com.example")],
        [i64("a"), i64("b"), f32("x"), helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [i64("c"), f32("m", (2, 1)), f32("m2", (2, 1)), f32("y")],
        [helper.make_tensor("const_axes", TensorProto.INT64, [1], [1])],
    )
    report = check_onnx(model, source="hand-made")
    found = {f.node: f.problem for f in report.findings}
    assert set(found) == {"int_matmul", "mean_dynamic_axes", "custom"}
    assert "element type INT64" in found["int_matmul"] and "FLOAT" in found["int_matmul"]
    assert "input `axes`" in found["mean_dynamic_axes"] and "constant" in found["mean_dynamic_axes"]
    assert "com.example" in found["custom"]
    assert all(f.origin.startswith("no provenance") for f in report.findings)


def test_opset_outside_parser_range_is_a_problem():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    report = check_onnx(_model([helper.make_node("Relu", ["x"], ["y"])], [x],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], opset=23))
    assert not report.findings and "opset 23" in report.problems[0]


def test_cli_reports_a_clean_graph(trt_onnx, capsys):
    assert main(["trt-check", str(trt_onnx)]) == 0
    assert "every node is supported" in capsys.readouterr().out
