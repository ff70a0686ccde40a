"""The speculative runtime: load a bundle, schedule rounds on its compiled graphs."""
from .engine import Completion, SpecModel, StreamEvent, load

__all__ = ["Completion", "SpecModel", "StreamEvent", "load"]
