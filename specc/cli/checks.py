"""Checks of a command's inputs that run before anything is loaded, so a wrong path or number fails
at once with one message instead of after seconds of loading."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..errors import SpeccError

LLAMACPP_INSTALL = "pip install 'specc[llamacpp]'"


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
    """llama-cpp-python (the `llamacpp` extra) is importable."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise SpeccError(f"{why} needs llama-cpp-python, which is not installed: {LLAMACPP_INSTALL} "
                         "(builds llama.cpp from source: cmake and a C++ compiler)")
