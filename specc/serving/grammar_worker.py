"""Schemas and structural tags compiled and checked in a worker process before the server compiles them.

Why a process: the satisfiability search (runtime/grammar.admits_output) is Python, and while a request's
thread runs it, the engine thread waits for the interpreter lock at each of the many times a round takes it
back from a kernel, so every stream's tokens come late. In a process of its own, at a low CPU priority and
out of any real-time class the server runs in, the search takes little of the server's CPU and none of its
interpreter lock; and a compile that runs past its time limit is killed with its process (a thread cannot
be stopped), its schema answered with a 400 and remembered as such.

The server compiles a schema itself only once the worker compiled it within WORKER_SECONDS of CPU time and
MAX_GRAMMAR_BYTES and found an output (xgrammar's compile releases the interpreter lock). The grammar is not
sent back: its serialised form is several times its memory, and reading it costs about what compiling does.

Protocol, over the worker's stdin and stdout: frames of a 4-byte big-endian length and UTF-8 JSON. The first
frame is the tokenizer (xgrammar's serialised TokenizerInfo, vocabulary size, stop tokens), answered
{"ready": true}; then each {"key": KEY} is answered {"error": MESSAGE or null}.
"""
from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..runtime.grammar import CompactJsonMatcher, Grammars, _first_line, _low_priority, admits_output, printable_mask
from ..runtime.grammar_keys import (HINTS, JSON_OBJECT, MAX_GRAMMAR_BYTES, TAG_KEY, UNSATISFIABLE, GrammarChecker,
                                    compile_key, too_slow)
from ..errors import RequestError
from .memory import trim

WORKER_SECONDS = 5.0  # one job's CPU time: half a request's wait (COMPILE_TIMEOUT_S), the server's own compile the rest
WALL_SECONDS = 120.0  # one job's (or the start's) wall time, whatever the load: past it the worker is taken as stuck
POLL_SECONDS = 0.1
HEADER = struct.Struct(">I")


class WorkerGone(Exception):
    """The worker process exited (or could not be written to)."""


class WorkerTimeout(WorkerGone):
    """The worker used up a job's time."""


class WorkerNotStarted(WorkerGone):
    """The worker process did not start."""


class GrammarWorker(GrammarChecker):
    """The server's side: one worker process, one job at a time; killed and started again after a job that
    used more than `seconds` of CPU time (wall time would count the time a busy server left it none) or that
    killed it. Started by `start` (in the background) or on first use."""

    def __init__(self, grammars: Grammars, seconds: float = WORKER_SECONDS, log=print):
        grammars.compiler()  # RequestError without xgrammar
        self.seconds, self.log = seconds, log
        self._init = _frame({"tokenizer_info": grammars.info.serialize_json(), "vocab_size": grammars.vocab_size,
                             "eos_ids": grammars.eos_ids})
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._settled = threading.Event()  # no start under way (set once a started worker is ready, or failed)
        self._settled.set()

    def start(self) -> None:
        """Start the worker in a thread of its own (`wait_ready` waits for it)."""
        self._settled.clear()

        def run():
            try:
                with self._lock:
                    self._started()
            except WorkerGone as exc:
                self.log(f"specc serve: the grammar worker did not start ({exc}); it is tried again on first use")
            finally:
                self._settled.set()

        threading.Thread(target=run, name="specc-grammar-worker-start", daemon=True).start()

    def wait_ready(self) -> None:
        self._settled.wait(WALL_SECONDS)

    def check(self, key: str) -> str | None:
        what = "structural_tag" if key.startswith(TAG_KEY) else "json_schema"
        with self._lock:
            try:
                proc = self._started()
                _send(proc, _frame({"key": key}))
                return _receive(proc, self.seconds)["error"]
            except WorkerNotStarted as exc:
                self.log(f"specc serve: the grammar worker did not start: {exc}")
                return f"{what} could not be checked: the server's grammar worker did not start"
            except WorkerTimeout:
                self._stop()
                self.start()  # ready again before the next schema comes
                return too_slow(what, self.seconds)
            except WorkerGone as exc:
                self._stop()
                self.start()
                self.log(f"specc serve: the grammar worker exited while checking a {what}: {exc}")
                return f"{what} could not be compiled: the grammar library failed on it"

    def _started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        root = str(Path(__file__).resolve().parents[2])  # the specc this server runs, whatever is installed
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        self._proc = subprocess.Popen([sys.executable, "-m", "specc.serving.grammar_worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env)
        try:
            _send(self._proc, self._init)
            _receive(self._proc, None)
        except WorkerGone as exc:
            self._stop()
            raise WorkerNotStarted(f"{type(exc).__name__}: {exc}") from None
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def attach(grammars: Grammars, log=print) -> GrammarWorker | None:
    """Check `grammars`' schemas and tags in a worker process, started now in the background; None without
    xgrammar. Builds the tokenizer's grammar tables here, which a large vocabulary takes a second for: the
    server does it before it takes requests, not while a first structured request holds the interpreter lock."""
    try:
        worker = GrammarWorker(grammars, log=log)
    except RequestError:
        return None
    grammars.use_checker(worker)
    worker.start()
    return worker


def detach(grammars: Grammars, worker: GrammarWorker | None) -> None:
    """Stop the worker `attach` gave `grammars`."""
    if worker is not None:
        if grammars.checker is worker:
            grammars.checker = None
        worker.close()


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return HEADER.pack(len(data)) + data


def _send(proc: subprocess.Popen, frame: bytes) -> None:
    try:
        proc.stdin.write(frame)
        proc.stdin.flush()
    except (BrokenPipeError, OSError) as exc:
        raise WorkerGone(f"exited with {proc.poll()}") from exc


def _receive(proc: subprocess.Popen, cpu_seconds: float | None) -> dict:
    """The next frame from the worker: WorkerTimeout once it has used `cpu_seconds` of CPU time (None: no
    limit) or WALL_SECONDS have passed."""
    fd, began = proc.stdout.fileno(), time.monotonic()
    cpu_began = _cpu_seconds(proc.pid)

    def used() -> float:  # the job's CPU time, or its wall time where the CPU time cannot be read
        now = _cpu_seconds(proc.pid) if cpu_began is not None else None
        return now - cpu_began if now is not None else time.monotonic() - began

    def read(n: int) -> bytes:
        data = b""
        while len(data) < n:
            if not select.select([fd], [], [], POLL_SECONDS)[0]:
                if time.monotonic() - began > WALL_SECONDS:
                    raise WorkerTimeout(f"no answer in {WALL_SECONDS:g} s")
                if cpu_seconds is not None and used() > cpu_seconds:
                    raise WorkerTimeout(f"more than {cpu_seconds:g} s of CPU time")
                continue
            part = os.read(fd, n - len(data))
            if not part:
                raise WorkerGone(f"exited with {proc.wait()}")
            data += part
        return data

    return json.loads(read(HEADER.unpack(read(HEADER.size))[0]))


def _cpu_seconds(pid: int) -> float | None:
    """CPU time process `pid` has used (Linux's /proc), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


# -- the worker process ---------------------------------------------------------------------------------
def serve(inp, out) -> None:
    """Answer frames from `inp` on `out` until `inp` ends."""
    import xgrammar as xgr

    first = _read(inp)
    info = xgr.TokenizerInfo.deserialize_json(first["tokenizer_info"])
    vocab, eos = first["vocab_size"], first["eos_ids"]
    printable = printable_mask(info.decoded_vocab, vocab, eos)
    stops = printable_mask([b"\0"] * vocab, vocab, eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write(out, {"ready": True})
    while (job := _read(inp)) is not None:
        _write(out, {"error": check(compiler, job["key"], vocab, printable, stops)})
        trim()  # a large grammar's memory back to the system, not kept for the next


def check(compiler, key: str, vocab: int, printable, stops) -> str | None:
    """Why `key` cannot be used (the message of a RequestError), or None: it compiles, within
    MAX_GRAMMAR_BYTES, and a schema admits some output under the printable mask."""
    import xgrammar as xgr

    what = "structural_tag" if key.startswith(TAG_KEY) else "json_schema"
    try:
        grammar = compile_key(compiler, key)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError (and MemoryError) with its own message
        return f"{what} could not be compiled: {_first_line(exc)}"
    size = grammar.memory_size_bytes
    if size > MAX_GRAMMAR_BYTES:
        return (f"{what} compiles to a grammar of {size >> 20} MiB; allowed at most {MAX_GRAMMAR_BYTES >> 20} MiB: "
                f"simplify it {HINTS[what]}")
    if key.startswith(TAG_KEY) or key == JSON_OBJECT:
        return None
    matcher = CompactJsonMatcher(xgr.GrammarMatcher(grammar), printable, stops)
    return UNSATISFIABLE if admits_output(matcher, vocab) is False else None


def _read(inp) -> dict | None:
    head = inp.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    return json.loads(inp.read(HEADER.unpack(head)[0]))


def _write(out, obj) -> None:
    out.write(_frame(obj))
    out.flush()


def main() -> None:
    _low_priority(0)  # a process of its own, holding up no thread of the server whatever its priority
    out = os.fdopen(os.dup(1), "wb")  # the protocol's own copy of stdout; anything printed goes to stderr
    os.dup2(2, 1)
    serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
