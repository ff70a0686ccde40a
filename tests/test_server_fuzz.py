"""Random and mutated OpenAI requests against a real `specc serve` on loopback: never a 5xx, never a
traceback in the server's stderr, every 4xx an OpenAI JSON error, and the same greedy answer afterwards.

Bodies start from valid completions and chat requests and are changed field by field (odd values, unknown
and refused fields) or byte by byte (cut, spliced, duplicated, bytes flipped), sent with odd content types
and paths. `pytest -m heavy tests/test_server_fuzz.py` runs a larger run (SPECC_FUZZ_EXAMPLES per test)."""
from __future__ import annotations

import json
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
from server_probe import LiveServer, httpx  # noqa: E402

REFERENCE = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 16, "temperature": 0}
SMALL = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
LARGE = settings(max_examples=int(os.environ.get("SPECC_FUZZ_EXAMPLES", "2000")), deadline=None,
                 suppress_health_check=list(HealthCheck))

ODD = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12)
       | st.sampled_from([0, -1, 1, 2**31, 2**64, 1e-300, 1e300, "", "\x00", "\n", "none", "auto", [], {}, [[]], [""]])
       | st.lists(st.integers(-3, 300) | st.text(max_size=3), max_size=4)
       | st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=3), max_size=2))
FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "user",
          "presence_penalty", "frequency_penalty", "logit_bias", "tools", "tool_choice", "functions", "function_call",
          "response_format", "chat_template", "min_p", "ignore_eos", "metadata", "x-unknown")
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bot"]) | ODD,
                                 "content": st.text(max_size=20) | ODD
                                 | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                   "text": st.text(max_size=6)}), max_size=2)})
VALUE = ODD | st.lists(MESSAGE, max_size=3)
PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def server(bundles, tmp_path_factory):
    s = LiveServer(bundles["draft"], tmp_path_factory.mktemp("fuzz") / "serve.log", "--max-queue", "16")
    reference = s.post("/v1/completions", REFERENCE)
    assert reference.status_code == 200, reference.text
    yield s, reference.json()["choices"][0]["text"]
    try:
        after = s.post("/v1/completions", REFERENCE)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
        log = s.log()
        assert "Traceback" not in log and "internal error" not in log, log[-4000:]
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
        assert 'status="5' not in metrics, [line for line in metrics.splitlines() if "request_errors" in line]
    finally:
        s.stop()


def base(chat: bool) -> dict:
    body = {"model": "tiny", "max_tokens": 3}
    return {**body, "messages": [{"role": "user", "content": "hi"}]} if chat else {**body, "prompt": "hi"}


def check(r: "httpx.Response", body) -> None:
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), (body, r.text)
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"], (body, r.text)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (body, r.text)
    else:
        assert r.status_code == 200 and r.json()["choices"], (body, r.text)


def send(s: LiveServer, path: str, data: bytes, ctype: str = "application/json") -> "httpx.Response":
    return httpx.post(s.url + path, content=data, headers={"content-type": ctype}, timeout=60)


@given(chat=st.booleans(), changes=st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=4))
@SMALL
def test_fields_changed(server, chat, changes):
    s, _ = server
    body = {**base(chat), **changes}
    check(send(s, PATHS[chat], json.dumps(body).encode()), body)


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One byte-level change of a JSON body: cut it, flip a byte, duplicate or drop a slice, splice in JSON."""
    i, j = sorted(rng.randrange(len(data) + 1) for _ in range(2))
    kind = rng.randrange(6)
    if kind == 0:
        return data[:i]
    if kind == 1 and data:
        k = rng.randrange(len(data))
        return data[:k] + bytes([rng.randrange(256)]) + data[k + 1:]
    if kind == 2:
        return data[:j] + data[i:j] + data[j:]
    if kind == 3:
        return data[:i] + data[j:]
    if kind == 4:
        return data[:i] + rng.choice([b"{", b"}", b"[", b'"', b"\\u0000", b"\xff\xfe", b"NaN", b"1e999", b"null",
                                      b'{"a": ' * 50, b"\x00"]) + data[i:]
    return data[:i] + b" " * rng.randrange(1, 4096) + data[i:]


@given(chat=st.booleans(), seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 4))
@SMALL
def test_bytes_mutated(server, chat, seed, rounds):
    s, _ = server
    rng = random.Random(seed)
    body = {**base(chat), "stream": rng.random() < 0.3, "stop": ["\n"] if rng.random() < 0.5 else None}
    data = json.dumps(body).encode()
    for _ in range(rounds):
        data = mutate(data, rng)
    check(send(s, PATHS[chat], data), data[:200])


@given(path=st.sampled_from(PATHS + ("/v1/models", "/v1/nothing", "/health", "/v1/completions/x", "/openapi.json")),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       ctype=st.sampled_from(["application/json", "text/plain", "application/json; charset=latin-1", "",
                              "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", "APPLICATION/JSON"]))
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_methods_paths_and_content_types(server, path, method, ctype):
    s, _ = server
    r = httpx.request(method, s.url + path, content=json.dumps(base("chat" in path)).encode(),
                      headers={"content-type": ctype} if ctype else {}, timeout=60)
    assert r.status_code < 500, (method, path, ctype, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text


@pytest.mark.heavy
@given(chat=st.booleans(), changes=st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=6),
       seed=st.integers(0, 2**32 - 1), rounds=st.integers(0, 3))
@LARGE
def test_fields_and_bytes_many(server, chat, changes, seed, rounds):
    s, _ = server
    rng = random.Random(seed)
    data = json.dumps({**base(chat), **changes}).encode()
    for _ in range(rounds):
        data = mutate(data, rng)
    check(send(s, PATHS[chat], data), data[:200])
