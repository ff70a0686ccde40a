"""A small writer of protobuf text format, the syntax of Triton's `config.pbtxt`.

Messages are dicts, repeated fields lists, enum values `Enum("TYPE_STRING")`; map fields
(such as `parameters`) are lists of `{"key": ..., "value": {...}}` entries. The writer needs
no protobuf package; the tests parse every file it writes with tritonclient's
`model_config_pb2.ModelConfig`.
"""
from __future__ import annotations


class Enum(str):
    """An enum value, written bare (`TYPE_FP32`), not quoted."""


def to_pbtxt(message: dict, header: str = "") -> str:
    """The text-format form of `message`, after `header` written as `#` comment lines."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += _fields(message, 0)
    return "\n".join(lines) + "\n"


def _fields(message: dict, depth: int) -> list[str]:
    pad = "  " * depth
    out = []
    for name, value in message.items():
        if value is None:
            continue
        if isinstance(value, dict):
            out += [f"{pad}{name} {{", *_fields(value, depth + 1), f"{pad}}}"]
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out.append(f"{pad}{name} [")
            for i, item in enumerate(value):
                close = "}," if i + 1 < len(value) else "}"
                out += [f"{pad}  {{", *_fields(item, depth + 2), f"{pad}  {close}"]
            out.append(f"{pad}]")
        elif isinstance(value, list):
            out.append(f"{pad}{name}: [ {', '.join(_scalar(v) for v in value)} ]")
        else:
            out.append(f"{pad}{name}: {_scalar(value)}")
    return out


def _scalar(value) -> str:
    if isinstance(value, Enum):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    raise TypeError(f"cannot write {type(value).__name__} {value!r} in protobuf text format")
