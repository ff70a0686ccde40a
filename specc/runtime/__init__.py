"""The speculative runtime: load a bundle, schedule rounds on its compiled graphs.

`model.py` (SpecModel, load) · `scheduler.py` (continuous batching) · `rounds.py` (one round:
plain, chain, tree) · `verifier.py` (the target pass and acceptance) · `planning.py` (what a
round drafts: fixed k or the adaptive policy, `adaptive.py`) · `target.py` (the target graph) ·
`drafters/` (one module per way of drafting) · `state.py`, `stats.py`, `kv_cache.py`, `step.py`,
`text.py`. Importing this package loads nothing heavy.
"""
from __future__ import annotations

from importlib import import_module

_EXPORTS = {"Completion": "model", "SpecModel": "model", "load": "model", "StreamEvent": "scheduler",
            "Scheduler": "scheduler"}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
