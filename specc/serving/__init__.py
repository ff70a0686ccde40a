"""`specc serve`: an OpenAI-compatible HTTP server over one bundle (FastAPI, uvicorn, Prometheus).

app.py (the app and its routes), service.py (what the routes answer), guard.py (API keys, the drain),
schemas.py (request validation, response objects), engine.py (the Scheduler's worker thread and its
fan-out to asyncio), metrics.py. Needs the `serve` extra:
`pip install 'specc[serve]'`. docs/serving.md is the user's guide.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..errors import SpeccError


def serve(bundle: str | Path, *, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
          api_key: str | list[str] | None = None, k: int | str | None = "auto", speculative: bool = True,
          max_batch: int | None = None, max_queue: int = 256, verify: bool = True,
          expect_id: str | None = None, trust_code: bool = False, chat_template: str | Path | None = None,
          shutdown_timeout: float = 20.0, max_body_mb: float = 8.0, warm: list[str] | None = None,
          prefix_cache_mb: int | None = None, prefill_chunk: int | None = None) -> None:
    """Load a bundle and serve it until SIGTERM or Ctrl-C, then drain (`DrainingServer`); warm: earlier
    outputs for a suffix drafter's cache; api_key: one key or several (each its own prefix-cache domain);
    prefix_cache_mb: the prefix cache's budget (None: the runtime's default, 0: off); prefill_chunk: prompt
    tokens per prefill pass."""
    try:
        import uvicorn

        from .app import check_server_settings, create_app
    except ImportError as exc:
        raise SpeccError(f"specc serve needs the serve extra ({exc.name} is missing): pip install 'specc[serve]'") from None
    from ..runtime.model import load, read_chat_template

    if max_queue < 1:
        raise SpeccError(f"--max-queue must be >= 1, got {max_queue}")
    if not (isinstance(shutdown_timeout, (int, float)) and 0 <= shutdown_timeout <= 24 * 3600):
        raise SpeccError(f"--shutdown-timeout {shutdown_timeout!r}: allowed seconds in [0, 86400]")
    if not (isinstance(max_body_mb, (int, float)) and 0.001 <= max_body_mb <= 4096):
        raise SpeccError(f"--max-body-mb {max_body_mb!r}: allowed a size in MiB in [0.001, 4096]")
    name = Path(bundle).resolve().name if name is None else name
    check_server_settings(name, api_key)
    template = read_chat_template(chat_template) if chat_template is not None else None
    sock = listen_socket(host, port)  # before the bundle loads: a busy port or a bad host fails at once
    try:
        model = load(bundle, verify=verify, expect_id=expect_id, trust_code=trust_code)
        if warm:
            from ..runtime.model import warm_from as warm_model

            warm_model(model, warm, log=logging.getLogger("uvicorn.error").info)
        if prefix_cache_mb is not None:
            model.set_prefix_cache_mb(prefix_cache_mb)
        if prefill_chunk is not None:
            model.prefill_chunk = prefill_chunk
        if template is not None:
            model.set_chat_template(template, f"--chat-template {chat_template}")
        app = create_app(model, name=name, k=k, speculative=speculative, max_batch=max_batch, max_queue=max_queue,
                         api_key=api_key, max_body_bytes=int(max_body_mb * (1 << 20)))
        config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
        address = f"[{host}]" if ":" in host else host  # uvicorn logs its address only for sockets it binds
        logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                address, sock.getsockname()[1])
        draining_server(uvicorn, config, app.state.drain, shutdown_timeout).run(sockets=[sock])
    finally:
        sock.close()


def draining_server(uvicorn, config, drain: Callable[[float], Awaitable[None]], timeout: float):
    """A uvicorn Server whose first SIGTERM or SIGINT drains instead of stopping: no new connections, 503 to
    new requests on open ones, requests in flight get `timeout` seconds to finish, then the rest end with an
    error (`app.state.drain`); a second signal stops at once, as uvicorn does. Plain uvicorn would stop at
    once, and sse-starlette would cut every stream without a last event."""

    class DrainingServer(uvicorn.Server):
        drain_requested = False
        drain_task = None

        def handle_exit(self, sig, frame) -> None:
            if self.drain_requested:
                return super().handle_exit(sig, frame)
            self._captured_signals.append(sig)  # uvicorn raises it again once it has stopped
            self.drain_requested = True  # a signal handler cannot await: on_tick starts the drain

        async def on_tick(self, counter: int) -> bool:
            if self.drain_requested and self.drain_task is None:
                self.drain_task = asyncio.create_task(self._drain())
            return await super().on_tick(counter)

        async def _drain(self) -> None:
            logging.getLogger("uvicorn.error").info("Draining: no new requests; up to %g s for those in flight", timeout)
            for server in self.servers:
                server.close()  # stop accepting connections; open ones stay
            try:
                await drain(timeout)
            finally:
                self.should_exit = True

    return DrainingServer(config)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port as uvicorn binds it (IPv6 where the host has a colon; port 0: a free
    port), or one clear error naming the address."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise SpeccError(f"--port {port!r}: allowed an integer in 0..65535 (0: any free port)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:  # socket.gaierror (an unknown host) is one
        sock.close()
        raise SpeccError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; allowed a free port and an "
                         "address of this machine (--host 127.0.0.1 for this machine only, 0.0.0.0 for every "
                         "interface)") from None
    return sock
