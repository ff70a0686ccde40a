"""What the routes of one `specc serve` app share, and what each answers: health, metrics, models, and a
completions or chat completions request from its body to its reply (whole, or streamed as server-sent
events).

A request is checked, its rules (a schema, the tools' grammar) compiled and its prompts tokenised in a
thread pool (large inputs in a pool of their own, so a huge prompt never makes a normal one wait for a
worker), then queued on the engine; its handler waits for the engine's events, and looks every
DISCONNECT_POLL_S whether the client is still there.
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

from ..errors import RequestError, SpeccError, escape_control
from ..runtime.model import SpecModel
from . import process
from .body import parse_body
from .engine import AsyncEngine, Failed, Job
from .failures import api_error_of, shutdown_error
from .guard import ServingState, drain
from .reply import Reply
from .row_failures import api_param, request_failed
from .schemas import APIError, ChatCompletionRequest, CompletionRequest, choice
from .tools import ToolPlan, ToolReply, plan as plan_tools

DISCONNECT_POLL_S = 0.5
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left


class Service:
    """One app's model, engine, drain state and preparation pools, with one method per route."""

    def __init__(self, model: SpecModel, engine: AsyncEngine, *, name: str, max_body_bytes: int, log=print):
        self.model, self.engine, self.metrics, self.name, self.log = model, engine, engine.metrics, name, log
        self.max_body_bytes = max_body_bytes
        self.state = ServingState()
        self.light = ThreadPoolExecutor(2, thread_name_prefix="specc-prepare")
        self.heavy = ThreadPoolExecutor(1, thread_name_prefix="specc-prepare-large")

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        """The engine thread (and the grammar worker) run while the app does."""
        worker = process.starting(self.model, self.log)
        self.engine.start()
        yield
        self.engine.close()
        process.stopped(self.model, worker)
        for pool in (self.light, self.heavy):
            pool.shutdown(wait=False, cancel_futures=True)

    def fail(self, status: int, body: dict, headers: dict | None = None) -> JSONResponse:
        """An error response, counted in the metrics."""
        self.metrics.errors.labels(status=str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)

    async def drain(self, timeout: float) -> None:
        """The graceful shutdown (guard.drain) of this app's requests."""
        await drain(self.state, self.engine, timeout, self.log)

    # -- the routes ------------------------------------------------------------------------------
    def health(self):
        """200 while the engine runs and the server takes requests, else 503 saying why."""
        if not self.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if self.state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    def prometheus(self) -> Response:
        """The metrics in Prometheus' text format."""
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def models(self) -> dict:
        """The one model served, as OpenAI lists models."""
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "specc", "max_model_len": self.model.max_context}]}

    async def completions(self, request: Request):
        """A text completion (OpenAI's /v1/completions)."""
        req, large = await parse_body(request, CompletionRequest, self.max_body_bytes, self.heavy)
        return await self.generate(request, req, large, chat=False)

    async def chat_completions(self, request: Request):
        """A chat completion (OpenAI's /v1/chat/completions)."""
        req, large = await parse_body(request, ChatCompletionRequest, self.max_body_bytes, self.heavy)
        return await self.generate(request, req, large, chat=True)

    # -- a completion request ---------------------------------------------------------------------
    async def generate(self, request: Request, req, large: bool, chat: bool):
        """Queue the request's job, then answer with the whole reply or a stream of its chunks; the job is
        cancelled wherever the answer ends before it does."""
        start = time.perf_counter()
        job, tools = await self.prepared_job(request, req, large, chat)
        if self.state.stopped:
            raise shutdown_error()
        self.engine.submit(job)
        self.state.jobs[id(job)] = job
        streaming, reply = False, None
        try:
            admitted = await self.next_item(job, request)
            if admitted is None:
                return Response(status_code=499)  # the client went away (nginx's code; nobody reads it)
            if isinstance(admitted, (APIError, Failed)):
                raise admitted if isinstance(admitted, APIError) else api_error_of(admitted)
            prompt_tokens = sum(admitted.prompt_tokens[::req.n])
            reply = Reply(job, self.name, chat, start, prompt_tokens, self.metrics, self.model.tokenizer,
                          self.model.grammars.decoded, ToolReply(tools, len(job.indices)) if tools and tools.parses else None)
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                streaming = True
                return EventSourceResponse(self.stream(reply, include_usage), sep="\n", ping=15)
            return await self.whole(reply, request)
        finally:
            if not streaming:  # a stream's generator does this when it ends
                self.state.jobs.pop(id(job), None)
                if reply is None or not reply.done:
                    self.engine.cancel(job)

    async def prepared_job(self, request: Request, req, large: bool, chat: bool) -> tuple[Job, ToolPlan | None]:
        """The request checked (4xx for what no engine state could serve) and its job built, with its rules
        compiled and its prompts tokenised in a pool; and its tools' plan."""
        if req.model is not None and req.model != self.name:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves {self.name!r}", "model",
                           type="not_found_error", code="model_not_found")
        try:
            params = self.model.sampling_params(req.temperature, 0 if req.top_k == -1 else req.top_k, req.top_p)
        except RequestError as exc:
            raise APIError(400, str(exc), api_param(exc)) from None
        # compiling a schema is the grammar library's work: off the event loop, like tokenising
        pool = self.heavy if large else self.light
        rules, tools = await asyncio.get_running_loop().run_in_executor(pool, self.request_rules, req, chat)
        prompts = [req.conversation()] if chat else req.prompts()
        self.engine.check_room(len(prompts) * req.n)  # before any tokenising: a request that cannot be queued costs nothing
        if not chat:
            for p, prompt in enumerate(prompts):
                self.engine.check_length(prompt, chat, p)
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        check_seed(seed, len(prompts) * req.n)
        job = Job(prompts, chat, req.max_tokens or (None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS), params, seed,
                  req.stop or [], req.n, rules=rules, echo=not chat and req.echo, events_streamed=bool(req.stream),
                  tools=tools.tools if tools else None,
                  cache_domain=cache_domain(request.scope.get("state", {}).get("api_key_index"), req.cache_salt))
        try:
            await asyncio.get_running_loop().run_in_executor(pool, self.engine.prepare, job)
        except (APIError, SpeccError):
            raise
        except Exception as exc:  # a chat template that fails on these messages in a way it does not report
            self.log(f"specc serve: could not prepare a request: {type(exc).__name__}: {escape_control(exc)}")
            raise APIError(400, f"could not prepare the request: {type(exc).__name__}: {exc}") from None
        return job, tools

    def request_rules(self, req, chat: bool):
        """The request's penalties, logit_bias, logprobs, response_format and tools as runtime rules, and its
        tools' plan (serving/tools.py); 400s name the field. Both grammars (a schema, the tools' structural tag)
        compile here, in this worker thread (runtime/grammar.py), never on the engine's."""
        tools = plan_tools(req, self.model.tokenizer) if chat else None
        if chat and req.top_logprobs is not None:
            self.model.grammars.decode_vocab()  # each token's own bytes, for logprobs' "bytes" (once, off the event loop)
        try:
            return self.model.rules(json_schema=req.json_schema(), presence_penalty=req.presence_penalty,
                                    frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                                    logit_bias=req.logit_bias, logprobs=req.top_logprobs,
                                    prompt_logprobs=not chat and req.echo and req.logprobs is not None,
                                    structural_tag=tools.tag if tools else None), tools
        except RequestError as exc:
            raise APIError(400, str(exc), api_param(exc, chat)) from None

    async def next_item(self, job: Job, request: Request):
        """The job's next message; None (and the job cancelled) once the client has gone away, which is
        looked at every DISCONNECT_POLL_S whether or not messages keep coming."""
        while True:
            now = time.monotonic()
            if now - job.polled >= DISCONNECT_POLL_S:
                job.polled = now
                if await request.is_disconnected():
                    self.engine.cancel(job)
                    return None
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    async def whole(self, reply: Reply, request: Request):
        """The reply once every choice has finished (499 if the client left first)."""
        while not reply.done:
            item = await self.next_item(reply.job, request)
            if item is None:
                return Response(status_code=499)
            if isinstance(item, Failed):
                raise api_error_of(item)
            if item.error is not None:
                raise request_failed(item.error)
            reply.add(item)
        return reply.whole()

    async def stream(self, reply: Reply, include_usage: bool):
        """The reply's chunks as server-sent events, then [DONE]; a failure ends the stream with its error."""
        try:
            if reply.chat:
                for i in range(len(reply.job.indices)):
                    yield json.dumps(reply.chunk([choice(i, "", None, True, True, first=True)]))
            while not reply.done:
                item = await reply.job.events.get()
                if isinstance(item, Failed) or item.error is not None:  # the engine failed, the server is
                    # shutting down, or this request's own rules broke
                    error = api_error_of(item) if isinstance(item, Failed) else request_failed(item.error)
                    self.metrics.errors.labels(status=str(error.status)).inc()
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
            self.state.jobs.pop(id(reply.job), None)
            if not reply.done:
                self.engine.cancel(reply.job)


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
