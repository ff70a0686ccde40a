"""Will TensorRT's ONNX parser take this graph? A check against TensorRT's operator table.

The table (`data/tensorrt_onnx_ops.json`) is onnx-tensorrt's `docs/operators.md` for the
TensorRT version it names, converted by `scripts/tensorrt_ops_table.py`. The check needs
neither TensorRT nor a GPU: `backend: tensorrt` runs it at compile time before building
engines, and `specc trt-check FILE.onnx` runs it on any ONNX file. Per node it checks that

- the operator is in the default ONNX domain and marked supported;
- its first input's element type (the operand the table's types describe; for nodes
  without inputs, the first output) is one the table lists;
- inputs the table requires to be constant (`axes` of Slice/Squeeze/Reduce*, ...) are
  initializers or Constant outputs;

and that the model's opset is inside the parser's range. Each finding names the node and
where it came from: the graph pass that created it (`specc.pass` metadata, written by
backends/onnx_export.py) or the captured model and its module.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..errors import SpeccError
from ..onnx_passes.quantize_weight_only_dq import OPSET_BLOCKED_DQ
from .onnx_export import PASS_KEY

TABLE = Path(__file__).parent / "data" / "tensorrt_onnx_ops.json"
DEFAULT_DOMAINS = ("", "ai.onnx")


class TensorRTCoverageError(SpeccError):
    """An ONNX graph uses operators, types or forms TensorRT's ONNX parser does not accept."""


@lru_cache(maxsize=1)
def load_table() -> dict:
    """The supported-operator table, with its TensorRT version and source."""
    return json.loads(TABLE.read_text())


@dataclass(frozen=True)
class Finding:
    node: str
    op_type: str
    problem: str
    origin: str  # "pass NAME", "captured model (module)" or "no provenance recorded"

    def __str__(self) -> str:
        return f"node {self.node!r} ({self.op_type}) from {self.origin}: {self.problem}"


@dataclass
class CoverageReport:
    source: str
    tensorrt_version: str
    opset: int
    op_counts: dict[str, int]
    findings: list[Finding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # model-level (opset)
    warnings: list[str] = field(default_factory=list)  # accepted, with a caveat (DOUBLE is cast down)

    @property
    def ok(self) -> bool:
        return not self.findings and not self.problems

    def summary(self) -> dict:
        """What the manifest records about the check."""
        table = load_table()
        return {"tensorrt_table": table["tensorrt_version"], "source": table["source"], "opset": self.opset,
                "nodes": sum(self.op_counts.values()), "operators": dict(sorted(self.op_counts.items())),
                "unsupported": [str(f) for f in self.findings] + self.problems, "warnings": self.warnings}

    def message(self, limit: int = 20) -> str:
        table = load_table()
        lines = [f"{self.source} cannot be parsed by TensorRT {self.tensorrt_version} "
                 f"(supported-operator table: {table['source']}):"]
        lines += [f"  {p}" for p in self.problems]
        lines += [f"  {f}" for f in self.findings[:limit]]
        if len(self.findings) > limit:
            lines.append(f"  ... and {len(self.findings) - limit} more nodes")
        return "\n".join(lines)

    def raise_if_unsupported(self) -> None:
        if not self.ok:
            raise TensorRTCoverageError(self.message())


def check_onnx(model, source: str | None = None) -> CoverageReport:
    """Check an ONNX model (a ModelProto or a path; weights are not read) against the table."""
    import onnx

    if not isinstance(model, onnx.ModelProto):
        source = source or str(model)
        try:
            model = onnx.load(str(model), load_external_data=False)
        except Exception as exc:  # protobuf's DecodeError and friends
            from ..errors import SpeccError

            raise SpeccError(f"{source} is not an ONNX model ({type(exc).__name__}: {str(exc)[:200]})") from None
    source = source or "the ONNX model"
    table = load_table()
    opset = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
    report = CoverageReport(source, table["tensorrt_version"], opset, {})
    blocked_dq = opset == OPSET_BLOCKED_DQ and any(
        n.op_type == "DequantizeLinear" and any(a.name == "block_size" for a in n.attribute) for n in model.graph.node)
    if blocked_dq and opset > table["opset_max"]:
        report.warnings.append(f"opset {opset} is declared for DequantizeLinear's block_size (int4 weight-only blocks); "
                               f"the table lists opsets up to {table['opset_max']}: the parser must read block_size")
    elif not table["opset_min"] <= opset <= table["opset_max"]:
        report.problems.append(f"opset {opset} is outside the opsets TensorRT {table['tensorrt_version']} parses "
                               f"({table['opset_min']}..{table['opset_max']}); export at an opset in that range")
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is only a source of element types; the checks below work without it
        pass
    _check_graph(model.graph, table, opset, report, {})
    return report


def _elem_types(graph, outer: dict) -> tuple[dict, set]:
    """Element type of every value visible in graph, and the names that are constants."""
    types = dict(outer)
    constants = {i.name for i in graph.initializer} | {i.values.name for i in graph.sparse_initializer}
    for i in graph.initializer:
        types[i.name] = i.data_type
    for v in list(graph.input) + list(graph.value_info) + list(graph.output):
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
            constants.update(node.output)
    return types, constants


def _check_graph(graph, table: dict, opset: int, report: CoverageReport, outer: dict) -> None:
    import onnx

    types, constants = _elem_types(graph, outer)
    operators = table["operators"]
    for node in graph.node:
        report.op_counts[node.op_type] = report.op_counts.get(node.op_type, 0) + 1
        name = node.name or f"{node.op_type} -> {', '.join(node.output)}"
        problem = None
        if node.op_type == "MatMulNBits":
            problem = ("MatMulNBits is ONNX Runtime's weight-only kernel, not an ONNX operator; for TensorRT express the "
                       "weights as DequantizeLinear → MatMul (onnx_passes/quantize_weight_only_dq.py)")
        elif node.domain not in DEFAULT_DOMAINS:
            problem = f"operator domain {node.domain!r} is not ONNX's; TensorRT's parser reads ai.onnx operators only"
        elif node.op_type not in operators:
            listed = "listed as unsupported" if node.op_type in table["unsupported"] else "not in the table"
            problem = f"operator {node.op_type} is {listed} for TensorRT {table['tensorrt_version']}"
        else:
            spec = operators[node.op_type]
            problem = (_type_problem(node, spec, types, report) or _constant_problem(node, spec, constants, opset)
                       or _weight_only_problem(node, types, constants, graph))
        if problem:
            report.findings.append(Finding(name, node.op_type, problem, origin(node)))
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _check_graph(attr.g, table, opset, report, types)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _check_graph(g, table, opset, report, types)


def _type_problem(node, spec: dict, types: dict, report: CoverageReport) -> str | None:
    import onnx

    operand = next((i for i in node.input if i), None) or (node.output[0] if node.output else None)
    elem = types.get(operand)
    if not elem or not spec["types"]:
        return None
    type_name = onnx.TensorProto.DataType.Name(elem)
    if type_name in spec["types"]:
        return None
    if type_name == "DOUBLE":
        report.warnings.append(f"node {node.name!r} ({node.op_type}) computes in DOUBLE; TensorRT casts it to FLOAT")
        return None
    return f"element type {type_name} of {operand!r} is not supported (supported: {', '.join(spec['types'])})"


def _constant_problem(node, spec: dict, constants: set, opset: int) -> str | None:
    import onnx

    wanted = spec.get("constant_inputs")
    if not wanted:
        return None
    try:
        names = [i.name for i in onnx.defs.get_schema(node.op_type, opset, node.domain).inputs]
    except onnx.defs.SchemaError:
        return None
    for wanted_name in wanted:
        if wanted_name in names:
            index = names.index(wanted_name)
            value = node.input[index] if index < len(node.input) else ""
            if value and value not in constants:
                return f"input `{wanted_name}` ({value!r}) must be a constant (initializer) for TensorRT: {spec['restrictions']}"
    return None


def _weight_only_problem(node, types: dict, constants: set, graph) -> str | None:
    """Weight-only DequantizeLinear as TensorRT builds it: constant weights, no non-zero zero point, INT4 blocked."""
    import onnx

    if node.op_type != "DequantizeLinear":
        return None
    if node.input[0] not in constants:
        return f"input `x` ({node.input[0]!r}) must be a constant weight for a weight-only DequantizeLinear"
    if len(node.input) > 2 and node.input[2]:
        zp = next((i for i in graph.initializer if i.name == node.input[2]), None)
        if zp is None or onnx.numpy_helper.to_array(zp).any():
            return f"zero point {node.input[2]!r} must be a constant zero (TensorRT has no zero points)"
    elem = types.get(node.input[0])
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if elem == onnx.TensorProto.INT4 and not attrs.get("block_size"):
        return "INT4 weights need block quantisation (a block_size attribute): TensorRT has no per-tensor INT4"
    return None


def origin(node) -> str:
    """Where an ONNX node came from: the graph pass that made it, or the captured model's module."""
    props = {p.key: p.value for p in node.metadata_props}
    if PASS_KEY in props:
        return f"pass {props[PASS_KEY]}"
    if "pkg.torch.onnx.name_scopes" in props:
        try:
            scopes = ast.literal_eval(props["pkg.torch.onnx.name_scopes"])
        except (ValueError, SyntaxError):
            scopes = []
        module = scopes[-2] if len(scopes) >= 2 else ""  # each scope is a full module path; the last is the node
        return f"captured model ({module})" if module else "captured model"
    return "no provenance recorded (not exported by specc)"


def format_report(report: CoverageReport) -> str:
    """The report `specc trt-check` prints."""
    table = load_table()
    head = (f"{report.source}: opset {report.opset}, {sum(report.op_counts.values())} nodes, "
            f"{len(report.op_counts)} operator types; TensorRT {table['tensorrt_version']} table from {table['source']}")
    if report.ok:
        body = "every node is supported: " + ", ".join(f"{k} x{v}" for k, v in sorted(report.op_counts.items()))
    else:
        body = report.message(limit=200)
    return "\n".join([head, body, *(f"warning: {w}" for w in report.warnings)])
