#!/usr/bin/env python3
"""Turn onnx-tensorrt's docs/operators.md into specc/backends/data/tensorrt_onnx_ops.json.

    python scripts/tensorrt_ops_table.py operators.md --tensorrt 10.1 \
        --source https://github.com/onnx/onnx-tensorrt/blob/release/10.1-GA/docs/operators.md \
        --commit 96e781103cfc4adf4a6bb557e94bac8e693f6f4c > specc/backends/data/tensorrt_onnx_ops.json

Run it again on the operators.md of a newer TensorRT release to update the table; the
op-coverage check (specc/backends/trt_coverage.py) reads only the JSON.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

# operators.md type names -> ONNX TensorProto element type names
TYPE_NAMES = {"FP32": "FLOAT", "FP16": "FLOAT16", "BF16": "BFLOAT16", "INT32": "INT32", "INT64": "INT64",
              "INT8": "INT8", "UINT8": "UINT8", "BOOL": "BOOL", "FP8": "FLOAT8E4M3FN", "INT4": "INT4",
              "DOUBLE": "DOUBLE"}
TYPOS = {"INF64": "INT64"}  # operators.md 10.1 writes INF64 for ConstantOfShape
INPUT_TYPOS = {"is_traning": "training_mode"}  # and is_traning for Dropout's training_mode input
CONSTANT_INPUT = re.compile(r"`(\w+)`(?: input)? must be (?:an initializer|a constant tensor|a build-time constant)")


def parse(markdown: str) -> dict:
    opset = re.search(r"opset (\d+) to opset (\d+)", markdown)
    operators, unsupported, corrections = {}, [], []
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or cells[1] not in ("Y", "N"):
            continue
        name = cells[0]
        if cells[1] == "N":
            unsupported.append(name)
            continue
        types = []
        for t in filter(None, (t.strip() for t in (cells[2] if len(cells) > 2 else "").split(","))):
            if t in TYPOS:
                corrections.append(f"{name}: {t} read as {TYPOS[t]}")
                t = TYPOS[t]
            types.append(TYPE_NAMES[t])
        restriction = cells[3] if len(cells) > 3 else ""
        entry = {"types": types}
        if restriction:
            entry["restrictions"] = restriction
            constants = []
            for c in CONSTANT_INPUT.findall(restriction):
                if c in INPUT_TYPOS:
                    corrections.append(f"{name}: input `{c}` read as `{INPUT_TYPOS[c]}`")
                constants.append(INPUT_TYPOS.get(c, c))
            if constants:
                entry["constant_inputs"] = constants
        operators[name] = entry
    return {"opset_min": int(opset.group(1)), "opset_max": int(opset.group(2)), "operators": operators,
            "unsupported": unsupported, "corrections": corrections}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("markdown")
    ap.add_argument("--tensorrt", required=True, help="TensorRT version the table describes")
    ap.add_argument("--source", required=True, help="URL of the operators.md read")
    ap.add_argument("--commit", required=True, help="onnx-tensorrt commit of that file")
    args = ap.parse_args()
    with open(args.markdown) as f:
        table = parse(f.read())
    out = {"tensorrt_version": args.tensorrt, "source": args.source, "source_commit": args.commit,
           "type_semantics": "types of each node's first input (the operand the table's types describe); "
                             "nodes without inputs: their first output", **table}
    sys.stdout.write(dumps(out))


def dumps(table: dict) -> str:
    """JSON with one line per operator, so that a diff between TensorRT versions reads well."""
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in table.items() if k != "operators"]
    ops = [f"  {json.dumps(name)}: {json.dumps(entry)}" for name, entry in table["operators"].items()]
    return "{\n" + "\n".join(lines) + '\n "operators": {\n' + ",\n".join(ops) + "\n }\n}\n"


if __name__ == "__main__":
    main()
