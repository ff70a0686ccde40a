"""User-facing errors. The CLI prints their message and exits with code 2, no traceback."""
from __future__ import annotations


class SpeccError(Exception):
    """An error caused by input the user can fix; the message says what is wrong and what is allowed."""


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
    """A generation request (prompt, limits, sampling settings) is invalid."""


class BackendUnavailableError(SpeccError):
    """A backend's package or device is not present on this machine."""
