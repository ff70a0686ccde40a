"""What the server process does around its engine's life: its grammar worker, the collector, its memory."""
from __future__ import annotations

import gc

from ..runtime.model import SpecModel
from .grammar_worker import GrammarWorker, attach, detach
from .memory import trim


def starting(model: SpecModel, log=print) -> GrammarWorker | None:
    """Before the engine starts: schemas will be checked off this process's interpreter lock (the grammar
    worker; None without xgrammar), and what was loaded is kept out of the collector's full passes, each of
    which would otherwise walk all of it while holding that lock; what loading freed goes back."""
    worker = attach(model.grammars, log)
    gc.freeze()
    trim()
    return worker


def stopped(model: SpecModel, worker: GrammarWorker | None) -> None:
    """After the engine stopped: the worker ends, and an app inside a longer-lived process (tests) leaves the
    collector as it found it."""
    detach(model.grammars, worker)
    gc.unfreeze()
