"""A real `specc serve` process on loopback, and the raw-socket clients that probe it (bodies cut off
mid-upload, bodies larger than the cap): shared by tests/test_server_hardening.py, tests/test_server_fuzz.py
and the scripts that start servers (serve_attack_latency.py, load_test.py, agent_bench.py)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

try:  # the HTTP client the openai package depends on (httpx2 in openai >= 2.x, httpx before)
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = Path(__file__).resolve().parents[1]


class LiveServer:
    """`python -m specc.cli serve BUNDLE --port 0 --name NAME ...` in a subprocess, once /health answers; stderr
    goes to a file the tests read."""

    def __init__(self, bundle: Path, log: Path, *args: str, start_timeout: float = 120.0, name: str = "tiny"):
        self.log_path = log
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.stderr = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "specc.cli", "serve", str(bundle), "--port", "0",
                                      "--name", name, *args], stdout=subprocess.DEVNULL, stderr=self.stderr,
                                     env=env, cwd=ROOT)
        end = time.monotonic() + start_timeout
        port = None
        while time.monotonic() < end and port is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specc serve exited with {self.proc.returncode}:\n{self.log()}")
            match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", self.log())
            port = int(match.group(1)) if match else None
            time.sleep(0.1)
        if port is None:
            self.stop()
            raise RuntimeError(f"specc serve did not start in {start_timeout} s:\n{self.log()}")
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        while time.monotonic() < end:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"specc serve did not answer /health:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body, timeout: float = 60, **headers) -> "httpx.Response":
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=data, timeout=timeout,
                          headers={"content-type": "application/json", **headers})

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.stderr.close()

    def close(self, timeout: float = 30) -> None:
        """SIGTERM (the server drains), then kill what is left after `timeout` seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.stop()


def raw_request(port: int, head: str, body: bytes = b"", read: bool = True, timeout: float = 30.0) -> tuple[int, bytes]:
    """Send a request head and (part of) a body on a fresh connection; the status and body of the answer
    (0, b"" if the server closed without one), or (-1, b"") without reading when read is False."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        if not read:
            return -1, b""
        data = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                if b"\r\n\r\n" in data:
                    header, _, rest = data.partition(b"\r\n\r\n")
                    length = re.search(rb"(?i)content-length: *(\d+)", header)
                    if length and len(rest) >= int(length.group(1)):
                        break
        except (ConnectionResetError, socket.timeout):
            pass
    if not data.startswith(b"HTTP/1.1 "):
        return 0, b""
    header, _, rest = data.partition(b"\r\n\r\n")
    return int(header.split()[1]), rest


def oversized_body(port: int, declared: int = 20 << 20, sent: int = 256 << 10) -> tuple[int, bytes, float]:
    """A completions request declaring `declared` bytes of body and sending only `sent` of them: the answer
    must come from the declared length alone. Returns (status, body, seconds)."""
    start = time.perf_counter()
    status, body = raw_request(port, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                     f"Content-Length: {declared}\r\n", b'{"prompt": "' + b"a" * sent)
    return status, body, time.perf_counter() - start


def chunked_oversized_body(port: int, total: int = 20 << 20, chunk: int = 1 << 20) -> tuple[int, bytes, float]:
    """The same without a Content-Length (chunked transfer): refused once it grows past the cap."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        data = b""
        try:
            for _ in range(total // chunk):
                s.sendall(f"{chunk:x}\r\n".encode() + b"a" * chunk + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while b"\r\n\r\n" not in data:
                part = s.recv(65536)
                if not part:
                    break
                data += part
            header, _, rest = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", header)
            while length and len(rest) < int(length.group(1)):
                part = s.recv(65536)
                if not part:
                    break
                rest += part
        except (ConnectionResetError, socket.timeout):
            return 0, b"", time.perf_counter() - start
    status = int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, rest, time.perf_counter() - start


def dropped_upload(port: int) -> None:
    """Declare 10 000 bytes of body, send 100, close: the client is gone mid-upload."""
    raw_request(port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      "Content-Length: 10000\r\n", b'{"prompt": "' + b"a" * 88, read=False)


NORMAL = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0}
LONGER = {**NORMAL, "max_tokens": 128}


def normal_latency(server: LiveServer, n: int, body: dict = NORMAL) -> list[float]:
    """Seconds of n normal 12-token greedy requests, one after another on one kept-alive connection (a new
    client per request would time the client's own set-up)."""
    out = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(n):
            start = time.perf_counter()
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out.append(time.perf_counter() - start)
    return out


def post_raw(port: int, body: dict) -> int:
    """POST /v1/completions over a plain socket (cheap for the client, so attacks do not slow the measuring
    client in the same process); the status."""
    data = json.dumps(body).encode()
    return raw_request(port, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(data)}\r\nConnection: close\r\n", data)[0]


def attacks(server: LiveServer, stops: tuple[int, int]) -> list:
    """The requests of the issue's bar, as functions returning the status: a 20 MB body, stop strings one past
    the caps (count, then length), stop strings at the caps (a valid request that runs), a 200k-character
    prompt."""
    count, length = stops

    def big_body():
        return oversized_body(server.port)[0]

    def too_many_stops():
        return post_raw(server.port, {**NORMAL, "stop": ["z" * 8] * (count + 1)})

    def too_long_stop():
        return post_raw(server.port, {**NORMAL, "stop": ["z" * (length + 1)]})

    def maximal_stops():
        return post_raw(server.port, {**NORMAL, "max_tokens": 64, "stop": [chr(0x100 + i) * length for i in range(count)]})

    def long_prompt():
        return post_raw(server.port, {**NORMAL, "prompt": "lorem ipsum " * 16667})

    return [big_body, too_many_stops, too_long_stop, maximal_stops, long_prompt]


def latency_under_attack(server: LiveServer, n: int, stops: tuple[int, int], body: dict = NORMAL,
                         rejected_only: bool = False) -> tuple[list[float], list[float], list]:
    """n pairs of normal requests: one alone, one sent while every attack is in flight beside it (all started
    together just before it); pairs, so that load from elsewhere on the machine hits both sides alike.
    Returns the seconds of the lone and of the attacked requests, and (attack, status, seconds) of every attack.
    rejected_only: leave out the valid request at the stop-string caps (it shares the batch, which costs)."""
    results, idle, attacked = [], [], []

    def run(fn):
        start = time.perf_counter()
        try:
            status = fn()
        except Exception as exc:  # the probe reports what broke instead of dying
            status = f"{type(exc).__name__}: {exc}"
        results.append((fn.__name__, status, time.perf_counter() - start))

    for _ in range(n):
        idle += normal_latency(server, 1, body)
        fns = [fn for fn in attacks(server, stops) if not (rejected_only and fn.__name__ == "maximal_stops")]
        threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in fns]
        for t in threads:
            t.start()
        time.sleep(0.01)
        attacked += normal_latency(server, 1, body)
        for t in threads:
            t.join(60)
    return idle, attacked, results


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
SCHEMA_ATTACKS = {  # the first three are answered 400 at once, the others use the checks' whole budget
    "regex_66_bytes": {"type": "string", "pattern": "^([a-z]{1,62}[0-9]{1,62}){1,62}$"},
    "enum_60000": {"enum": [f"value-{i:06d}" for i in range(60_000)]},
    "unsatisfiable": {"type": "string", "pattern": "^\t\t$"},
    # satisfiable, but the search for an output runs to its state or time bound
    "search_bound": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                     "required": ["a"]},
    # within every bound; with a large vocabulary these compile for seconds to grammars of tens of MB, the
    # first within the checks' time limit (it then runs), the second past it
    "compile_slow": {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{1,20}[0-9]{2,9}$"}
                                                      for i in range(60)}, "required": [f"p{i}" for i in range(60)]},
    "compile_heavy": {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{1,20}[0-9]{2,9}$"}
                                                       for i in range(200)}, "required": [f"p{i}" for i in range(200)]},
}


def stream_gaps(server: LiveServer, body: dict, out: list, until: threading.Event | None = None) -> None:
    """One completions stream; appends (status, [seconds between events after the first]) to out. Stops
    reading (and closes the stream) once `until` is set."""
    gaps, last = [], None
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
            if until is not None and until.is_set():
                break
    out.append((r.status_code, gaps))


def gaps_beside(server: LiveServer, attack, streams: int, body: dict,
                after: float | None = None) -> tuple[list[float], object, float, float]:
    """`streams` innocent streams of `body`, and `attack()` (None: nothing) sent once they flow: each stream's
    largest gap between events, what the attack was answered, its seconds, and the seconds the streams went on
    after its answer (negative: they ended before it). The streams are read to their end, or until `after`
    seconds past the attack's answer."""
    out: list = []
    done = threading.Event()
    threads = [threading.Thread(target=stream_gaps, args=(server, {**body, "prompt": f"{body['prompt']} {i}"}, out, done))
               for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    start, status = time.perf_counter(), None
    if attack is not None:
        try:
            status = attack()
        except Exception as exc:  # the probe reports what broke instead of dying
            status = f"{type(exc).__name__}: {exc}"
    answered = time.perf_counter()
    if after is not None:
        time.sleep(after)
        done.set()
    for t in threads:
        t.join(600)
    assert all(code == 200 for code, _ in out), out
    return [max(g) for _, g in out if g], status, answered - start, time.perf_counter() - answered


def schema_attack(server: LiveServer, schema: dict):
    """A function that sends a chat request with `schema` as its response_format over a plain socket and returns
    the status. The body is encoded here, beforehand: encoding a large schema in the measuring process would
    hold up its stream readers, not the server."""
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n")

    def send():
        return raw_request(server.port, head, data, timeout=600)[0]
    return send
