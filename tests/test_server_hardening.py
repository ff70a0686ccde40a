"""No request may stall, crash or corrupt another: `specc serve` (a real process on loopback) against
oversized, truncated, contradictory and unanswerable requests, SIGTERM with streams in flight, and the
library/CLI side of the same defects (top_p underflow, control characters echoed, chat without a template)."""
from __future__ import annotations

import json
import shutil
import signal
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
from server_probe import (LiveServer, chunked_oversized_body, dropped_upload, httpx,  # noqa: E402
                          LONGER, latency_under_attack, normal_latency, oversized_body)

import specc  # noqa: E402
from specc.bundle import MANIFEST, read_manifest  # noqa: E402
from specc.cli import main  # noqa: E402
from specc.errors import BundleError, RequestError, SpeccError, escape_control  # noqa: E402
from specc.serving.schemas import MAX_STOP_CHARS, MAX_STOP_STRINGS  # noqa: E402
from specc.speculation.sampling import probs_from_logits  # noqa: E402


@pytest.fixture(scope="module")
def live(bundles, tmp_path_factory):
    s = LiveServer(bundles["draft"], tmp_path_factory.mktemp("live") / "serve.log", "--max-queue", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(bundles):
    return specc.load(bundles["draft"])


def error_of(r) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert err["message"] and err["type"], err
    return err


def no_trouble(server: LiveServer) -> None:
    log = server.log()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
    assert 'specc:request_errors_total{status="500"}' not in httpx.get(server.url + "/metrics").text


# -- 1: top_p below what float32 can hold ------------------------------------------------------------
def test_top_p_that_underflows_keeps_the_most_likely_token(model, live):
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    for top_p in (0.0, 1e-46, 1e-300):
        p = probs_from_logits(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([top_p], dtype=torch.float32))
        assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]], (top_p, p)
    greedy = model.generate(["abc"], max_new_tokens=8, temperature=0)[0]
    for top_p in (1e-46, 1e-300):
        tiny = model.generate(["abc"], max_new_tokens=8, temperature=1.0, top_p=top_p, seed=3)[0]
        assert (tiny.text, tiny.token_ids) == (greedy.text, greedy.token_ids)
    for path, body in (("/v1/completions", {"prompt": "abc"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]})):
        base = {**body, "model": "tiny", "max_tokens": 8, "seed": 1}
        want = live.post(path, {**base, "temperature": 0}).json()
        got = live.post(path, {**base, "temperature": 1.0, "top_p": 1e-300}).json()
        text = (lambda r: r["choices"][0].get("text", r["choices"][0].get("message", {}).get("content")))
        assert text(got) == text(want) and got["usage"] == want["usage"]


def test_generate_cli_with_a_top_p_that_underflows(bundles, capsys):
    assert main(["generate", str(bundles["draft"]), "--prompt", "abc", "--max-new-tokens", "6", "--json"]) == 0
    greedy = json.loads(capsys.readouterr().out)["completions"]
    assert main(["generate", str(bundles["draft"]), "--prompt", "abc", "--max-new-tokens", "6", "--json",
                 "--temperature", "1", "--top-p", "1e-300"]) == 0
    assert json.loads(capsys.readouterr().out)["completions"] == greedy and greedy[0]


# -- 2: what one request may cost the others ---------------------------------------------------------
def test_a_body_over_the_cap_is_413_from_its_declared_length(live):
    status, body, seconds = oversized_body(live.port)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large", body
    assert seconds < 5
    status, body, seconds = chunked_oversized_body(live.port)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large", body
    assert live.post("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2}).status_code == 200


def test_stop_strings_are_capped_in_count_and_length(live):
    base = {"model": "tiny", "prompt": "abc", "max_tokens": 4}
    for stop, what in ((["x"] * (MAX_STOP_STRINGS + 1), f"allowed at most {MAX_STOP_STRINGS}"),
                       (["x" * (MAX_STOP_CHARS + 1)], f"allowed at most {MAX_STOP_CHARS}")):
        r = live.post("/v1/completions", {**base, "stop": stop})
        assert r.status_code == 400 and error_of(r)["param"] == "stop" and what in error_of(r)["message"], r.text
    at_caps = ["\u0100" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
    assert live.post("/v1/completions", {**base, "stop": at_caps}).status_code == 200


def test_a_prompt_too_long_for_any_tokenisation_is_refused_before_tokenising(live, model):
    start = time.perf_counter()
    r = live.post("/v1/completions", {"model": "tiny", "prompt": "x" * 200_000})
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
    assert "characters" in error_of(r)["message"] and time.perf_counter() - start < 3
    messages = [{"role": "user", "content": "y" * 200_000}]
    r = live.post("/v1/chat/completions", {"model": "tiny", "messages": messages})
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
    r = live.post("/v1/completions", {"model": "tiny", "prompt": [1] * 100_000})
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
    # within the bound, the exact token count decides, as before
    r = live.post("/v1/completions", {"model": "tiny", "prompt": "a" * 300})
    assert r.status_code == 400 and "tokens" in error_of(r)["message"], r.text


def test_a_normal_request_stays_fast_beside_rejected_and_maximal_requests(live):
    """The issue's bar: within 2x its idle latency while a 20 MB body, stop strings at and past the caps and a
    200k-character prompt are sent beside it (before the fix, a 20 MB prompt held the engine for 17-30 s).
    A 128-token request, so that generation rather than HTTP overhead is what is timed; measured in pairs,
    with a 0.1 s slack and up to three tries, because this machine's other load swings latencies by 2x."""
    normal_latency(live, 2, LONGER)  # warm
    for attempt in range(3):
        idle, attacked, results = latency_under_attack(live, 7, (MAX_STOP_STRINGS, MAX_STOP_CHARS), LONGER)
        kinds = {name: {status for n, status, _ in results if n == name} for name, _, _ in results}
        assert kinds["big_body"] == {413} and kinds["too_many_stops"] == {400}, kinds
        assert kinds["too_long_stop"] == {400} and kinds["long_prompt"] == {400}, kinds
        assert kinds["maximal_stops"] == {200}, kinds
        assert max(seconds for _, _, seconds in results) < 10, results
        if statistics.median(attacked) <= 2 * statistics.median(idle) + 0.1:
            break
    else:
        pytest.fail(f"attacked {statistics.median(attacked):.3f} s against idle {statistics.median(idle):.3f} s")
    no_trouble(live)


# -- 3: a client that leaves mid-upload --------------------------------------------------------------
def test_a_client_dropping_mid_upload_is_no_500(live):
    for _ in range(6):
        dropped_upload(live.port)
    time.sleep(0.5)
    no_trouble(live)
    assert live.post("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2}).status_code == 200


# -- 5: larger than the queue ------------------------------------------------------------------------
def test_a_request_larger_than_the_queue_is_400_not_429(live):
    r = live.post("/v1/completions", {"model": "tiny", "prompt": "a", "n": 9, "max_tokens": 2})
    assert r.status_code == 400 and error_of(r)["code"] == "request_too_large" and "--max-queue" in r.text, r.text
    assert "retry-after" not in r.headers
    r = live.post("/v1/completions", {"model": "tiny", "prompt": ["a"] * 9, "max_tokens": 2})
    assert r.status_code == 400 and error_of(r)["code"] == "request_too_large", r.text
    r = live.post("/v1/completions", {"model": "tiny", "prompt": ["a"] * 4, "n": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


# -- 6: what is not honoured is refused ----------------------------------------------------------------
@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),  # honoured from 0 to 5 (tests/test_structured.py)
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"min_p": 0.1}, "min_p"),
    ("/v1/chat/completions", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"ignore_eos": True}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                                           {"role": "user", "content": "hi"}]}, "messages.0.tool_calls.0.function"),
])
def test_fields_that_are_not_honoured_are_refused(live, path, extra, param):
    body = {"model": "tiny", "max_tokens": 2, **({"prompt": "a"} if "chat" not in path else
                                                 {"messages": [{"role": "user", "content": "hi"}]}), **extra}
    r = live.post(path, body)
    assert r.status_code == 400 and error_of(r)["param"] == param, r.text


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"logprobs": None, "best_of": 1, "suffix": None, "echo": False, "min_p": 0}),
    ("/v1/chat/completions", {"logprobs": False, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                              "user": "u", "metadata": {"a": "b"}, "parallel_tool_calls": True}),
])
def test_neutral_values_of_those_fields_are_accepted(live, path, extra):
    body = {"model": "tiny", "max_tokens": 2, **({"prompt": "a"} if "chat" not in path else
                                                 {"messages": [{"role": "user", "content": "hi"}]}), **extra}
    assert live.post(path, body).status_code == 200


# -- 9: content type and the API key ---------------------------------------------------------------------
def test_a_body_not_sent_as_json_is_415(live):
    body = json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 2})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        r = httpx.post(live.url + "/v1/completions", content=body, headers={"content-type": ctype}, timeout=30)
        assert r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type", (ctype, r.text)
    r = httpx.post(live.url + "/v1/completions", content=body, timeout=30,
                   headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_the_api_key_guards_every_route_but_health_and_metrics(bundles, tmp_path):
    key = "s3cret-key"
    s = LiveServer(bundles["draft"], tmp_path / "serve.log", "--api-key", key)
    try:
        for path in ("/openapi.json", "/docs", "/v1/models", "/nothing"):
            r = httpx.get(s.url + path, timeout=30)
            assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key", (path, r.text)
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2})
        assert r.status_code == 401, r.text
        auth = {"authorization": f"Bearer {key}"}
        assert httpx.get(s.url + "/openapi.json", headers=auth, timeout=30).status_code == 200
        assert s.post("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2}, **auth).status_code == 200
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        assert httpx.get(s.url + "/metrics", timeout=30).status_code == 200
    finally:
        s.stop()


# -- 8: SIGTERM with streams in flight -------------------------------------------------------------------
def _stream(url: str, body: dict, out: list) -> None:
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={"model": "tiny", "stream": True, **body},
                          timeout=60) as r:
            events.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as exc:
        events.append(f"{type(exc).__name__}")
    out.append(events)


QUEUED = 18  # streams queued behind the first one in the drain test


def test_sigterm_drains_streams_in_flight_and_ends_the_rest_with_an_error(bundles, tmp_path):
    """One row at a time: the first stream is running when SIGTERM comes and finishes within the grace
    period; streams still queued at its end get an error event, then [DONE]; new connections are refused.
    The grace period is far shorter than the queued streams' 3,600 tokens take even on a fast CPU at real-time
    priority (the tiny model writes a few thousand tokens a second there)."""
    s = LiveServer(bundles["draft"], tmp_path / "serve.log", "--max-batch", "1", "--shutdown-timeout", "0.05",
                   "--k", "3")
    try:
        done: list = []
        threads = [threading.Thread(target=_stream, args=(s.url, {"prompt": "abc", "max_tokens": 8}, done))]
        threads += [threading.Thread(target=_stream, args=(s.url, {"prompt": f"p{i % 10}", "max_tokens": 200,
                                                                     "temperature": 0}, done)) for i in range(QUEUED)]
        plain: list = []
        threads.append(threading.Thread(target=lambda: plain.append(s.post("/v1/completions", {
            "model": "tiny", "prompt": "q", "max_tokens": 200, "temperature": 0}))))
        threads[0].start()  # the stream in flight when the signal comes
        time.sleep(0.05)
        for t in threads[1:]:  # at once: started one by one, the queue would drain as fast as it fills
            t.start()
        end = time.monotonic() + 30
        while time.monotonic() < end:  # every request admitted (its prompt tokens counted): 3 + QUEUED x 2 + 1
            if f"specc:prompt_tokens_total {3 + 2 * QUEUED + 1}.0" in httpx.get(s.url + "/metrics", timeout=10).text:
                break
            time.sleep(0.05)
        start = time.monotonic()
        s.signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):
            httpx.get(s.url + "/health", timeout=2)  # no longer listening
        for t in threads:
            t.join(30)
        s.proc.wait(30)
        elapsed = time.monotonic() - start
    finally:
        s.stop()
    assert elapsed < 0.5 + 8, elapsed
    r = plain[0]  # a non-streaming request queued behind them all: answered 503, or it finished in time
    assert r.status_code == 200 or (r.status_code == 503 and error_of(r)["code"] == "shutting_down"), r.text
    assert len(done) == QUEUED + 1 and all(e[0] == 200 and e[-1] == "[DONE]" for e in done), done
    last = [json.loads(e[-2]) for e in done]
    finished = [x for x in last if "choices" in x and x["choices"][0]["finish_reason"] in ("length", "stop")]
    cut = [x for x in last if x.get("error", {}).get("code") == "shutting_down"]
    assert len(finished) + len(cut) == QUEUED + 1, done
    assert finished and cut, done
    short = next(e for e in done if len(e) < 8 + 3)  # the 8-token stream that was running: it finished
    assert json.loads(short[-2])["choices"][0]["finish_reason"] in ("length", "stop"), short
    assert "Traceback" not in s.log(), s.log()[-3000:]


# -- 4: control characters in messages --------------------------------------------------------------------
def test_escape_control_escapes_every_control_character():
    assert escape_control("a\nb\tc\rd\x1b[31m\x7f\x9b\u2028\u202e") == "a\\nb\\tc\\rd\\x1b[31m\\x7f\\x9b\\u2028\\u202e"
    assert escape_control(escape_control("x\ny")) == "x\\ny"
    assert escape_control("ok é 中 \\n") == "ok é 中 \\n"
    assert "\n" not in str(SpeccError("bad \n name")) and str(SpeccError("a", details=["b\nc"])) == "a\n  b\\nc"


def test_forged_lines_in_a_manifest_or_a_path_are_escaped(bundles, tmp_path, capsys):
    b = Path(shutil.copytree(bundles["draft"], tmp_path / "b"))
    m = json.loads((b / MANIFEST).read_text())
    rel = next(iter(m["files"]))
    m["files"][rel + "\nbundle OK: every file verified\t"] = m["files"].pop(rel)
    (b / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(BundleError) as info:
        read_manifest(b)
    assert "\n" not in str(info.value) and "\t" not in str(info.value) and "\\nbundle OK" in str(info.value)
    assert main(["inspect", str(b)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specc: error: "), err

    missing = tmp_path / "no\nbundle OK\x1b[2J"
    assert main(["inspect", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "no\\nbundle OK\\x1b[2J" in err, err

    # a value of a manifest that verifies (only the id changes) is printed by inspect on its own line
    m = json.loads((bundles["draft"] / MANIFEST).read_text())
    m["models"]["target"] = "/models/t\nbundle OK\ttampered"
    c = Path(shutil.copytree(bundles["draft"], tmp_path / "c"))
    (c / MANIFEST).write_text(json.dumps(m))
    assert main(["inspect", str(c)]) == 0
    out = capsys.readouterr().out
    assert "\nbundle OK" not in out and "/models/t\\nbundle OK\\ttampered" in out, out

    # a file present on disk whose name holds a newline: the verification list stays one line per problem
    (c / "tokenizer" / "x\nbundle OK").write_text("x")
    with pytest.raises(BundleError) as info:
        specc.load(c)
    lines = str(info.value).split("\n")
    assert len(lines) == 2 and "x\\nbundle OK" in lines[1], lines


# -- 7: chat without a chat template -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def no_template(bundles, tmp_path_factory) -> Path:
    """The draft bundle with its chat template removed (as a GGUF model converted without one)."""
    b = Path(shutil.copytree(bundles["draft"], tmp_path_factory.mktemp("nochat") / "b"))
    m = json.loads((b / MANIFEST).read_text())
    for rel in [r for r in m["files"] if r.endswith("chat_template.jinja")]:
        (b / rel).unlink()
        del m["files"][rel]
    config = json.loads((b / "tokenizer" / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
    (b / MANIFEST).write_text(json.dumps(m))
    return b


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def test_chat_without_a_template_is_one_clear_error(no_template, tmp_path, capsys):
    model = specc.load(no_template)
    with pytest.raises(RequestError, match="no chat template.*--chat-template FILE"):
        model.generate(["hi"], chat=True, max_new_tokens=2)
    assert main(["generate", str(no_template), "--chat", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("specc: error: ") == 1 and "Traceback" not in err and "--chat-template FILE" in err, err

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    assert main(["generate", str(no_template), "--chat", "--prompt", "hi", "--max-new-tokens", "4", "--json",
                 "--chat-template", str(template)]) == 0
    text = json.loads(capsys.readouterr().out)["completions"][0]
    model.set_chat_template(TEMPLATE)
    assert model.generate(["hi"], chat=True, max_new_tokens=4)[0].text == text
    assert model.encode(["hi"], chat=True)[0] == model.encode(["[user] hi\n[assistant] "])[0]

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    assert main(["generate", str(no_template), "--chat", "--prompt", "hi", "--chat-template", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("specc: error: ") == 1 and "not a chat template" in err, err
    assert main(["generate", str(no_template), "--chat", "--prompt", "hi", "--chat-template", str(tmp_path / "none")]) == 2
    assert "--chat-template" in capsys.readouterr().err


def test_serve_chat_without_a_template_and_with_chat_template_file(no_template, tmp_path):
    from specc.serving.engine import AsyncEngine
    from specc.serving.schemas import APIError

    engine = AsyncEngine(specc.load(no_template))  # what a chat request meets (not started: nothing runs)
    with pytest.raises(APIError) as info:
        engine.encode_prompt([{"role": "user", "content": "hi"}], chat=True)
    assert info.value.status == 400 and info.value.code == "no_chat_template" and "--chat-template" in info.value.message

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    s = LiveServer(no_template, tmp_path / "serve2.log", "--chat-template", str(template))
    try:
        r = s.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 4, "temperature": 0})
        want = s.post("/v1/completions", {"model": "tiny", "prompt": "[user] hi\n[assistant] ", "max_tokens": 4,
                                          "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.json()["choices"][0]["text"]
    finally:
        s.stop()
