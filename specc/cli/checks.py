"""Checks of a command's inputs that run before anything is loaded, so a wrong path or number fails
at once with one message instead of after seconds of loading."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import SpeccError


def bundle_dir(path: Path) -> None:
    """A bundle argument names a directory (its manifest is read first thing when it opens)."""
    if not path.exists():
        raise SpeccError(f"bundle {path} does not exist; build one with `specc compile RECIPE`")
    if not path.is_dir():
        raise SpeccError(f"bundle {path} is not a directory; allowed a bundle directory written by `specc compile`")


def input_file(path: Path | None, what: str) -> None:
    """A file the command reads exists and is a file."""
    if path is not None and not path.is_file():
        state = "is a directory" if path.is_dir() else "does not exist"
        raise SpeccError(f"{what} {path} {state}; allowed an existing file")


def input_dir(path: Path | None, what: str) -> None:
    """A directory the command reads exists."""
    if path is not None and not path.is_dir():
        raise SpeccError(f"{what} {path} {'is not a directory' if path.exists() else 'does not exist'}")


def output_file(path: Path | None, flag: str = "--json") -> None:
    """A file the command writes at its end could be written (its missing folders are created)."""
    if path is None:
        return
    if path.is_dir():
        raise SpeccError(f"{flag} {path}: a directory; allowed a file path (its folders are created)")
    folder = next(p for p in path.absolute().parents if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise SpeccError(f"{flag} {path}: {folder} is {'not a folder' if not folder.is_dir() else 'not writable'}; "
                         "allowed a file path under a folder you can write")


def at_least(value: int | None, flag: str, low: int = 1) -> None:
    """An integer option is at least `low` (None: not given, its default applies)."""
    if value is not None and value < low:
        raise SpeccError(f"{flag} {value}: allowed an integer >= {low}")


def llamacpp_installed(why: str) -> None:
    """A llama.cpp binding (the `llamacpp` or `llamacpp-native` extra) is importable."""
    from ..bench.llamacpp_sync import binding

    binding(why)


def warm_file(path: Path | None) -> list[str]:
    """The texts of a --warm file, read and checked before any bundle loads: JSON lines of {"text": ...} or
    {"prompt": ..., "completion": ...}; a completion is what is kept (the output later requests repeat)."""
    if path is None:
        return []
    input_file(path, "--warm")
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpeccError(f"--warm {path}: cannot be read as UTF-8 text ({exc}); allowed a JSON-lines file") from None
    texts = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpeccError(f"--warm {path}, line {no}: not JSON ({exc.msg}); allowed one JSON object a line") from None
        text = record.get("text", record.get("completion")) if isinstance(record, dict) else None
        if not isinstance(text, str) or not isinstance(record.get("prompt", ""), str):
            raise SpeccError(f"--warm {path}, line {no}: allowed an object with \"text\" (a string), or \"completion\" "
                             "(a string) and optionally \"prompt\"")
        texts.append(text)
    return texts
