"""User-facing errors. The CLI prints their message and exits with code 2, no traceback.

Messages echo input (paths, manifest keys, prompts), so every control character in them is
escaped when the error is made: a crafted file name cannot end a line early and print a forged
one ("bundle OK") after it, nor send escape sequences to the terminal. Structured multi-line
messages pass their lines as `details`, each escaped on its own.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

# C0 and C1 controls, DEL, the Unicode line and paragraph separators, and the bidirectional
# overrides and isolates (which reorder what a terminal shows)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escaped(match: re.Match) -> str:
    c = match.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape_control(text: object, keep: str = "") -> str:
    """str(text) with every control character shown as an escape (\\n, \\t, \\x1b, \\u202e), except those in
    `keep`. Backslashes are left alone, so escaping twice changes nothing."""
    text = str(text)
    if keep:
        return _UNSAFE.sub(lambda m: m.group() if m.group() in keep else _escaped(m), text)
    return _UNSAFE.sub(_escaped, text)


class SpeccError(Exception):
    """An error caused by input the user can fix; the message says what is wrong and what is allowed."""

    def __init__(self, message: object = "", details: Iterable[object] = ()):
        text = escape_control(message) + "".join("\n  " + escape_control(d) for d in details)
        super().__init__(text)


class RecipeError(SpeccError):
    """A recipe field is missing, of the wrong type, or out of range; path "<file>": the recipe file
    itself cannot be read (the problem names the file)."""

    def __init__(self, path: str, problem: str):
        self.path = path
        super().__init__(f"recipe file: {problem}" if path == "<file>" else f"recipe field '{path}': {problem}")


class ModelError(SpeccError):
    """A model cannot be found, loaded or paired with another."""


class BundleError(SpeccError):
    """A bundle is missing, corrupt, tampered with, or built by incompatible versions."""


class RequestError(SpeccError):
    """A generation request (prompt, limits, sampling settings) is invalid; `field`, when given, names the
    setting at fault as the runtime calls it (json_schema, structural_tag, logit_bias, ...)."""

    def __init__(self, message: object = "", details: Iterable[object] = (), *, field: str | None = None):
        super().__init__(message, details)
        self.field = field


class UnsatisfiableOutputError(RequestError):
    """A request's grammar (`field`: json_schema or structural_tag) admits no output from the point its
    generation reached: the request's own input is at fault, however late it shows."""


class BackendUnavailableError(SpeccError):
    """A backend's package or device is not present on this machine."""
