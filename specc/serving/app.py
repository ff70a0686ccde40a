"""The FastAPI application of `specc serve`: OpenAI's completions and chat completions, models,
health and Prometheus metrics, over one AsyncEngine.

What one request may cost the others is bounded: bodies above --max-body-mb are refused from
their Content-Length (413) or as soon as they grow past it; JSON above HEAVY_BYTES is parsed,
and every prompt tokenised, in thread pools (large inputs in a pool of their own, so a huge
prompt never makes a normal one wait for a worker); prompt text longer than the context could
hold is refused before it is tokenised; stop strings are capped in count and length (schemas.py).
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import RequestError, SpeccError, escape_control
from ..runtime.model import SpecModel
from ..runtime.scheduler import StreamEvent
from .engine import AsyncEngine, Failed, Job, ShuttingDown
from . import process
from .row_failures import request_failed as _request_failed
from .schemas import (APIError, ChatCompletionRequest, CompletionRequest, choice, completion_object, logprobs_object,
                      new_id, parse_request, usage)
from .tools import ToolReply, plan as plan_tools

DISCONNECT_POLL_S = 0.5
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
DEFAULT_MAX_BODY_BYTES = 8 << 20
HEAVY_BYTES = 64 << 10  # bodies above this are parsed and tokenised by the pool for large inputs
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key and while draining (load balancers poll them)
STOP_FLUSH_S = 5.0  # after the grace period, how long ended requests get to send their last chunk


def check_server_settings(name: str, api_key: str | list[str] | None) -> list[str]:
    """The served model name must be printable text and each API key a non-empty bearer token: an empty key
    (say, from an unset variable) would let through every client that sends an empty one. Returns the keys."""
    if not isinstance(name, str) or not name or not name.isprintable():
        raise SpeccError(f"--name {name!r}: allowed a non-empty printable model name")
    keys = [] if api_key is None else [api_key] if isinstance(api_key, str) else list(api_key)
    for key in keys:
        if not (isinstance(key, str) and key and all("!" <= c <= "~" for c in key)):
            raise SpeccError("--api-key (or SPECC_API_KEY): empty or not a bearer token; allowed visible ASCII "
                             "characters without spaces, or no key at all to serve without authorization")
    return keys


class ServingState:
    """What a graceful shutdown needs to know: requests being answered and the jobs behind them."""

    def __init__(self) -> None:
        self.draining = False  # SIGTERM seen: new requests get 503
        self.stopped = False  # the grace period is over: requests still running were ended
        self.requests = 0  # requests being answered (not counting /health and /metrics)
        self.jobs: dict[int, Job] = {}  # id -> job submitted and not yet answered in full


class Guard:
    """ASGI middleware in front of every route: while draining, 503 for anything but /health and /metrics;
    with an API key, 401 without it on every other route (the OpenAPI schema and unknown paths included,
    so the key also hides which routes exist); counts the requests in flight for the drain."""

    def __init__(self, app, *, api_keys: list[str], state: ServingState, fail):
        self.app, self.api_keys, self.state, self.fail = app, api_keys, state, fail

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.state.draining:
            error = APIError(503, "the server is shutting down and takes no new requests; retry on another instance",
                             type="server_error", code="shutting_down", headers={"Retry-After": "5", "Connection": "close"})
            return await self.fail(error.status, error.body(), error.headers)(scope, receive, send)
        key = self._key(scope)
        if self.api_keys and key is None:
            error = APIError(401, "invalid or missing API key (send the header Authorization: Bearer KEY)",
                             type="authentication_error", code="invalid_api_key")
            return await self.fail(error.status, error.body(), {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        scope.setdefault("state", {})["api_key_index"] = key  # the client's prefix-cache domain
        self.state.requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.requests -= 1

    def _key(self, scope) -> int | None:
        """Which configured key the request carries (every key compared, in constant time each)."""
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        found = None
        for i, key in enumerate(self.api_keys):
            if secrets.compare_digest(given, f"Bearer {key}".encode()):
                found = i
        return found


def create_app(model: SpecModel, *, name: str = "specc", k: int | str | None = "auto", speculative: bool = True,
               max_batch: int | None = None, max_queue: int = 256, api_key: str | list[str] | None = None, log=print,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """An app serving `model`; the engine thread starts with the app (its lifespan) and stops with it.
    api_key: one key or several (each client key is its own prefix-cache domain).
    `app.state.drain(timeout)` is the graceful shutdown (serving.serve calls it on SIGTERM)."""
    api_keys = check_server_settings(name, api_key)
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1024:
        raise SpeccError(f"--max-body-mb: allowed at least 1 KiB of request body, got {max_body_bytes!r} bytes")
    engine = AsyncEngine(model, k=k, speculative=speculative, max_batch=max_batch, max_queue=max_queue, log=log)
    metrics = engine.metrics
    state = ServingState()
    light = ThreadPoolExecutor(2, thread_name_prefix="specc-prepare")
    heavy = ThreadPoolExecutor(1, thread_name_prefix="specc-prepare-large")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker = process.starting(model, log)
        engine.start()
        yield
        engine.close()
        process.stopped(model, worker)
        for pool in (light, heavy):
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specc serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.serving = state

    def fail(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
        metrics.errors.labels(status=str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)

    app.add_middleware(Guard, api_keys=api_keys, state=state, fail=fail)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return fail(exc.status, exc.body(), exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return fail(exc.status_code, APIError(exc.status_code, str(exc.detail), type=kind).body())

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        return Response(status_code=499)  # the client left mid-upload: nobody reads this (nginx's code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log(f"specc serve: internal error on {escape_control(request.url.path)}: {type(exc).__name__}: "
            f"{escape_control(exc)}")
        return fail(500, APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body())

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "specc", "max_model_len": model.max_context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, *await parse(request, CompletionRequest), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, *await parse(request, ChatCompletionRequest), chat=True)

    async def read_body(request: Request) -> bytes:
        """The JSON body, refused (415) unless sent as JSON, and (413) once it is larger than the cap, from
        its declared length before any of it is read."""
        ctype = request.headers.get("content-type", "")
        if ctype.split(";", 1)[0].strip().lower() != "application/json":
            raise APIError(415, "send the request body as JSON with the header Content-Type: application/json "
                                f"(got {escape_control(ctype[:80]) or 'none'})", code="unsupported_media_type")
        declared = request.headers.get("content-length", "")
        too_large = APIError(413, f"the request body is larger than this server's limit of {max_body_bytes} bytes "
                                  "(--max-body-mb)", code="request_too_large", headers={"Connection": "close"})
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():  # ClientDisconnect if the client leaves mid-upload
            body += chunk
            if len(body) > max_body_bytes:
                raise too_large
        return bytes(body)

    async def parse(request: Request, cls) -> tuple:
        raw = await read_body(request)
        if len(raw) <= HEAVY_BYTES:
            return parse_request(cls, raw), False
        return await asyncio.get_running_loop().run_in_executor(heavy, parse_request, cls, raw), True

    async def generate(request: Request, req, large: bool, chat: bool):
        start = time.perf_counter()
        if req.model is not None and req.model != name:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves {name!r}", "model",
                           type="not_found_error", code="model_not_found")
        try:
            params = model.sampling_params(req.temperature, 0 if req.top_k == -1 else req.top_k, req.top_p)
        except RequestError as exc:
            raise APIError(400, str(exc), str(exc).split(" ")[0]) from None
        # compiling a schema is the grammar library's work: off the event loop, like tokenising
        rules, tools = await asyncio.get_running_loop().run_in_executor(heavy if large else light, request_rules, req, chat)
        prompts = [req.conversation()] if chat else req.prompts()
        engine.check_room(len(prompts) * req.n)  # before any tokenising: a request that cannot be queued costs nothing
        if not chat:
            for p, prompt in enumerate(prompts):
                engine.check_length(prompt, chat, p)
        default_max = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        check_seed(seed, len(prompts) * req.n)
        job = Job(prompts, chat, req.max_tokens or default_max, params, seed, req.stop or [], req.n,
                  rules=rules, echo=not chat and req.echo, events_streamed=bool(req.stream),
                  tools=tools.tools if tools else None,
                  cache_domain=cache_domain(request.scope.get("state", {}).get("api_key_index"), req.cache_salt))
        try:
            await asyncio.get_running_loop().run_in_executor(heavy if large else light, engine.prepare, job)
        except (APIError, SpeccError):
            raise
        except Exception as exc:  # a chat template that fails on these messages in a way it does not report
            log(f"specc serve: could not prepare a request: {type(exc).__name__}: {escape_control(exc)}")
            raise APIError(400, f"could not prepare the request: {type(exc).__name__}: {exc}") from None
        if state.stopped:
            raise _shutdown_error()
        engine.submit(job)
        state.jobs[id(job)] = job
        streaming, reply = False, None
        try:
            admitted = await next_item(job, request)
            if admitted is None:
                return Response(status_code=499)  # the client went away (nginx's code; nobody reads it)
            if isinstance(admitted, (APIError, Failed)):
                raise admitted if isinstance(admitted, APIError) else _api_error_of(admitted)
            prompt_tokens = sum(admitted.prompt_tokens[::req.n])
            reply = Reply(job, name, chat, start, prompt_tokens, metrics, model.tokenizer, model.grammars.decoded,
                          ToolReply(tools, len(job.indices)) if tools and tools.parses else None)
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                streaming = True
                return EventSourceResponse(stream(reply, include_usage), sep="\n", ping=15)
            while not reply.done:
                item = await next_item(job, request)
                if item is None:
                    return Response(status_code=499)
                if isinstance(item, Failed):
                    raise _api_error_of(item)
                if item.error is not None:
                    raise _request_failed(item.error)
                reply.add(item)
            return reply.whole()
        finally:
            if not streaming:  # a stream's generator does this when it ends
                state.jobs.pop(id(job), None)
                if reply is None or not reply.done:
                    engine.cancel(job)

    def request_rules(req, chat: bool):
        """The request's penalties, logit_bias, logprobs, response_format and tools as runtime rules, and its
        tools' plan (serving/tools.py); 400s name the field. Both grammars (a schema, the tools' structural tag)
        compile here, in this worker thread (runtime/grammar.py), never on the engine's."""
        tools = plan_tools(req, model.tokenizer) if chat else None
        if chat and req.top_logprobs is not None:
            model.grammars.decode_vocab()  # each token's own bytes, for logprobs' "bytes" (once, off the event loop)
        try:
            return model.rules(json_schema=req.json_schema(), presence_penalty=req.presence_penalty,
                               frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                               logit_bias=req.logit_bias, logprobs=req.top_logprobs,
                               prompt_logprobs=not chat and req.echo and req.logprobs is not None,
                               structural_tag=tools.tag if tools else None), tools
        except RequestError as exc:
            field = str(exc).split(" ")[0].rstrip(":")
            field = {"json_schema": "response_format", "structural_tag": "tools",
                     "logprobs": "logprobs" if not chat else "top_logprobs"}.get(field, field)
            raise APIError(400, str(exc), field) from None

    async def next_item(job: Job, request: Request):
        """The job's next message; None (and the job cancelled) once the client has gone away, which is
        looked at every DISCONNECT_POLL_S whether or not messages keep coming."""
        while True:
            now = time.monotonic()
            if now - job.polled >= DISCONNECT_POLL_S:
                job.polled = now
                if await request.is_disconnected():
                    engine.cancel(job)
                    return None
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    async def stream(reply: "Reply", include_usage: bool):
        try:
            if reply.chat:
                for i in range(len(reply.job.indices)):
                    yield json.dumps(reply.chunk([choice(i, "", None, True, True, first=True)]))
            while not reply.done:
                item = await reply.job.events.get()
                if isinstance(item, Failed) or item.error is not None:  # the engine failed, the server is
                    # shutting down, or this request's own rules broke
                    error = _api_error_of(item) if isinstance(item, Failed) else _request_failed(item.error)
                    metrics.errors.labels(status=str(error.status)).inc()
                    yield json.dumps(error.body())
                    yield "[DONE]"
                    return
                position, ev = reply.add(item)
                text, logprobs = reply.piece(position, ev)
                if reply.tools is not None:
                    for part in reply.tools.chunks(position, text, ev.finish_reason if ev.finished else None, logprobs):
                        yield json.dumps(reply.chunk([part]))
                elif text or ev.finished or logprobs:
                    yield json.dumps(reply.chunk([choice(position, text, ev.finish_reason, reply.chat, True,
                                                         logprobs=logprobs)]))
            if include_usage:
                yield json.dumps(reply.chunk([], reply.usage()))
            yield "[DONE]"
        finally:
            state.jobs.pop(id(reply.job), None)
            if not reply.done:
                engine.cancel(reply.job)

    async def drain(timeout: float) -> None:
        """Graceful shutdown: refuse new requests, let those in flight finish for up to `timeout` seconds,
        then end the rest with an error (a stream's last event is the error, then [DONE])."""
        state.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while state.requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not state.requests:
            return
        log(f"specc serve: {state.requests} request(s) still running after --shutdown-timeout {timeout:g} s; "
            "ending them with an error")
        state.stopped = True
        for job in list(state.jobs.values()):
            engine.cancel(job)
            job.events.put_nowait(ShuttingDown(f"the server is shutting down; this request was stopped after the "
                                               f"{timeout:g} s grace period (--shutdown-timeout)"))
        deadline = loop.time() + STOP_FLUSH_S
        while state.requests and loop.time() < deadline:
            await asyncio.sleep(0.05)

    app.state.drain = drain
    return app


def _merge(whole: dict | None, part: dict) -> dict:
    """Append one event's logprobs object to a choice's."""
    if whole is None:
        return part
    for key, value in part.items():
        whole[key] = whole[key] + value
    return whole


def check_seed(seed: int, sequences: int) -> None:
    """Sequence i of a request samples with seed + i: APIError 400 (quoting the client's seed) when the last
    one would pass 2**64 - 1."""
    top = (1 << 64) - 1
    if seed + sequences - 1 > top:
        raise APIError(400, f"seed: {seed} with {sequences} sequences (prompts x n): sequence i samples with seed + i, "
                            f"so the seed may be at most {top - sequences + 1} here", "seed")


def cache_domain(key_index: int | None, salt: str | None) -> bytes:
    """The prefix-cache isolation domain of a request: the API key it came with (when several are
    configured, each is its own) and its cache_salt; requests share cached prefixes only within one."""
    if key_index is None and salt is None:
        return b""
    return json.dumps([key_index, salt]).encode()


def _shutdown_error(message: str = "the server is shutting down; retry on another instance") -> APIError:
    return APIError(503, message, type="server_error", code="shutting_down", headers={"Retry-After": "5"})


def _api_error_of(failed: Failed) -> APIError:
    if isinstance(failed, ShuttingDown):
        return _shutdown_error(failed.message)
    return APIError(500, failed.message, type="server_error", code="batch_failed")


class Reply:
    """The choices of one request as its events arrive; latency metrics on the way."""

    def __init__(self, job: Job, model: str, chat: bool, start: float, prompt_tokens: int, metrics, tokenizer=None,
                 token_bytes: list[bytes] | None = None, tools: ToolReply | None = None):
        self.job, self.model, self.chat, self.start, self.metrics = job, model, chat, start, metrics
        self.tokenizer, self.token_bytes = tokenizer, token_bytes
        self.tools = tools  # the choices are read for tool calls
        self.logprobs: list[list] = [[] for _ in job.indices]  # (token, logprob, alternatives) per choice
        self.offsets = [0] * len(job.indices)  # text offset of the next token, per choice (completions' logprobs)
        self.echoed = [False] * len(job.indices)
        self.pieces: list[dict | None] = [None] * len(job.indices)  # the whole reply's logprobs per choice
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.prompt_tokens = prompt_tokens
        self.position = {index: i for i, index in enumerate(job.indices)}
        self.texts = [""] * len(job.indices)
        self.reasons: list[str | None] = [None] * len(job.indices)
        self.completion_tokens = 0
        self.cached = [0] * len(job.indices)  # prompt tokens the prefix cache supplied, per choice
        self.last_token_at: float | None = None
        self.open = len(job.indices)
        metrics.prompt_tokens.inc(prompt_tokens)

    @property
    def done(self) -> bool:
        return self.open == 0

    def add(self, ev: StreamEvent) -> tuple[int, StreamEvent]:
        now = time.perf_counter()
        i = self.position[ev.index]
        if ev.cached_tokens is not None:
            self.cached[i] = ev.cached_tokens
        if not self.job.events_streamed:
            text, logprobs = self.piece(i, ev)
            self.texts[i] += text
            if logprobs is not None:
                self.pieces[i] = _merge(self.pieces[i], logprobs)
        else:
            self.texts[i] += ev.text
        n = len(ev.token_ids)
        if n:
            if self.last_token_at is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                for _ in range(n):
                    self.metrics.itl.observe((now - self.last_token_at) / n)
            self.last_token_at = now
            self.completion_tokens += n
            self.metrics.observe_tokens(n)
        if ev.finished:
            self.reasons[i] = ev.finish_reason
            self.open -= 1
            if self.done:
                self.metrics.request_latency.observe(now - self.start)
                for reason in self.reasons:
                    self.metrics.success.labels(finished_reason=reason).inc()
        return i, ev

    def echo_text(self, i: int) -> str:
        """The prompt as text, decoded as generated text is (special tokens write nothing), so that logprobs'
        text_offset, which moves by the text each token adds, indexes it."""
        prompt = self.job.prompts[i // self.job.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=True)

    def piece(self, i: int, ev: StreamEvent) -> tuple[str, dict | None]:
        """A streamed event's text (the prompt first, under echo) and its logprobs object."""
        text, entries = ev.text, list(ev.logprobs or [])
        if self.job.echo and not self.echoed[i]:
            self.echoed[i] = True
            text = self.echo_text(i) + text
            if ev.prompt_logprobs is not None:
                entries = list(ev.prompt_logprobs) + entries
        wanted = ev.logprobs is not None or ev.prompt_logprobs is not None
        if not wanted:
            return text, None
        obj, self.offsets[i] = logprobs_object(entries, self.tokenizer, self.chat, self.offsets[i], self.token_bytes)
        return text, obj

    def usage(self) -> dict:
        """Tokens as OpenAI counts them: each prompt once (not once per n), its cached part as its first choice's."""
        return usage(self.prompt_tokens, self.completion_tokens, sum(self.cached[::self.job.n]))

    def chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        return completion_object(self.id, self.model, choices, use, chunk=True, chat=self.chat)

    def whole(self) -> dict:
        choices = [choice(i, t, r, self.chat, False, logprobs=lp)
                   for i, (t, r, lp) in enumerate(zip(self.texts, self.reasons, self.pieces))]
        if self.tools is not None:
            choices = [self.tools.whole(c, t) for c, t in zip(choices, self.texts)]
        return completion_object(self.id, self.model, choices, self.usage(),
                                 chunk=False, chat=self.chat)
