"""`specc serve`: an OpenAI-compatible HTTP server over one bundle (FastAPI, uvicorn, Prometheus).

app.py (routes), schemas.py (request validation, response objects), engine.py (the Scheduler's
worker thread and its fan-out to asyncio), metrics.py. Needs the `serve` extra:
`pip install 'specc[serve]'`. docs/serving.md is the user's guide.
"""
from __future__ import annotations

import logging
import socket
from pathlib import Path

from ..errors import SpeccError


def serve(bundle: str | Path, *, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
          api_key: str | None = None, k: int | str | None = "auto", speculative: bool = True,
          max_batch: int | None = None, max_queue: int = 256, verify: bool = True,
          expect_id: str | None = None, trust_code: bool = False, prefix_cache_mb: int | None = None,
          prefill_chunk: int | None = None) -> None:
    """Load a bundle and serve it until interrupted. prefix_cache_mb: the prefix cache's budget (None: the
    runtime's default, 0: off); prefill_chunk: prompt tokens per prefill pass (None: the runtime's default)."""
    try:
        import uvicorn

        from .app import check_server_settings, create_app
    except ImportError as exc:
        raise SpeccError(f"specc serve needs the serve extra ({exc.name} is missing): pip install 'specc[serve]'") from None
    from ..runtime.model import load

    if max_queue < 1:
        raise SpeccError(f"--max-queue must be >= 1, got {max_queue}")
    name = Path(bundle).resolve().name if name is None else name
    check_server_settings(name, api_key)
    sock = listen_socket(host, port)  # before the bundle loads: a busy port or a bad host fails at once
    try:
        model = load(bundle, verify=verify, expect_id=expect_id, trust_code=trust_code)
        if prefix_cache_mb is not None:
            model.set_prefix_cache_mb(prefix_cache_mb)
        if prefill_chunk is not None:
            model.prefill_chunk = prefill_chunk
        app = create_app(model, name=name, k=k, speculative=speculative,
                         max_batch=max_batch, max_queue=max_queue, api_key=api_key)
        config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
        address = f"[{host}]" if ":" in host else host  # uvicorn logs its address only for sockets it binds
        logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                address, sock.getsockname()[1])
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


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
