"""A pickle-free file form of an ExportedProgram: the graph as JSON, the tensors as safetensors.

`torch.export.save` writes a `.pt2` zip whose sample inputs (and any opaque constant) are
pickles that `torch.export.load` unpickles, and whose `guards_code` strings are compiled into
a Python function: loading one runs code from the file. This form keeps only what running
the graph needs:

    program.json         torch's own JSON schema of the program (torch._export.serde), with
                         sample inputs dropped, guards_code empty and node metadata removed
    weights.safetensors  parameters, buffers and tensor constants

and `load_program` checks the JSON before torch's deserializer sees it: every node target
is an `aten`/`prims` operator or one of a few Python operators, every symbolic-shape
expression uses only sympy's arithmetic (torch parses them with `sympy.sympify`, an
`eval`), and no guard code or metadata is present. What remains trusted: torch's JSON
deserializer and the aten kernels the graph calls (docs/security.md).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from ..errors import BundleError, SpeccError

PROGRAM = "program.json"
WEIGHTS = "weights.safetensors"
_STATE, _CONST = "state_dict.", "constants."

_OP = re.compile(r"torch\.ops\.(aten|prims)\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+")
_PY_OPS = {f"_operator.{n}" for n in ("getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "eq", "ne",
                                      "lt", "le", "gt", "ge", "and_", "or_", "not_", "pow")}
_PY_OPS |= {f"torch.sym_{n}" for n in ("float", "int", "max", "min", "not", "ite", "sqrt", "sum")}
_DENIED_OPS = re.compile(r"torch\.ops\.aten\.(from_file|_?set_|.*_unsafe_.*|.*storage.*)\..*")
_SYM_WORDS = {"Symbol", "Integer", "Add", "Mul", "Pow", "Rational", "Float", "Mod", "Max", "Min", "True", "False",
              "positive", "integer", "nonnegative", "real", "finite", "FloorDiv", "ModularIndexing", "Where",
              "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural",
              "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat",
              "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "OpaqueUnaryFn_sqrt", "BitwiseFn_bitwise_and",
              "BitwiseFn_bitwise_or", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Abs", "Piecewise",
              "oo", "zoo", "nan"}
_SYM_TOKEN = re.compile(r"\s+|'[a-z]+[0-9]*'|[A-Za-z_][A-Za-z0-9_]*|[0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?|[(),=+\-*/]")


def save_program(program: ExportedProgram, out_dir: Path) -> list[str]:
    """Write program.json and weights.safetensors; returns the file names."""
    from safetensors.torch import save_file
    from torch._export.serde.serialize import serialize

    tensors = {}
    for fqn, value in program.state_dict.items():
        tensors[_STATE + fqn] = value.detach().contiguous().clone()
    for fqn, value in program.constants.items():
        if not isinstance(value, torch.Tensor):
            raise SpeccError(f"the graph holds a non-tensor constant {fqn!r} ({type(value).__name__}); the torch "
                             "backend stores tensors only (no pickles)")
        tensors[_CONST + fqn] = value.detach().contiguous().clone()
    artifact = serialize(program)
    data = json.loads(artifact.exported_program)
    data["guards_code"] = []
    _strip_metadata(data)
    (out_dir / PROGRAM).write_text(json.dumps(data, separators=(",", ":")))
    save_file(tensors, str(out_dir / WEIGHTS))
    return [PROGRAM, WEIGHTS]


def load_program(graph_dir: Path) -> ExportedProgram:
    """The program in graph_dir, checked (check_program) and rebuilt without unpickling anything."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _bytes_to_dataclass

    where = f"{graph_dir.name}/{PROGRAM}"
    try:
        data = json.loads((graph_dir / PROGRAM).read_bytes())
    except (ValueError, RecursionError) as exc:
        raise BundleError(f"{where} is not valid JSON ({str(exc)[:120]})") from None
    check_program(data, where)
    _strip_metadata(data)
    try:
        tensors = load_file(str(graph_dir / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as exc:
        raise BundleError(f"{graph_dir.name}/{WEIGHTS} is not a readable safetensors file: {exc}") from None
    state = {k[len(_STATE):]: v for k, v in tensors.items() if k.startswith(_STATE)}
    constants = {k[len(_CONST):]: v for k, v in tensors.items() if k.startswith(_CONST)}
    params = _parameter_names(data)
    state = {k: torch.nn.Parameter(v, requires_grad=False) if k in params else v for k, v in state.items()}
    try:
        serialized = _bytes_to_dataclass(schema.ExportedProgram, json.dumps(data).encode())
        return ExportedProgramDeserializer().deserialize(serialized, state, constants, None)
    except Exception as exc:  # torch raises many types for a program it cannot rebuild
        raise BundleError(f"{where} could not be rebuilt by torch {torch.__version__} "
                          f"({type(exc).__name__}: {str(exc)[:200]}); compile the recipe again") from None


def check_program(data: Any, where: str) -> None:
    """Refuse anything in the program JSON that would run code other than aten/prims operators."""
    if not isinstance(data, dict) or not isinstance(data.get("graph_module"), dict):
        raise BundleError(f"{where} is not an exported program")
    if data.get("guards_code"):
        raise BundleError(f"{where} carries guards_code (Python source that torch compiles); specc writes none")
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "target" and isinstance(value, str):
                    _check_target(value, where)
                elif key == "expr_str":
                    _check_expr(value, where)
                elif key == "custom_obj" or key == "as_custom_obj":
                    raise BundleError(f"{where} refers to a custom (pickled) object; specc writes none")
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def _check_target(target: str, where: str) -> None:
    if (_OP.fullmatch(target) or target in _PY_OPS) and not _DENIED_OPS.fullmatch(target):
        return
    raise BundleError(f"{where} calls {target[:80]!r}; the torch backend runs only aten/prims operators and basic "
                      "Python arithmetic")


def _check_expr(expr: Any, where: str) -> None:
    if not isinstance(expr, str) or len(expr) > 10_000:
        raise BundleError(f"{where} has a malformed shape expression")
    pos = 0
    while pos < len(expr):
        match = _SYM_TOKEN.match(expr, pos)
        word = match.group(0) if match else expr[pos:pos + 20]
        if not match or (word[0].isalpha() or word[0] == "_") and word not in _SYM_WORDS:
            raise BundleError(f"{where} has a shape expression with {word!r}, which is not sympy arithmetic: "
                              f"{expr[:80]!r}")
        pos = match.end()


def _strip_metadata(data: Any) -> None:
    """Empty every node's metadata (stack traces, module paths, source functions: not needed to run)."""
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "target" in node and "metadata" in node:
                node["metadata"] = {}
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _parameter_names(data: dict) -> set[str]:
    names = set()
    for spec in data["graph_module"].get("signature", {}).get("input_specs", []):
        param = spec.get("parameter") if isinstance(spec, dict) else None
        if isinstance(param, dict) and isinstance(param.get("parameter_name"), str):
            names.add(param["parameter_name"])
    return names
