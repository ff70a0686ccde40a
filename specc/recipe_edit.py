"""Editing a recipe YAML file in place: set a few fields and keep the file's comments and layout (a YAML
round trip would drop them); the edited text must parse to the same recipe with only those fields changed."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from .errors import SpeccError
from .recipe import parse_recipe


def set_recipe_fields(path: Path, fields: dict[tuple[str, str], object]) -> dict[tuple[str, str], object]:
    """Set (section, key) fields of a recipe YAML file (speculation.k, draft.stop_below), keeping its comments
    and layout; returns the old values.

    The edited text is validated: it must parse to the same recipe with only those fields changed.
    """
    path = Path(path)
    text = path.read_text()
    before = parse_recipe(yaml.safe_load(text), str(path))
    edited, want = text, before.to_dict()
    for (section, key), value in fields.items():
        edited = _edit_field(edited, section, key, value)
        want[section][key] = value
    by_hand = ", ".join(f"{section}.{key}: {value}" for (section, key), value in fields.items())
    try:
        after = parse_recipe(yaml.safe_load(edited), str(path))
    except (yaml.YAMLError, SpeccError) as exc:
        raise SpeccError(f"could not edit {path} ({exc}); set {by_hand} by hand") from None
    if after.to_dict() != want:
        raise SpeccError(f"could not edit {path} safely; set {by_hand} by hand")
    path.write_text(edited)
    old = before.to_dict()
    return {(section, key): old[section][key] for section, key in fields}


def _edit_field(text: str, section: str, key: str, value) -> str:
    """Text with `section.key: value`: replaced where the section has the key, else added to the section
    (flow or block style), else a new section at the end."""
    sec, k = re.escape(section), re.escape(key)
    if m := re.search(rf"^({sec}:[ \t]*\{{)([^}}\n]*)(\}}.*)$", text, re.M):
        inner = m.group(2)
        if re.search(rf"(^|,)\s*{k}\s*:", inner):
            inner = re.sub(rf"((?:^|,)\s*{k}\s*:\s*)[^,]*?(\s*(?:,|$))", rf"\g<1>{value}\g<2>", inner, count=1)
        else:
            inner = inner.rstrip() + (", " if inner.strip() else "") + f"{key}: {value}"
        return text[:m.start()] + m.group(1) + inner + m.group(3) + text[m.end():]
    if m := re.search(rf"^{sec}:[ \t]*(#.*)?$", text, re.M):
        body_start = m.end() + 1
        lines = text[body_start:].split("\n")
        end = next((i for i, line in enumerate(lines) if line.strip() and not line[0].isspace() and not line.startswith("#")),
                   len(lines))
        block = lines[:end]
        for i, line in enumerate(block):
            if km := re.match(rf"^(\s+{k}\s*:\s*)([^#\s]+)(.*)$", line):
                block[i] = f"{km.group(1)}{value}{km.group(3)}"
                break
        else:
            indent = next((re.match(r"^\s+", line).group(0) for line in block if line.strip() and line[0].isspace()), "  ")
            block.insert(0, f"{indent}{key}: {value}")
        return text[:body_start] + "\n".join(block + lines[end:])
    return text.rstrip("\n") + f"\n{section}:\n  {key}: {value}\n"
