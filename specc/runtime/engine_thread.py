"""One worker thread that owns a Scheduler: it takes work queued by other threads between rounds,
runs rounds while there is work, and hands every event on.

Shared by `specc serve` (serving/engine.py) and the Triton model (triton/orchestrator.py); they
differ in how queued work is admitted, where events go and what a failed round answers, which
are the hooks below. Nothing a request does stops the thread: an exception in a hook or a round
goes to `abort`, whose owner answers the requests in flight and calls `restart`.
"""
from __future__ import annotations

import queue
import threading

from .model import SpecModel
from .scheduler import Scheduler, StreamEvent


class EngineThread:
    idle_poll_s = 0.05  # how often an idle thread looks for new work or shutdown

    def __init__(self, model: SpecModel, name: str, **scheduler_options):
        self.model, self.scheduler_options = model, scheduler_options
        self.scheduler = Scheduler(model, **scheduler_options)
        self.inbox: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Ask the thread to stop after its current round and wait for it."""
        self._closing.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def restart(self) -> None:
        """A fresh Scheduler (after a failed round, the old batch's state cannot be trusted)."""
        self.scheduler = Scheduler(self.model, **self.scheduler_options)

    def drain(self) -> list:
        """Everything queued now, without waiting."""
        items = []
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items

    # -- hooks --------------------------------------------------------------------------------
    def admit(self, items: list) -> None:
        """Turn queued items into Scheduler requests (`self.scheduler.submit`)."""
        raise NotImplementedError

    def emit(self, event: StreamEvent) -> None:
        """Deliver one event of a round."""
        raise NotImplementedError

    def after_round(self) -> None:
        """Called after each round, before its events are emitted."""

    def idle(self) -> None:
        """Called when there is no work (about every idle_poll_s)."""

    def abort(self, exc: Exception) -> None:
        """A hook or a round raised: answer the requests in flight, then `restart`."""
        raise NotImplementedError

    # -- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                items = self._take(wait=not self.scheduler.busy)
                if items:
                    self.admit(items)
                if not self.scheduler.busy:
                    self.idle()
                    continue
                events = self.scheduler.step()
                self.after_round()
                for event in events:
                    self.emit(event)
            except Exception as exc:  # a failure must not take the thread down
                self.abort(exc)

    def _take(self, wait: bool) -> list:
        try:
            first = self.inbox.get(timeout=self.idle_poll_s) if wait else self.inbox.get_nowait()
        except queue.Empty:
            return []
        return [first] + self.drain()
