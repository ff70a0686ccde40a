"""The FastAPI application of `specc serve`: OpenAI's completions and chat completions, models,
health and Prometheus metrics, over one AsyncEngine.

guard.py stands in front of the routes (API keys, the drain), service.py answers them, body.py reads
request bodies, reply.py assembles replies, failures.py turns errors into OpenAI error objects.

What one request may cost the others is bounded: bodies above --max-body-mb are refused from
their Content-Length (413) or as soon as they grow past it; JSON above body.HEAVY_BYTES is parsed,
and every prompt tokenised, in thread pools (large inputs in a pool of their own, so a huge
prompt never makes a normal one wait for a worker); prompt text longer than the context could
hold is refused before it is tokenised; stop strings are capped in count and length (schemas.py).
"""
from __future__ import annotations

from fastapi import FastAPI, Request

from ..errors import SpeccError
from ..runtime.model import SpecModel
from .engine import AsyncEngine
from .failures import add_error_handlers
from .guard import Guard
from .service import Service

DEFAULT_MAX_BODY_BYTES = 8 << 20


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
    service = Service(model, engine, name=name, max_body_bytes=max_body_bytes, log=log)
    app = FastAPI(title="specc serve", lifespan=service.lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.serving, app.state.drain = engine, service.state, service.drain
    app.add_middleware(Guard, api_keys=api_keys, state=service.state, fail=service.fail)
    add_error_handlers(app, service.fail, log)
    add_routes(app, service)
    return app


def add_routes(app: FastAPI, service: Service) -> None:
    """One endpoint per route, each handing the request to `service`. The endpoints have no docstrings of
    their own: FastAPI would publish them in the OpenAPI schema."""

    @app.get("/health")
    async def health():
        return service.health()

    @app.get("/metrics")
    async def prometheus():
        return service.prometheus()

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await service.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await service.chat_completions(request)
