"""The FastAPI application of `specc serve`: OpenAI's completions and chat completions, models,
health and Prometheus metrics, over one AsyncEngine."""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import RequestError, SpeccError
from ..runtime.model import SpecModel
from ..runtime.scheduler import StreamEvent
from .engine import AsyncEngine, Failed, Job
from .schemas import (APIError, ChatCompletionRequest, CompletionRequest, choice, completion_object, new_id,
                      parse_request, usage)

DISCONNECT_POLL_S = 0.5
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left


def check_server_settings(name: str, api_key: str | None) -> None:
    """The served model name must be printable text and an API key a non-empty bearer token: an empty key
    (say, from an unset variable) would let through every client that sends an empty one."""
    if not isinstance(name, str) or not name or not name.isprintable():
        raise SpeccError(f"--name {name!r}: allowed a non-empty printable model name")
    if api_key is not None and not (api_key and all("!" <= c <= "~" for c in api_key)):
        raise SpeccError("--api-key (or SPECC_API_KEY): empty or not a bearer token; allowed visible ASCII "
                         "characters without spaces, or no key at all to serve without authorization")


def create_app(model: SpecModel, *, name: str = "specc", k: int | str | None = "auto", speculative: bool = True,
               max_batch: int | None = None, max_queue: int = 256, api_key: str | None = None, log=print) -> FastAPI:
    """An app serving `model`; the engine thread starts with the app (its lifespan) and stops with it."""
    check_server_settings(name, api_key)
    engine = AsyncEngine(model, k=k, speculative=speculative, max_batch=max_batch, max_queue=max_queue, log=log)
    metrics = engine.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.close()

    app = FastAPI(title="specc serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine

    def fail(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
        metrics.errors.labels(status=str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return fail(exc.status, exc.body(), exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return fail(exc.status_code, APIError(exc.status_code, str(exc.detail), type=kind).body())

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log(f"specc serve: internal error on {request.url.path}: {type(exc).__name__}: {exc}")
        return fail(500, APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body())

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key (send the header Authorization: Bearer KEY)",
                           type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "specc", "max_model_len": model.max_context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        return await generate(request, parse_request(CompletionRequest, await request.body()), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        return await generate(request, parse_request(ChatCompletionRequest, await request.body()), chat=True)

    async def generate(request: Request, req, chat: bool):
        start = time.perf_counter()
        if req.model is not None and req.model != name:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves {name!r}", "model",
                           type="not_found_error", code="model_not_found")
        try:
            params = model.sampling_params(req.temperature, 0 if req.top_k == -1 else req.top_k, req.top_p)
        except RequestError as exc:
            raise APIError(400, str(exc), str(exc).split(" ")[0]) from None
        prompts = [req.conversation()] if chat else req.prompts()
        default_max = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        job = engine.submit(Job(prompts, chat, req.max_tokens or default_max, params, seed, req.stop or [], req.n))
        try:
            admitted = await next_item(job, request)
        except BaseException:
            engine.cancel(job)
            raise
        if admitted is None:
            return Response(status_code=499)  # the client went away (nginx's code; nobody reads it)
        if isinstance(admitted, APIError):
            raise admitted
        prompt_tokens = sum(admitted.prompt_tokens[::req.n])
        reply = Reply(job, name, chat, start, prompt_tokens, metrics)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(stream(reply, include_usage), sep="\n", ping=15)
        try:
            while not reply.done:
                item = await next_item(job, request)
                if item is None:
                    return Response(status_code=499)
                if isinstance(item, Failed):
                    raise APIError(500, item.message, type="server_error")
                reply.add(item)
        finally:
            if not reply.done:
                engine.cancel(job)
        return reply.whole()

    async def next_item(job: Job, request: Request):
        """The job's next message; None (and the job cancelled) if the client went away while waiting."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(job)
                    return None

    async def stream(reply: "Reply", include_usage: bool):
        try:
            if reply.chat:
                for i in range(len(reply.job.indices)):
                    yield json.dumps(reply.chunk([choice(i, "", None, True, True, first=True)]))
            while not reply.done:
                item = await reply.job.events.get()
                if isinstance(item, Failed):
                    yield json.dumps(APIError(500, item.message, type="server_error").body())
                    return
                position, ev = reply.add(item)
                if ev.text or ev.finished:
                    yield json.dumps(reply.chunk([choice(position, ev.text, ev.finish_reason, reply.chat, True)]))
            if include_usage:
                yield json.dumps(reply.chunk([], reply.usage()))
            yield "[DONE]"
        finally:
            if not reply.done:
                engine.cancel(reply.job)

    return app


class Reply:
    """The choices of one request as its events arrive; latency metrics on the way."""

    def __init__(self, job: Job, model: str, chat: bool, start: float, prompt_tokens: int, metrics):
        self.job, self.model, self.chat, self.start, self.metrics = job, model, chat, start, metrics
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

    def usage(self) -> dict:
        """Tokens as OpenAI counts them: each prompt once (not once per n), its cached part as its first choice's."""
        return usage(self.prompt_tokens, self.completion_tokens, sum(self.cached[::self.job.n]))

    def chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        return completion_object(self.id, self.model, choices, use, chunk=True, chat=self.chat)

    def whole(self) -> dict:
        choices = [choice(i, t, r, self.chat, False) for i, (t, r) in enumerate(zip(self.texts, self.reasons))]
        return completion_object(self.id, self.model, choices, self.usage(), chunk=False, chat=self.chat)
