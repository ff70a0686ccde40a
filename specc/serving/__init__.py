"""`specc serve`: an OpenAI-compatible HTTP server over one bundle (FastAPI, uvicorn, Prometheus).

app.py (routes), schemas.py (request validation, response objects), engine.py (the Scheduler's
worker thread and its fan-out to asyncio), metrics.py. Needs the `serve` extra:
`pip install 'specc[serve]'`. docs/serving.md is the user's guide.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import SpeccError


def serve(bundle: str | Path, *, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
          api_key: str | None = None, k: int | str | None = "auto", speculative: bool = True,
          max_batch: int | None = None, max_queue: int = 256, verify: bool = True,
          expect_id: str | None = None, trust_code: bool = False) -> None:
    """Load a bundle and serve it until interrupted."""
    try:
        import uvicorn

        from .app import create_app
    except ImportError as exc:
        raise SpeccError(f"specc serve needs the serve extra ({exc.name} is missing): pip install 'specc[serve]'") from None
    from ..runtime.model import load

    if max_queue < 1:
        raise SpeccError(f"--max-queue must be >= 1, got {max_queue}")
    model = load(bundle, verify=verify, expect_id=expect_id, trust_code=trust_code)
    app = create_app(model, name=name or Path(bundle).resolve().name, k=k, speculative=speculative,
                     max_batch=max_batch, max_queue=max_queue, api_key=api_key)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
