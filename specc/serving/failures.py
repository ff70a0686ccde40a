"""How failures reach a client of `specc serve`: every exception a route raises as an OpenAI error object
(counted in the metrics by `fail`), and what the engine reports of a failed request as the APIError it is."""
from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import escape_control
from ..runtime.rules import fault_log
from .engine import Failed, ShuttingDown
from .schemas import APIError

Fail = Callable[..., JSONResponse]  # (status, body, headers=None): the error response, counted


def add_error_handlers(app: FastAPI, fail: Fail, log=print) -> None:
    """Answer APIError, Starlette's HTTP errors (404, 405, ...) and anything unexpected (500, logged) with an
    error object; a client that left mid-upload with 499."""

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
        # the client gets a reference to the logged traceback, not the exception's text, which may show internals
        reference, line = fault_log(f"specc serve: internal error on {escape_control(request.url.path)}", exc)
        log(line)
        message = f"internal error (reference {reference} in the server's log); the server goes on, retry the request"
        return fail(500, APIError(500, message, type="server_error", code="internal_error").body())


def shutdown_error(message: str = "the server is shutting down; retry on another instance") -> APIError:
    """503: the server stopped the request, or takes none now, as it shuts down."""
    return APIError(503, message, type="server_error", code="shutting_down", headers={"Retry-After": "5"})


def api_error_of(failed: Failed) -> APIError:
    """The engine ended the job: the server shuts down (503), or the batch it ran in failed (500)."""
    if isinstance(failed, ShuttingDown):
        return shutdown_error(failed.message)
    return APIError(500, failed.message, type="server_error", code="batch_failed")
