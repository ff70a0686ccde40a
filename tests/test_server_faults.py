"""A failure stays with the request that caused it: faults injected (monkeypatch, in-process) into one request's
own work in a round (its logprobs, grammar mask, penalties, stop-string check, logits) end that request alone
with a 500 while the streams beside it finish as they would have; a fault in the batch's shared pass ends the
requests in that batch with a 500 event and the server goes on serving. Whether a row's failure is the client's
(400, naming the field) or the server's (500, a generic message, the cause in the log) follows the failure's
type, whatever its message says."""
from __future__ import annotations

import json
import logging
import re
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
from test_serving import Server, httpx  # noqa: E402

import specc  # noqa: E402
from specc.errors import RequestError, UnsatisfiableOutputError  # noqa: E402
from specc.runtime import rules as rules_mod  # noqa: E402
from specc.runtime.rules import BatchRules, RowFault, RowRule, row_failure  # noqa: E402
from specc.runtime.text import TextStream  # noqa: E402
from specc.runtime.verifier import Verifier  # noqa: E402
from specc.serving.app import create_app  # noqa: E402
from specc.serving.row_failures import GENERIC, request_failed  # noqa: E402

INNOCENT = {"model": "tiny", "max_tokens": 60, "temperature": 0}


@pytest.fixture(scope="module")
def server(bundles):
    # a fixed k: every round after prefill verifies drafts (k auto may decode plainly for a whole request)
    s = Server(create_app(specc.load(bundles["draft"]), name="tiny", k=3))
    yield s
    s.stop()


def stream(url: str, path: str, body: dict, out: list, started: threading.Event | None = None) -> None:
    """One streamed request; appends (status, [data payloads]) to out, sets `started` at its first event."""
    events = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None:
                    started.set()
    out.append((r.status_code, events))


def text_of(events: list[str]) -> str:
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    return "".join(c["choices"][0]["text"] for c in chunks)


def beside_innocents(server: Server, fault, n: int = 3, innocent: dict = INNOCENT) -> tuple[object, list[str], list[str]]:
    """Run `fault()` while n innocent completions streams are in flight (each has its first event); returns what
    fault() returned, the streams' texts, and their texts alone (the same requests with nothing beside them)."""
    bodies = [{**innocent, "prompt": f"innocent {i}"} for i in range(n)]
    alone = []
    for body in bodies:
        out: list = []
        stream(server.url, "/v1/completions", body, out)
        alone.append(text_of(out[0][1]))
    out, threads, started = [], [], []
    for body in bodies:
        flag = threading.Event()
        started.append(flag)
        threads.append(threading.Thread(target=stream, args=(server.url, "/v1/completions", body, out, flag)))
        threads[-1].start()
    for flag in started:
        assert flag.wait(60)
    result = fault()
    for t in threads:
        t.join(120)
    assert [status for status, _ in out] == [200] * n
    return result, sorted(text_of(events) for _, events in out), sorted(alone)


def failed_alone(r, caplog, injected: str) -> None:
    """A 500 for a fault in the request's own processing: failed_internally."""
    assert r.status_code == 500, r.text
    failed_internally(r.json()["error"], caplog, injected)


def failed_internally(err: dict, caplog, injected: str) -> None:
    """An internal failure's error: generic (the injected fault's text is not in it), with the reference of the
    log line that holds the fault."""
    assert err["code"] == "request_failed" and err["type"] == "server_error" and err["param"] is None, err
    assert injected not in err["message"], err
    reference = re.search(r"reference ([0-9a-f]{12})", err["message"])
    assert reference, err
    logged = [r for r in caplog.records if reference.group(1) in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR, [r.getMessage() for r in caplog.records]
    assert injected in str(logged[0].exc_info[1]), logged[0].exc_info


def test_a_request_whose_logprobs_raise_fails_alone(server, monkeypatch, caplog):
    real = rules_mod.token_logprobs

    def broken(logits, tokens, top):
        if top == 7:  # the faulty request's marker: top_logprobs 7
            raise RuntimeError("injected logprobs fault")
        return real(logits, tokens, top)

    monkeypatch.setattr(rules_mod, "token_logprobs", broken)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "logprobs": True}
    r, texts, alone = beside_innocents(server, lambda: server.post("/v1/chat/completions", {**chat, "top_logprobs": 7}))
    failed_alone(r, caplog, "injected logprobs fault")
    assert texts == alone
    assert server.post("/v1/chat/completions", {**chat, "top_logprobs": 3}).status_code == 200


def test_a_request_whose_grammar_mask_raises_or_leaves_nan_fails_alone_and_streams_say_so(server, monkeypatch,
                                                                                             caplog):
    real = RowRule._mask

    def broken(self, logits, drafts, start):
        title = json.loads(self.rules.json_schema).get("title")
        if title == "raise":
            raise ValueError("injected mask fault")
        real(self, logits, drafts, start)
        if title == "nan":
            logits[:] = float("nan")

    monkeypatch.setattr(RowRule, "_mask", broken)

    def faulty(title: str):
        fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "integer", "title": title}}}
        out: list = []
        stream(server.url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 8, "response_format": fmt}, out)
        return out[0]

    for title, words in (("raise", "injected mask fault"), ("nan", "NaN logit")):
        (status, events), texts, alone = beside_innocents(server, lambda: faulty(title))
        assert status == 200 and events[-1] == "[DONE]", events
        failed_internally(json.loads(events[-2])["error"], caplog, words)
        assert texts == alone
    status, events = faulty("fine")
    assert status == 200 and "error" not in events[-2], events


def test_a_request_whose_penalties_raise_fails_alone_beside_other_penalised_rows(server, monkeypatch, caplog):
    """The penalties of all rows are computed together: when that raises, row by row, and only the row that
    raises fails (the innocent streams here penalise too)."""
    real = BatchRules._penalise_rows

    def broken(self, logits, drafts, start, rows):
        if any(self.rows[b].rules.logit_bias == ((13, 7),) for b in rows):
            raise RuntimeError("injected penalty fault")
        return real(self, logits, drafts, start, rows)

    monkeypatch.setattr(BatchRules, "_penalise_rows", broken)
    r, texts, alone = beside_innocents(
        server, lambda: server.post("/v1/completions", {**INNOCENT, "prompt": "x", "logit_bias": {"13": 7}}),
        innocent={**INNOCENT, "frequency_penalty": 0.5})
    failed_alone(r, caplog, "injected penalty fault")
    assert texts == alone


def test_a_request_whose_stop_check_raises_fails_alone(server, monkeypatch, caplog):
    real = TextStream.update

    def broken(self, ids, final=False):
        if "boom" in self.stop:
            raise UnicodeError("injected stop-string fault")
        return real(self, ids, final)

    monkeypatch.setattr(TextStream, "update", broken)
    r, texts, alone = beside_innocents(
        server, lambda: server.post("/v1/completions", {**INNOCENT, "prompt": "x", "stop": ["boom"]}))
    failed_alone(r, caplog, "injected stop-string fault")
    assert texts == alone


WORDED_LIKE_A_400 = "json_schema: the grammar refused token 5 the target chose under its mask"
WORDED_LIKE_A_500 = "internal error in this request's own processing: RuntimeError: stop"


@pytest.mark.parametrize("raise_, status, param", [
    (lambda: RuntimeError(WORDED_LIKE_A_400), 500, None),
    (lambda: RequestError(f"{WORDED_LIKE_A_500}: stop string found bad once it ran", field="stop"), 400, "stop"),
    (lambda: UnsatisfiableOutputError("structural_tag: no valid output from here", field="structural_tag"), 400,
     "tools"),
], ids=["internal-worded-as-input", "input-worded-as-internal", "tool-grammar-dead-end"])
def test_a_row_failure_is_answered_by_its_type_not_its_wording(server, monkeypatch, caplog, raise_, status, param):
    """The stop-string check raises during a round: an internal error is a 500 with a generic message even when
    its text reads like a request's fault; a RequestError is a 400 naming its field even when its text reads
    like an internal error. Streamed, the last event carries the same error; the streams beside it go on."""
    real = TextStream.update

    def broken(self, ids, final=False):
        if "boom" in self.stop:
            raise raise_()
        return real(self, ids, final)

    monkeypatch.setattr(TextStream, "update", broken)
    body = {**INNOCENT, "prompt": "x", "stop": ["boom"]}
    r, texts, alone = beside_innocents(server, lambda: server.post("/v1/completions", body))
    assert texts == alone
    assert r.status_code == status, r.text
    out: list = []
    stream(server.url, "/v1/completions", body, out)
    status_streamed, events = out[0]
    assert status_streamed == 200 and events[-1] == "[DONE]", events
    for err in (r.json()["error"], json.loads(events[-2])["error"]):
        if status == 500:
            failed_internally(err, caplog, WORDED_LIKE_A_400)
        else:
            assert err["type"] == "invalid_request_error" and err["param"] == param, err
            assert err["message"] == str(raise_()), err


def test_failures_map_to_answers_by_type():
    """serving/row_failures.py on its own: input at fault, 400 naming the API's field; everything else a 500 that
    shows no exception text."""
    dead_end = request_failed(UnsatisfiableOutputError("json_schema: no output", field="json_schema"))
    assert (dead_end.status, dead_end.param, dead_end.code) == (400, "response_format", "unsatisfiable_schema")
    late = request_failed(RequestError("logit_bias: bad", field="logit_bias"))
    assert (late.status, late.param, late.code, late.message) == (400, "logit_bias", None, "logit_bias: bad")
    fault = request_failed(RowFault("0123456789ab"))
    assert (fault.status, fault.code, fault.type) == (500, "request_failed", "server_error")
    assert "0123456789ab" in fault.message
    stray = request_failed(KeyError("json_schema: secret internals"))
    assert stray.status == 500 and stray.message == GENERIC


def test_a_row_failure_keeps_no_frames_alive(caplog):
    """A RequestError is kept until the request is answered: without its traceback or the exceptions chained to
    it, whose frames hold the round's tensors. Anything else becomes a RowFault, its traceback logged."""
    def late_check():
        big = [0.0] * 1000  # noqa: F841 (a frame local the failure must not keep)
        try:
            raise KeyError("inner")
        except KeyError:
            raise RequestError("logit_bias: found bad late", field="logit_bias") from None

    try:
        late_check()
    except RequestError as exc:
        kept = row_failure(exc)
    assert kept.field == "logit_bias" and kept.__traceback__ is None and kept.__context__ is None
    fault = row_failure(ValueError("secret"))
    assert isinstance(fault, RowFault) and "secret" not in str(fault)
    assert any(fault.reference in r.getMessage() for r in caplog.records)


def test_a_failing_shared_pass_ends_its_batch_with_a_500_event_and_the_server_goes_on(server, monkeypatch, capsys):
    real, armed, fired = Verifier.chain, threading.Event(), []

    def broken(self, *args, **kwargs):
        if not fired:  # the first round after prefill waits until the stream has begun, however fast the machine
            fired.append(armed.wait(60))
            raise RuntimeError("injected shared-pass fault")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Verifier, "chain", broken)
    out, started = [], threading.Event()
    body = {**INNOCENT, "prompt": "in the failing batch", "max_tokens": 120}
    t = threading.Thread(target=stream, args=(server.url, "/v1/completions", body, out, started))
    t.start()
    assert started.wait(60)
    armed.set()
    t.join(120)
    status, events = out[0]
    assert fired == [True], "no verify pass ran after the stream began"
    assert status == 200 and events[-1] == "[DONE]", events
    err = json.loads(events[-2])["error"]
    assert err["code"] == "batch_failed" and err["type"] == "server_error", err
    assert "retry" in err["message"] and "injected" not in err["message"]  # the text stays in the log
    reference = err["message"].split("reference ")[1].split(" ")[0]
    logged = capsys.readouterr().out
    assert f"round failed (reference {reference})" in logged and "injected shared-pass fault" in logged
    r = server.post("/v1/completions", {**INNOCENT, "prompt": "after the failure"})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
    assert server.engine.alive


def test_a_route_that_raises_answers_with_a_log_reference_not_its_text(server, monkeypatch, capsys):
    """An exception a route raises outside the engine is a 500 whose message names the logged traceback's reference;
    the exception's text (which may show internals) stays in the log, and the server goes on."""
    import time
    from types import SimpleNamespace

    from specc.serving import service as service_mod

    def boom():
        raise RuntimeError("secret internals")

    monkeypatch.setattr(service_mod, "time", SimpleNamespace(time=boom, perf_counter=time.perf_counter,
                                                             monotonic=time.monotonic))
    r = httpx.get(server.url + "/v1/models", timeout=30)
    err = r.json()["error"]
    assert r.status_code == 500 and err["code"] == "internal_error" and err["type"] == "server_error", r.text
    assert "secret" not in r.text and "RuntimeError" not in r.text
    reference = err["message"].split("reference ")[1].split(" ")[0]
    logged = capsys.readouterr().out
    assert f"internal error on /v1/models (reference {reference})" in logged and "secret internals" in logged
    monkeypatch.undo()
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 200


def test_memory_is_given_back_when_a_large_request_ends_while_others_run(bundles, monkeypatch):
    """glibc keeps the heap a long prompt's buffers grew (its logits with echo) unless asked: the engine trims
    it between rounds once such a request ends, without waiting for the others to finish."""
    from specc.serving import engine as engine_mod

    calls: list[int] = []
    s = Server(create_app(specc.load(bundles["long_lookup"]), name="tiny"))
    monkeypatch.setattr(engine_mod, "trim", lambda: calls.append(len(s.engine.live)) or True)
    try:
        out, started = [], threading.Event()
        body = {**INNOCENT, "prompt": "a long innocent stream", "max_tokens": 3000,
                "logit_bias": {"256": -100}}  # no end-of-text (the byte tokenizer's 256): it runs until cancelled
        t = threading.Thread(target=stream, args=(s.url, "/v1/completions", body, out, started))
        t.start()
        assert started.wait(60)
        prompt = [(i * 37) % 250 + 1 for i in range(1500)]
        r = s.post("/v1/completions", {**INNOCENT, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        streaming = [job for job in s.engine.live.values() if job.events_streamed]
        assert streaming, "the stream ended before the large request"
        s.engine.cancel(streaming[0])
        t.join(60)
        assert any(live for live in calls), calls  # trimmed while the stream still had its row
    finally:
        s.stop()
