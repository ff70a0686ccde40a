"""`specc serve`: the OpenAI API over a tiny bundle, called with the official openai client and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import uvicorn  # noqa: E402

try:  # the HTTP client the openai package depends on (httpx2 in openai >= 2.x, httpx before)
    import httpx2 as httpx
except ImportError:
    import httpx

import specc  # noqa: E402
from specc.speculation.sampling import SamplingParams  # noqa: E402
from specc.serving.app import create_app  # noqa: E402
from specc.serving.engine import AsyncEngine, Job  # noqa: E402
from specc.serving.schemas import APIError  # noqa: E402

PROMPTS = ["hello there", "abc abc abc", "x", "the quick brown fox"]


class Server:
    """A real uvicorn server on a free port, in a thread."""

    def __init__(self, app):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(400):
            if self.server.started:
                break
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    @property
    def engine(self) -> AsyncEngine:
        return self.app.state.engine

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)

    def post(self, path: str, body, **kw):
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=data, headers={"content-type": "application/json", **kw}, timeout=60)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def model(bundles):
    return specc.load(bundles["draft"])


@pytest.fixture(scope="module")
def server(model):
    s = Server(create_app(model, name="tiny", max_queue=64))
    yield s
    s.stop()


def _wait_idle(engine: AsyncEngine, timeout: float = 20.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if not engine.live and not engine.scheduler.busy:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: live {sorted(engine.live)}")


def test_completions_equal_generate(server, model):
    client = server.client()
    want = model.generate(PROMPTS, max_new_tokens=20)
    for prompt, w in zip(PROMPTS, want):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].text == w.text and r.choices[0].finish_reason == w.finish_reason
        assert r.usage.completion_tokens == len(w.token_ids)
        assert r.usage.prompt_tokens == len(model.encode([prompt])[0])


def test_streamed_completions_equal_generate_with_usage(server, model):
    client = server.client()
    want = model.generate(PROMPTS[:2], max_new_tokens=24)
    for prompt, w in zip(PROMPTS, want):
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == w.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == w.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(w.token_ids)


def test_chat_equals_generate_with_chat_template(server, model):
    client = server.client()
    w = model.generate(["hi there"], max_new_tokens=16, chat=True)[0]
    messages = [{"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
    assert r.choices[0].message.content == w.text and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == w.text
    assert chunks[-1].choices[0].finish_reason == w.finish_reason


def test_n_samples_and_batched_prompts(server):
    client = server.client()
    a = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=1.0, n=3, seed=5)
    assert [c.index for c in a.choices] == [0, 1, 2] and len({c.text for c in a.choices}) > 1
    r = client.completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]


def test_seed_reproduces_samples_with_a_fixed_k(model):
    """With k auto the k of each round depends on timings, so only a fixed k makes a seed reproducible."""
    s = Server(create_app(model, name="tiny", k=3))
    try:
        client = s.client()
        a, b = (client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=1.0, n=2, seed=5)
                for _ in range(2))
        assert [c.text for c in a.choices] == [c.text for c in b.choices]
    finally:
        s.stop()


def test_stop_strings(server, model):
    free = model.generate(["abc"], max_new_tokens=30)[0].text
    stop = free[5:7]
    r = server.client().completions.create(model="tiny", prompt="abc", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == free[:free.index(stop)] and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"model": "tiny", "prompt": "a", "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "prompt": "a", "top_p": 1.5}, "top_p"),
    ({"model": "tiny", "prompt": "a", "n": 0}, "n"),
    ({"model": "tiny", "prompt": "a", "stop": [""]}, "stop"),
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": ""}, "prompt"),
    ({"model": "tiny", "prompt": [[1, 2], [999999]]}, "prompt.1"),
    ({"model": "tiny", "prompt": "a", "logprobs": 6}, "logprobs"),
    ({"model": "tiny", "prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "tiny", "prompt": "a", "max_tokens": 100000}, "max_tokens"),
    ({"model": "tiny", "prompt": "a" * 300}, "prompt"),
    ({"model": "tiny", "prompt": "a", "seed": -10**30}, "seed"),
    ({"model": "tiny", "prompt": "a", "seed": 2**64}, "seed"),
    ({"model": "tiny", "prompt": "a", "seed": 2**64 - 1, "n": 2}, "seed"),  # row 1's seed is past 2**64 - 1
])
def test_bad_completion_requests_answer_400_naming_the_field(server, body, param):
    r = server.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": "y"}},
     "stream_options.include_usage"),
])
def test_bad_chat_requests_answer_400_naming_the_field(server, body, param):
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_other_errors(server):
    assert server.post("/v1/completions", b"{not json").status_code == 400
    r = server.post("/v1/completions", {"model": "other", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_models_health_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in server.client().models.list().data] == ["tiny"]
    server.client().completions.create(model="tiny", prompt="abc abc abc abc", max_tokens=20, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("specc:e2e_request_latency_seconds_bucket", "specc:time_to_first_token_seconds_count",
                 "specc:inter_token_latency_seconds_count", "specc:generation_tokens_total",
                 "specc:generation_tokens_per_second", "specc:num_requests_waiting", "specc:batch_size_count",
                 "specc:spec_decode_num_drafts_total", "specc:spec_decode_num_draft_tokens_total",
                 "specc:spec_decode_num_accepted_tokens_total",
                 'specc:spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                 "specc:spec_decode_k_bucket", 'specc:request_success_total{finished_reason="length"}'):
        assert name in text, name
    assert 'specc:request_errors_total{status="400"}' in text


def test_disconnect_mid_stream_frees_the_row(server):
    engine = server.engine
    _wait_idle(engine)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "abc", "max_tokens": 200, "stream": True}) as r:
        lines = r.iter_lines()
        assert any(line.startswith("data: ") for line in lines)
    _wait_idle(engine)  # the row was cancelled long before 200 tokens
    assert engine.scheduler.stats.new_tokens < engine.scheduler.stats.requests * 200
    # and the server still answers
    assert server.client().completions.create(model="tiny", prompt="abc", max_tokens=3).choices[0].text is not None


def test_concurrent_clients_share_batches_and_stay_exact(server, model):
    prompts = [p * (1 + i % 3) for i, p in enumerate(PROMPTS * 3)]
    want = {p: c.text for p, c in zip(prompts, model.generate(prompts, max_new_tokens=16))}

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        async def one(p):
            r = await client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
            return p, r.choices[0].text

        return await asyncio.gather(*(one(p) for p in prompts))

    for p, text in asyncio.run(run()):
        assert text == want[p]


def test_api_key(model):
    s = Server(create_app(model, name="tiny", api_key="sesame"))
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        assert s.client(api_key="sesame").completions.create(model="tiny", prompt="a", max_tokens=2).choices
        assert httpx.get(s.url + "/health").status_code == 200  # health and metrics stay open
    finally:
        s.stop()


def test_a_failing_round_answers_500_and_the_server_goes_on(model, monkeypatch):
    s = Server(create_app(model, name="tiny"))
    try:
        calls = {"n": 0}
        real = type(s.engine.scheduler).step

        def flaky(self):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return real(self)

        monkeypatch.setattr(type(s.engine.scheduler), "step", flaky)
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 30})
        message = r.json()["error"]["message"]
        assert r.status_code == 500 and "reference" in message and "boom" not in message  # the text stays in the log
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        s.stop()


def test_full_queue_answers_429_with_retry_after(model):
    engine = AsyncEngine(model, max_queue=3)  # not started: nothing leaves the queue

    async def fill():
        job = lambda n: Job(["abc"], False, 4, SamplingParams(), 0, [], n=n)  # noqa: E731
        engine.submit(job(2))
        with pytest.raises(APIError) as info:
            engine.submit(job(2))
        engine.submit(job(1))
        return info.value

    err = asyncio.run(fill())
    assert err.status == 429 and err.headers["Retry-After"] and err.body()["error"]["code"] == "queue_full"


def test_429_over_http(model):
    s = Server(create_app(model, name="tiny", max_queue=1, max_batch=1))
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"model": "tiny", "prompt": "abc", "max_tokens": 40}
                return await asyncio.gather(*(c.post(s.url + "/v1/completions", json=body) for _ in range(6)))

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert 200 in codes and 429 in codes, codes
    finally:
        s.stop()


@pytest.mark.parametrize("host, port, match", [("127.0.0.1", 70000, "allowed an integer in 0..65535"),
                                               ("127.0.0.1", -1, "allowed an integer in 0..65535"),
                                               ("nosuch.invalid", 0, "cannot listen on nosuch.invalid:0"),
                                               ("127.0.0.1", "busy", "cannot listen on 127.0.0.1:")])
def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(bundles, monkeypatch, host, port, match):
    """A busy port, a port out of range or an unknown host: one clear error before the bundle loads (uvicorn
    used to log it after loading, and an out-of-range port ended in a traceback)."""
    import socket

    import specc.runtime.model
    from specc.errors import SpeccError
    from specc.serving import serve

    monkeypatch.setattr(specc.runtime.model, "load", lambda *a, **k: pytest.fail("the bundle was loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        if port == "busy":
            port = busy.getsockname()[1]
        with pytest.raises(SpeccError, match=match):
            serve(bundles["draft"], host=host, port=port)


def test_serve_hands_uvicorn_the_socket_it_bound(bundles, monkeypatch, capfd):
    seen = {}

    def run(server, sockets=None):
        seen["app"], seen["sockets"] = server.config.app, sockets
        seen["port"] = sockets[0].getsockname()[1]

    monkeypatch.setattr(uvicorn.Server, "run", run)
    from specc.serving import serve

    serve(bundles["draft"], port=0, name="tiny")
    assert seen["port"] > 0 and seen["app"].state.engine is not None
    assert seen["sockets"][0].fileno() == -1  # closed once the server returns
    assert f"Uvicorn running on http://127.0.0.1:{seen['port']} " in capfd.readouterr().err  # the address, as uvicorn says it


@pytest.mark.parametrize("settings, match", [({"api_key": ""}, "--api-key"), ({"api_key": "two words"}, "--api-key"),
                                             ({"api_key": "key\n"}, "--api-key"), ({"name": ""}, "--name")])
def test_serve_refuses_an_empty_api_key_or_name_before_loading(bundles, monkeypatch, settings, match):
    """An empty key (an unset variable) would admit every client that sends `Bearer ` with nothing after it."""
    import specc.runtime.model
    from specc.errors import SpeccError
    from specc.serving import serve

    monkeypatch.setattr(specc.runtime.model, "load", lambda *a, **k: pytest.fail("the bundle was loaded"))
    with pytest.raises(SpeccError, match=match):
        serve(bundles["draft"], port=0, **settings)


def test_the_api_key_comes_from_specc_api_key(monkeypatch):
    from specc.cli import build_parser

    monkeypatch.setenv("SPECC_API_KEY", "s3cret")
    assert build_parser().parse_args(["serve", "b"]).api_key == "s3cret"
    assert build_parser().parse_args(["serve", "b", "--api-key", "other"]).api_key == ["other"]
    monkeypatch.delenv("SPECC_API_KEY")
    assert build_parser().parse_args(["serve", "b"]).api_key is None


ODD = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6)
       | st.lists(st.integers(-2, 2**40) | st.text(max_size=3), max_size=3)
       | st.lists(st.lists(st.integers(-1, 600), max_size=2), max_size=2)
       | st.dictionaries(st.text(max_size=3), st.integers() | st.text(max_size=2), max_size=2))
FIELDS = ("model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
          "stream_options", "logprobs", "echo", "best_of", "suffix", "user", "presence_penalty", "logit_bias")
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | ODD,
                                           "content": st.text(max_size=8) | ODD}), max_size=3)


@pytest.fixture(scope="module")
def fuzz_server(model):
    logged = []
    s = Server(create_app(model, name="tiny", max_queue=64, log=logged.append))
    yield s, logged
    s.stop()


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(chat=st.booleans(), changes=st.dictionaries(st.sampled_from(FIELDS), ODD | MESSAGES, max_size=3))
def test_fuzzed_requests_answer_200_or_a_4xx_error(fuzz_server, chat, changes):
    """Any JSON body: an answer or an OpenAI error naming what is wrong, never a 5xx or a logged traceback."""
    s, logged = fuzz_server
    body = {"model": "tiny", "max_tokens": 3, **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    body.update(changes)
    r = s.post("/v1/chat/completions" if chat else "/v1/completions", body)
    assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"]
    elif body.get("stream") is not True:
        assert r.json()["choices"]
    assert not logged, logged


def test_prefix_cache_reports_cached_tokens_and_metrics(server, model):
    """A prompt sent twice: the second response counts its cached blocks, /metrics the queries and hits."""
    _wait_idle(server.engine)
    model.set_prefix_cache_mb(8)
    try:
        prompt = "def f(x):\n    return x + 1\n" * 6  # 162 tokens (byte tokenizer): two whole blocks cached
        client = server.client()
        first = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        again = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert again.choices[0].text == first.choices[0].text
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == 128
        text = httpx.get(server.url + "/metrics").text
        hits = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("specc:prefix_cache_hits_total"))
        assert hits >= 128 and "specc:prefix_cache_queries_total" in text and "specc:prefix_cache_bytes" in text
    finally:
        model.set_prefix_cache_mb(0)
