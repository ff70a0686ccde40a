"""One request must never fail, stall or leak into another (issue 57): a live `specc serve` against schemas
that admit no output or that the grammar cannot enforce, schemas that are slow to compile, logprobs that
would be non-finite, small malformed fields, abandoned non-streamed requests, and prefix-cache probes
across clients."""
from __future__ import annotations

import json
import math
import threading
import time

import pytest

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")
from server_probe import LiveServer, httpx  # noqa: E402

from specc.errors import RequestError  # noqa: E402

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "temperature": 0}
TAB = {"type": "string", "pattern": "^\t\t$"}


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}


def strict(text: str):
    """JSON parsed strictly: NaN, Infinity and -Infinity are refused."""
    def refuse(name):
        raise ValueError(f"non-finite number {name} in {text[:200]}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def live(bundles, tmp_path_factory):
    s = LiveServer(bundles["draft"], tmp_path_factory.mktemp("isolation") / "serve.log", "--max-queue", "16")
    yield s
    s.stop()


def no_trouble(server: LiveServer) -> None:
    log = server.log()
    assert "Traceback" not in log and "internal error" not in log and "a round failed" not in log, log[-3000:]
    assert 'specc:request_errors_total{status="500"}' not in httpx.get(server.url + "/metrics").text


def stream_events(url: str, body: dict, out: list) -> None:
    """POST a completions stream; appends (status, [event payloads], [seconds between events])."""
    events, gaps = [], []
    with httpx.stream("POST", url + "/v1/completions", json={"model": "tiny", "stream": True, **body}, timeout=120) as r:
        last = time.perf_counter()
        for line in r.iter_lines():
            if line.startswith("data: "):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                events.append(line[6:])
    out.append((r.status_code, events, gaps))


def innocent_streams(server: LiveServer, n: int = 3, tokens: int = 120) -> tuple[list, list[threading.Thread]]:
    out: list = []
    threads = [threading.Thread(target=stream_events, args=(server.url, {"prompt": f"innocent {i}", "max_tokens": tokens,
                                                                          "temperature": 0}, out)) for i in range(n)]
    for t in threads:
        t.start()
    return out, threads


def assert_clean(streams: list) -> None:
    for status, events, _ in streams:
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        last = strict(events[-2])
        assert "error" not in last and last["choices"][0]["finish_reason"] in ("length", "stop"), last


# -- 1: a failure stays with the request that caused it --------------------------------------------------
def test_a_schema_that_admits_no_output_is_400_and_the_batch_goes_on(live):
    streams, threads = innocent_streams(live)
    time.sleep(0.2)
    r = live.post("/v1/chat/completions", {**CHAT, "response_format": schema_format(TAB)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "control characters" in r.json()["error"]["message"]
    plain = live.post("/v1/completions", {"model": "tiny", "prompt": "plain", "max_tokens": 8})
    for t in threads:
        t.join(120)
    assert plain.status_code == 200, plain.text
    assert_clean(streams)
    no_trouble(live)


def test_a_grammar_dead_end_reached_while_running_fails_that_request_alone(live):
    """The search before the run finds an output (the integer branch), but the bias drives the model into
    the string branch, whose pattern needs a tab: that request ends with a 400, the batch with it goes on."""
    quote, a = 1, 64  # the byte tokenizer's '"' and 'a'
    body = {**CHAT, "response_format": schema_format({"anyOf": [{"type": "string", "pattern": "^a\t$"}, {"type": "integer"}]}),
            "logit_bias": {str(quote): 100, str(a): 100}}
    streams, threads = innocent_streams(live)
    time.sleep(0.2)
    r = live.post("/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsatisfiable_schema", r.text
    with httpx.stream("POST", live.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and strict(events[-2])["error"]["code"] == "unsatisfiable_schema", events
    for t in threads:
        t.join(120)
    assert_clean(streams)
    no_trouble(live)


# -- 4: what the grammar cannot enforce is refused, what it returns validates ----------------------------------
@pytest.mark.parametrize("schema, keyword", [
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, "allOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "if": {"properties": {"a": {"const": 1}}},
      "then": {"required": ["b"]}}, "if"),
    ({"type": "array", "contains": {"const": 5}, "maxItems": 3}, "contains"),
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 2}, "uniqueItems"),
    ({"type": "object", "required": ["x"], "additionalProperties": False}, "required"),
    ({"type": "integer", "multipleOf": 7}, "multipleOf"),
    ({"type": "integer", "not": {"const": 0}}, "not"),
    ({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]}, "oneOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
])
def test_keywords_the_grammar_cannot_enforce_are_400_naming_them(live, schema, keyword):
    r = live.post("/v1/chat/completions", {**CHAT, "response_format": schema_format(schema)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert f"{keyword}" in r.json()["error"]["message"], r.text


VALID = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": ["x", "y"]}},
     "required": ["a", "b"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"oneOf": [{"type": "integer"}, {"type": "null"}]},
    {"allOf": [{"type": "integer", "minimum": 3, "maximum": 5}]},
    {"type": "object", "patternProperties": {"^k[0-9]$": {"type": "integer"}}, "minProperties": 1, "maxProperties": 2},
]


@pytest.mark.parametrize("schema", VALID)
def test_what_the_grammar_returns_as_success_validates(live, schema):
    for seed in range(3):
        r = live.post("/v1/chat/completions", {**CHAT, "temperature": 1.0, "seed": seed, "max_tokens": 40,
                                               "response_format": schema_format(schema)})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(strict(choice["message"]["content"]), schema)


# -- 2: compiling is bounded and never holds up the engine -------------------------------------------------
def test_schemas_too_costly_to_compile_are_400_at_once_and_streams_keep_flowing(live):
    idle, threads = innocent_streams(live, 1)
    for t in threads:
        t.join(120)
    streams, threads = innocent_streams(live)
    time.sleep(0.2)
    attacks = [({"type": "string", "pattern": "^([a-z]{1,62}[0-9]{1,62}){1,62}$"}, "pattern"),
               ({"enum": [f"value-{i:06d}" for i in range(60_000)]}, "bytes"),
               ({"type": "object", "properties": {f"p{i}": {"enum": [f"v{i}-{j}" for j in range(40)]} for i in range(60)}},
                "nothing")]  # within the bounds: compiles beside the streams, at low priority
    for schema, word in attacks:
        start = time.perf_counter()
        r = live.post("/v1/chat/completions", {**CHAT, "max_tokens": 4, "response_format": schema_format(schema)})
        if word == "nothing":
            assert r.status_code == 200, r.text
            continue
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
        assert time.perf_counter() - start < 5
    for t in threads:
        t.join(120)
    assert_clean(streams)
    idle_gap = max(idle[0][2][1:])
    gaps = [max(g[1:]) for _, _, g in streams]
    assert max(gaps) < 2 * idle_gap + 0.25, (gaps, idle_gap)
    no_trouble(live)


def test_compiling_waits_at_most_the_timeout_and_caches(bundles, monkeypatch):
    import specc
    from specc.runtime import grammar

    model = specc.load(bundles["draft"])
    schema = json.dumps({"type": "object", "properties": {"slow": {"type": "integer"}}})
    real = grammar.Grammars._compile_checked
    calls = []

    def slow(self, text):
        calls.append(text)
        time.sleep(1.0)
        return real(self, text)

    monkeypatch.setattr(grammar.Grammars, "_compile_checked", slow)
    start = time.perf_counter()
    with pytest.raises(RequestError, match="took longer than 0.2 s"):
        model.grammars.compile(schema, timeout=0.2)
    assert time.perf_counter() - start < 0.8
    time.sleep(1.2)  # the compile finished in the background: cached
    first = model.grammars.compile(schema, timeout=0.2)
    assert model.grammars.compile(schema) is first and len(calls) == 1


def test_the_search_and_costly_compiles_run_in_the_grammar_worker_not_the_server(bundles, monkeypatch):
    """A server's schemas are searched for an output in its grammar worker (the search is Python and would hold
    the server's interpreter lock); a schema past the worker's CPU budget is killed there, answered 400 and
    remembered, and the worker comes back for the next schema."""
    import specc
    from specc.runtime import grammar
    from specc.serving.grammar_worker import attach, detach

    model = specc.load(bundles["draft"])
    worker = attach(model.grammars)
    monkeypatch.setattr(grammar, "admits_output", lambda *a, **k: pytest.fail("searched in the server"))
    try:
        with pytest.raises(RequestError, match="admits no output"):
            model.grammars.compile(json.dumps(TAB))
        worker.seconds = 0.05
        heavy = json.dumps({"type": "object", "required": [f"p{i}" for i in range(300)], "properties": {
            f"p{i}": {"type": "string", "pattern": "^([a-z]{1,9}[0-9]{1,9}){1,9}$"} for i in range(300)}})
        with pytest.raises(RequestError, match="took longer than 0.05 s"):
            model.grammars.compile(heavy)
        with pytest.raises(RequestError, match="took longer than 0.05 s"):
            model.grammars.compile(heavy)  # remembered: not compiled again
        worker.seconds = 30.0
        assert model.grammars.compile(json.dumps({"type": "integer"})) is not None
    finally:
        detach(model.grammars, worker)


# -- 3: no response holds a non-finite number ---------------------------------------------------------------
def test_logprobs_under_a_grammar_are_finite_json(live):
    fmt = schema_format({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    r = live.post("/v1/chat/completions", {**CHAT, "response_format": fmt, "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 200, r.text
    body = strict(r.text)
    assert all(math.isfinite(t["logprob"]) for t in body["choices"][0]["logprobs"]["content"])
    with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=60,
                      json={**CHAT, "response_format": fmt, "logprobs": True, "top_logprobs": 5, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all(strict(e) for e in events[:-1])
    r = live.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 12, "logprobs": 5,
                                      "response_format": fmt})
    assert r.status_code == 200, r.text
    strict(r.text)


def test_a_repetition_penalty_that_overflows_float32_is_refused(live):
    body = {"model": "tiny", "prompt": "abab", "max_tokens": 8, "logprobs": 1}
    r = live.post("/v1/completions", {**body, "repetition_penalty": 1e-300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
    assert "0.01" in r.json()["error"]["message"]
    r = live.post("/v1/completions", {**body, "repetition_penalty": 0.01})
    assert r.status_code == 200 and all(math.isfinite(x) for x in strict(r.text)["choices"][0]["logprobs"]["token_logprobs"])


# -- 8: small 500s and wrong fields ---------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [{"--5": 1}, {"\u00b2": 1}, {"9" * 5000: 1}, {"07": 1, "7": 2}, {" 7": 1}])
def test_logit_bias_keys_that_are_not_one_token_id_each_are_400(live, bias):
    r = live.post("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2, "logit_bias": bias})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_chat_logprobs_bytes_are_each_tokens_own(live):
    fmt = schema_format({"const": "\u00e9"})  # the byte tokenizer writes é as two tokens, each half a character
    r = live.post("/v1/chat/completions", {**CHAT, "response_format": fmt, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == '"\u00e9"', r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [t["bytes"] for t in content] == [[34], [0xC3], [0xA9], [34]], content


def test_text_offset_moves_by_the_text_each_token_adds(live):
    with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": [64, 256, 65, 256, 66], "echo": True, "logprobs": 0,
                            "max_tokens": 3, "stream": True, "temperature": 0}) as s:
        events = [strict(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(e["choices"][0]["text"] for e in events)
    offsets = [o for e in events if e["choices"][0]["logprobs"] for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets[:5] == [0, 1, 1, 2, 2] and text.startswith("abc"), (offsets, text)
    assert all(o <= len(text) for o in offsets)


def test_a_seed_too_large_for_n_is_refused_quoting_the_seed_sent(live):
    seed = 2**64 - 1
    r = live.post("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2, "n": 2, "seed": seed})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert str(seed) in r.text and str(seed + 1) not in r.text
    assert live.post("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2, "n": 2,
                                         "seed": seed - 1}).status_code == 200


# -- 5: a non-streamed request whose client left is cancelled -------------------------------------------------
def test_non_streamed_requests_whose_clients_left_stop_generating(bundles, tmp_path):
    """Four 230-token requests in one batch whose clients leave after 0.3 s: their rows are freed once the
    disconnects are seen, so they run far fewer row-rounds than four whole requests would."""
    s = LiveServer(bundles["draft"], tmp_path / "serve.log", "--k", "3")
    body = {"model": "tiny", "max_tokens": 230, "temperature": 1.0}

    def metric(name: str) -> float:
        text = httpx.get(s.url + "/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def abandoned(i):
        try:
            s.post("/v1/completions", {**body, "prompt": f"p{i}", "seed": i}, timeout=0.3)
        except httpx.HTTPError:
            pass

    try:
        before = metric("specc:batch_size_sum")
        assert s.post("/v1/completions", {**body, "prompt": "p9", "seed": 9}).json()["choices"][0]["finish_reason"] == "length"
        one = metric("specc:batch_size_sum") - before
        threads = [threading.Thread(target=abandoned, args=(i,)) for i in range(4)]
        before = metric("specc:batch_size_sum")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end = time.monotonic() + 60
        while metric("specc:num_requests_running") + metric("specc:num_requests_waiting") and time.monotonic() < end:
            time.sleep(0.2)
        time.sleep(0.5)
        rounds = metric("specc:batch_size_sum") - before
        assert rounds < 2 * one, f"{rounds} row-rounds for four abandoned requests; one whole request takes {one}"
    finally:
        s.stop()


# -- 6: prompt logprobs are read chunk by chunk --------------------------------------------------------------
def peak_and_resident_mib(pid: int) -> tuple[float, float]:
    """The process's peak resident memory (VmHWM) and its resident memory now (VmRSS), in MiB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return int(fields["VmHWM"].split()[0]) / 1024, int(fields["VmRSS"].split()[0]) / 1024


def test_echo_of_a_long_prompt_costs_no_more_memory_than_its_prefill(bundles, tmp_path):
    """A 4,000-token prompt with echo and logprobs raises the server's peak memory by at most ECHO_MIB over
    the same prompt without them (one pass over the whole prompt would hold its prompt x prompt attention),
    leaves at most ECHO_MIB more resident, and its prompt logprobs equal those of a short prompt read in one
    pass (the long prompt starts with the short one)."""
    ECHO_MIB = 48
    s = LiveServer(bundles["long_lookup"], tmp_path / "serve.log", "--prefix-cache-mb", "0")
    prompt = [(i * 37) % 250 + 1 for i in range(4000)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    try:
        assert s.post("/v1/completions", body, timeout=600).status_code == 200
        peak, resident = peak_and_resident_mib(s.proc.pid)
        r = s.post("/v1/completions", {**body, "echo": True, "logprobs": 2}, timeout=600)
        assert r.status_code == 200, r.text
        echo_peak, echo_resident = peak_and_resident_mib(s.proc.pid)
        assert echo_peak - peak <= ECHO_MIB and echo_resident - resident <= ECHO_MIB, (peak, echo_peak, resident, echo_resident)
        long = strict(r.text)["choices"][0]["logprobs"]
        assert len(long["token_logprobs"]) == 4002 and long["token_logprobs"][0] is None
        short = s.post("/v1/completions", {**body, "prompt": prompt[:200], "echo": True, "logprobs": 2})
        want = strict(short.text)["choices"][0]["logprobs"]
        assert long["token_logprobs"][1:200] == pytest.approx(want["token_logprobs"][1:200], abs=1e-4)
        assert [list(t) for t in long["top_logprobs"][1:200]] == [list(t) for t in want["top_logprobs"][1:200]]
        no_trouble(s)
    finally:
        s.stop()


# -- 7: the prefix cache isolates clients ---------------------------------------------------------------------
def test_the_prefix_cache_is_shared_only_within_one_key_and_salt(bundles, tmp_path):
    s = LiveServer(bundles["draft"], tmp_path / "serve.log", "--api-key", "key-one", "--api-key", "key-two",
                   "--prefix-cache-mb", "16")
    prompt = "secret 4711 " * 12  # 144 tokens of the byte tokenizer: two whole 64-token blocks

    def cached(key: str, **extra) -> int:
        r = s.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1, **extra},
                   authorization=f"Bearer {key}")
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        assert cached("key-one") == 0
        assert cached("key-one") == 128  # the same client: reused
        assert cached("key-two") == 0  # another key: nothing learned from the first client's prompt
        assert cached("key-one", cache_salt="tenant-a") == 0
        assert cached("key-one", cache_salt="tenant-a") == 128
        assert cached("key-one", cache_salt="tenant-b") == 0
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "a", "cache_salt": ""}, authorization="Bearer key-one")
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        assert s.post("/v1/completions", {"model": "tiny", "prompt": "a"}).status_code == 401
    finally:
        s.stop()
