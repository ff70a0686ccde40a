"""Random and mutated OpenAI requests against a real `specc serve` on loopback: never a 5xx, never a
traceback in the server's stderr, every 4xx an OpenAI JSON error, and the same greedy answer afterwards.

Bodies start from valid completions and chat requests and are changed field by field (odd values, unknown
and refused fields) or byte by byte (cut, spliced, duplicated, bytes flipped), sent with odd content types
and paths. Beside them: JSON schemas drawn at random (what a 200 returns as finished must validate with
`jsonschema`), alone and with logit_bias, penalties, logprobs and n; logprobs, penalties and logit_bias in
combination; and the prefix cache's isolation between API keys and salts, streamed or not, in chat too.
Every response and every streamed event must be strict JSON (no NaN or Infinity), and a stream's error
event (its last) is a request's own fault, never the server's.
`pytest -m heavy tests/test_server_fuzz.py` runs a larger run (SPECC_FUZZ_EXAMPLES per test)."""
from __future__ import annotations

import json
import os
import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")
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
    idle = resident_mib(s.proc.pid)["VmRSS"]
    yield s, reference.json()["choices"][0]["text"]
    try:
        after = s.post("/v1/completions", REFERENCE)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
        memory = resident_mib(s.proc.pid)
        print(f"fuzz server memory: idle {idle:.0f} MiB, peak {memory['VmHWM']:.0f} MiB, now {memory['VmRSS']:.0f} MiB")
        assert memory["VmHWM"] - idle <= CORPUS_MIB, (idle, memory)  # docs/serving.md: what one server may hold
        log = s.log()
        assert "Traceback" not in log and "internal error" not in log, log[-4000:]
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
        assert 'status="5' not in metrics, [line for line in metrics.splitlines() if "request_errors" in line]
    finally:
        s.stop()


CORPUS_MIB = 256  # the schema cache's cap (Grammars) bounds what the corpus may add; the tiny bundle's KV is small


def resident_mib(pid: int) -> dict[str, float]:
    """The process's peak (VmHWM) and current (VmRSS) resident memory in MiB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmHWM", "VmRSS")}


def base(chat: bool) -> dict:
    body = {"model": "tiny", "max_tokens": 3}
    return {**body, "messages": [{"role": "user", "content": "hi"}]} if chat else {**body, "prompt": "hi"}


def strict(text: str):
    """JSON parsed strictly: NaN, Infinity and -Infinity are refused."""
    def refuse(name):
        raise ValueError(f"non-finite number {name} in {text[:300]}")
    return json.loads(text, parse_constant=refuse)


def check(r: "httpx.Response", body) -> list[dict]:
    """The response is an OpenAI error, a JSON completion or a stream ending in [DONE], all strict JSON; the
    completion objects (one, or one per event)."""
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), (body, r.text)
        err = strict(r.text)["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"], (body, r.text)
        return []
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (body, r.text)
        chunks = [strict(e) for e in events[:-1]]
        failed = [i for i, c in enumerate(chunks) if "error" in c]
        assert failed in ([], [len(chunks) - 1]), (body, r.text)  # an error event is a stream's last
        if failed:  # a request's own input found at fault while it ran: never the server's failure
            err = chunks[-1]["error"]
            assert err["type"] == "invalid_request_error" and err["param"] and err["message"], (body, err)
        return chunks
    out = strict(r.text)
    assert r.status_code == 200 and out["choices"], (body, r.text)
    return [out]


def error_of(r: "httpx.Response", chunks: list[dict]) -> dict | None:
    """The request's error: a 4xx's body, or the error event that ended its stream; None when it succeeded."""
    if r.status_code >= 400:
        return strict(r.text)["error"]
    return chunks[-1]["error"] if chunks and "error" in chunks[-1] else None


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
        assert strict(r.text)["error"]["message"], r.text


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


# -- structured output: random JSON schemas ------------------------------------------------------------------
SCHEMA_RUNS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
NAMES = st.sampled_from(["a", "b", "c", "id", "x y"])
SCALAR = st.none() | st.booleans() | st.integers(-20, 20) | st.sampled_from([0.5, -1.25, "", "x", "ab", "\u00e9"])
PATTERNS = st.sampled_from(["^[a-c]+$", "^x[0-9]{1,3}$", "[a-z]", "^(ab|cd)*$", "^\\d{2}-\\d{2}$", "^[^\"]{0,4}$"])
LEAF = st.one_of(
    st.fixed_dictionaries({"type": st.just("integer")}, optional={
        "minimum": st.integers(-50, 50), "maximum": st.integers(-50, 50),
        "exclusiveMinimum": st.integers(-50, 50), "exclusiveMaximum": st.integers(-50, 50)}),
    st.fixed_dictionaries({"type": st.just("number")}, optional={
        "minimum": st.sampled_from([-1.5, 0, 2, 10]), "maximum": st.sampled_from([-1, 0.5, 3, 100])}),
    st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": st.integers(0, 5), "maxLength": st.integers(0, 8), "pattern": PATTERNS,
        "format": st.sampled_from(["date", "email", "uuid", "date-time", "ipv4", "time"])}),
    st.just({"type": "boolean"}), st.just({"type": "null"}), st.just({}),
    st.fixed_dictionaries({"enum": st.lists(SCALAR, min_size=1, max_size=4, unique_by=json.dumps)}),
    st.fixed_dictionaries({"const": SCALAR}),
    # what the grammar cannot enforce: a 400 naming the keyword, never a 200 that breaks it
    st.sampled_from([{"type": "integer", "multipleOf": 3}, {"not": {"type": "null"}}, {"type": "array", "contains": {}},
                     {"type": "array", "uniqueItems": True}, {"if": {}, "then": {}}, {"type": "string", "pattern": "^\t$"},
                     {"dependentRequired": {"a": ["b"]}}, {"type": "object", "required": ["zz"]}]),
)


def _object(props: dict, required: list[bool], extra) -> dict:
    out = {"type": "object", "properties": props, "required": [k for k, r in zip(sorted(props), required) if r]}
    if extra is not None:
        out["additionalProperties"] = extra
    return out


def _extend(child):
    return st.one_of(
        st.builds(_object, st.dictionaries(NAMES, child, max_size=3), st.lists(st.booleans(), min_size=3, max_size=3),
                  st.none() | st.booleans() | child),
        st.fixed_dictionaries({"type": st.just("array"), "items": child},
                              optional={"minItems": st.integers(0, 2), "maxItems": st.integers(0, 3)}),
        st.fixed_dictionaries({"type": st.just("array"), "prefixItems": st.lists(child, min_size=1, max_size=2)},
                              optional={"items": st.just(False)}),
        st.lists(child, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs}),
        st.lists(child, min_size=1, max_size=2).map(lambda xs: {"oneOf": xs}),
        child.map(lambda x: {"allOf": [x]}),
        child.map(lambda x: {"$defs": {"d": x}, "$ref": "#/$defs/d"}),
    )


SCHEMAS = st.recursive(LEAF, _extend, max_leaves=6)


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}


def choice_texts(chunks: list[dict], chat: bool, stream: bool) -> dict[int, tuple[str, str | None]]:
    """Each choice's whole text and its finish reason, from a completion or its stream's events."""
    out: dict[int, tuple[str, str | None]] = {}
    for c in chunks:
        for choice in c.get("choices", []):
            if chat:
                part = (choice.get("delta") or {}).get("content") if stream else choice["message"]["content"]
            else:
                part = choice["text"]
            text, reason = out.get(choice["index"], ("", None))
            out[choice["index"]] = (text + (part or ""), choice.get("finish_reason") or reason)
    return out


def validate_finished(chunks: list[dict], chat: bool, stream: bool, schema: dict) -> None:
    """Every choice that finished on its own (stop, with no stop strings asked) is JSON the schema accepts."""
    for text, reason in choice_texts(chunks, chat, stream).values():
        event(f"200, finish_reason {reason}")  # --hypothesis-show-statistics: how many outputs were validated
        if reason == "stop":
            jsonschema.validate(strict(text), schema, cls=jsonschema.Draft202012Validator)


def logprobs_fields(chat: bool, top: int | None) -> dict:
    """`top` alternatives per token as each endpoint asks for them (None: no logprobs)."""
    if top is None:
        return {}
    return {"logprobs": True, "top_logprobs": top} if chat else {"logprobs": top}


# what a schema request may carry beside it: biases strong enough to steer the output into a grammar's dead
# end, penalties, several choices (the grammar masks after all of them)
BESIDE_SCHEMA = st.fixed_dictionaries({}, optional={
    "logit_bias": st.dictionaries(st.integers(0, 259).map(str), st.sampled_from([-100, -5, 5, 100]), max_size=4),
    "frequency_penalty": st.sampled_from([-2, 0.5, 2]), "presence_penalty": st.sampled_from([-2, 1]),
    "repetition_penalty": st.sampled_from([0.5, 1.3]), "n": st.integers(1, 2)})


def schema_case(s: LiveServer, schema: dict, chat: bool, stream: bool, seed: int, beside: dict | None = None,
                top: int | None = None) -> None:
    """A 400 (or a stream's error event: a dead end reached while it ran) names response_format; every choice
    of a 200 that finished (stop) is JSON that the schema accepts; every logprob is finite and <= 0."""
    body = {**base(chat), "max_tokens": 40, "temperature": 1.0, "seed": seed, "stream": stream,
            "response_format": schema_format(schema), **(beside or {}), **logprobs_fields(chat, top)}
    r = send(s, PATHS[chat], json.dumps(body).encode())
    chunks = check(r, body)
    err = error_of(r, chunks)
    if err is not None:
        assert err["param"] == "response_format", (schema, body, err)
        event("400" if r.status_code >= 400 else "error event: a dead end reached while streaming")
        return
    assert all(-1e4 <= x <= 1e-4 for x in logprob_values(chunks, chat)), (body, r.text)
    validate_finished(chunks, chat, stream, schema)


@given(schema=SCHEMAS, chat=st.booleans(), stream=st.booleans(), seed=st.integers(0, 3))
@SCHEMA_RUNS
def test_generated_schemas(server, schema, chat, stream, seed):
    schema_case(server[0], schema, chat, stream, seed)


@given(schema=SCHEMAS, chat=st.booleans(), stream=st.booleans(), seed=st.integers(0, 3), beside=BESIDE_SCHEMA,
       top=st.none() | st.integers(0, 3))
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_generated_schemas_with_bias_penalties_and_logprobs(server, schema, chat, stream, seed, beside, top):
    schema_case(server[0], schema, chat, stream, seed, beside, top)


@pytest.mark.heavy
@given(schema=SCHEMAS, chat=st.booleans(), stream=st.booleans(), seed=st.integers(0, 2**32 - 1),
       beside=BESIDE_SCHEMA, top=st.none() | st.integers(0, 3))
@LARGE
def test_generated_schemas_many(server, schema, chat, stream, seed, beside, top):
    schema_case(server[0], schema, chat, stream, seed, beside, top)


# -- logprobs, penalties and logit_bias together ------------------------------------------------------------------
SAMPLING = {
    "temperature": st.sampled_from([0, 0.3, 1.0, 2.0]), "top_p": st.sampled_from([1e-9, 0.1, 0.9, 1.0]),
    "top_k": st.integers(0, 300), "seed": st.integers(0, 2**32), "n": st.integers(1, 3), "stream": st.booleans(),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.sampled_from([0.01, 0.5, 1.0, 1.3, 10.0]),
    "logit_bias": st.dictionaries(st.integers(0, 259).map(str), st.sampled_from([-100, -1.5, 0, 3, 100]), max_size=6),
    "stop": st.lists(st.sampled_from(["a", "\n", "ab", "}"]), max_size=2),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"},
                                        schema_format({"type": "object", "properties": {"k": {"type": "integer"}}})]),
}
CHAT_LOGPROBS = st.fixed_dictionaries({"logprobs": st.booleans()}, optional={"top_logprobs": st.integers(0, 20), **SAMPLING})
TEXT_LOGPROBS = st.fixed_dictionaries({"logprobs": st.integers(0, 5)}, optional={"echo": st.booleans(), **SAMPLING})


def logprob_values(chunks: list[dict], chat: bool) -> list[float]:
    out = []
    for c in chunks:
        for choice in c.get("choices", []):
            lp = choice.get("logprobs")
            if not lp:
                continue
            if chat:
                out += [t["logprob"] for t in lp["content"]] + [a["logprob"] for t in lp["content"] for a in t["top_logprobs"]]
            else:
                out += [x for x in lp["token_logprobs"] if x is not None]
                out += [x for tops in lp["top_logprobs"] if tops for x in tops.values()]
    return out


JSON_OBJECT = {"type": "object"}


@given(chat=st.booleans(), chat_fields=CHAT_LOGPROBS, text_fields=TEXT_LOGPROBS)
@SCHEMA_RUNS
def test_logprobs_penalties_and_bias_together(server, chat, chat_fields, text_fields):
    """Every combination answers 200 or a 400 (or a stream's error event) naming its field; every logprob is a
    finite number <= 0; a choice that finished under response_format (no stop strings, no echo) follows it."""
    s, _ = server
    body = {**base(chat), "max_tokens": 8, **(chat_fields if chat else text_fields)}
    r = send(s, PATHS[chat], json.dumps(body).encode())
    chunks = check(r, body)
    err = error_of(r, chunks)
    if err is not None:
        assert err["param"], (body, err)
        event(f"error naming {err['param']}")
        return
    assert all(isinstance(x, float | int) and -1e4 <= x <= 1e-4 for x in logprob_values(chunks, chat)), (body, r.text)
    fmt = body.get("response_format", {"type": "text"})
    if fmt["type"] != "text" and not body.get("stop") and not body.get("echo"):
        validate_finished(chunks, chat, bool(body.get("stream")), fmt.get("json_schema", {}).get("schema", JSON_OBJECT))
    else:
        event("200")


# -- the prefix cache's isolation domains --------------------------------------------------------------------------
KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def keyed(bundles, tmp_path_factory):
    s = LiveServer(bundles["draft"], tmp_path_factory.mktemp("fuzz-keys") / "serve.log", "--api-key", KEYS[0],
                   "--api-key", KEYS[1], "--prefix-cache-mb", "16")
    yield s, iter(range(10**9))
    try:
        log = s.log()
        assert "Traceback" not in log and "internal error" not in log, log[-4000:]
    finally:
        s.stop()


SALTS = st.none() | st.sampled_from(["a", "b", "A", "a ", "\u00e9", "x" * 256]) | st.sampled_from(["", "x" * 257, 5, ["a"]])


WAYS = ("completions", "stream", "chat")  # a streamed completion's prompt is the completion's: one cache entry


def visit(prompt: str, way: str, salt) -> tuple[str, dict]:
    """The path and body that send `prompt` one way, under `salt` (None: none)."""
    body = {"model": "tiny", "max_tokens": 1, **({} if salt is None else {"cache_salt": salt})}
    if way == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    if way == "stream":
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    return "/v1/completions", {**body, "prompt": prompt}


@given(visits=st.lists(st.tuples(st.sampled_from(KEYS), SALTS, st.sampled_from(WAYS)), min_size=1, max_size=5))
@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_prefix_cache_reuse_stays_within_key_and_salt(keyed, visits):
    """The same prompt sent under several (key, salt) pairs, as a completion, a stream or a chat message: cached
    tokens only from an earlier visit of the same pair that tokenised it the same way; a salt that is not 1 to
    256 characters is a 400 naming cache_salt."""
    s, fresh = keyed
    prompt = f"{next(fresh):06d} " + "secret 4711 " * 12  # its own blocks: nothing cached from other examples
    seen = set()
    for key, salt, way in visits:
        path, body = visit(prompt, way, salt)
        r = s.post(path, body, authorization=f"Bearer {key}")
        chunks = check(r, body)
        if not (salt is None or isinstance(salt, str) and 1 <= len(salt) <= 256):
            assert r.status_code == 400 and strict(r.text)["error"]["param"] == "cache_salt", r.text
            continue
        assert r.status_code == 200 and "usage" in chunks[-1], r.text
        cached = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        domain = (key, salt, way == "chat")
        assert cached == (128 if domain in seen else 0), (visits, key, salt, way, cached)
        seen.add(domain)
