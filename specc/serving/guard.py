"""What stands in front of the routes of `specc serve`: the API keys and the graceful shutdown (drain)."""
from __future__ import annotations

import asyncio
import secrets

from .engine import AsyncEngine, Job, ShuttingDown
from .schemas import APIError

OPEN_PATHS = ("/health", "/metrics")  # answered without the API key and while draining (load balancers poll them)
STOP_FLUSH_S = 5.0  # after the grace period, how long ended requests get to send their last chunk


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


async def drain(state: ServingState, engine: AsyncEngine, timeout: float, log=print) -> None:
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
