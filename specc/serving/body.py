"""A request body of `specc serve`, read within its size cap and parsed into its request model; a large one
is parsed in a thread pool of its own, off the event loop."""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from fastapi import Request

from ..errors import escape_control
from .schemas import APIError, parse_request

HEAVY_BYTES = 64 << 10  # bodies above this are parsed and tokenised by the pool for large inputs


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The JSON body, refused (415) unless sent as JSON, and (413) once it is larger than the cap, from
    its declared length before any of it is read."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(415, "send the request body as JSON with the header Content-Type: application/json "
                            f"(got {escape_control(ctype[:80]) or 'none'})", code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    too_large = APIError(413, f"the request body is larger than this server's limit of {max_bytes} bytes "
                              "(--max-body-mb)", code="request_too_large", headers={"Connection": "close"})
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():  # ClientDisconnect if the client leaves mid-upload
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    return bytes(body)


async def parse_body(request: Request, cls, max_bytes: int, heavy: Executor) -> tuple:
    """(the request as `cls`, whether it is large: its later work goes to the `heavy` pool too)."""
    raw = await read_body(request, max_bytes)
    if len(raw) <= HEAVY_BYTES:
        return parse_request(cls, raw), False
    return await asyncio.get_running_loop().run_in_executor(heavy, parse_request, cls, raw), True
