"""The speculative runtime: load a bundle, schedule rounds on its compiled graphs.

Two layers: `engine.py` (Engine: target, verifier, drafter, caches, policies, limits) runs under
`scheduler.py` (continuous batching), `planning.py` (what a round drafts; `adaptive.py`) and `rounds.py`
(one round: plain, chain, tree; `record.py`), with `verifier.py` and `drafters/`; `model.py` (SpecModel,
load) is the request-facing API on top. docs/architecture.md lists the files a chain round passes through.
Importing this package loads nothing heavy.
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
