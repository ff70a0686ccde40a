"""A streaming gRPC client for the orchestrator model (needs `tritonclient[grpc]`).

    from specc.triton.client import stream_many
    results = stream_many("127.0.0.1:8001", "specc", [{"text_input": "def fib(n):", "max_tokens": 32}])

A request is a dict keyed by the model's input names (interface.INPUTS), as in Triton's
`generate` endpoint. Each request gets its own gRPC stream, so an error response is known to
belong to it; requests sent together are in flight together and the server batches them.
"""
from __future__ import annotations

import json
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .interface import INPUTS

_CLIENT_TYPES = {  # model_config TYPE_* → (tritonclient datatype, numpy dtype)
    "TYPE_STRING": ("BYTES", np.object_), "TYPE_INT32": ("INT32", np.int32), "TYPE_UINT64": ("UINT64", np.uint64),
    "TYPE_FP32": ("FP32", np.float32), "TYPE_BOOL": ("BOOL", np.bool_),
}


@dataclass
class Result:
    """One request's streamed responses, joined."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    responses: int = 0
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    speculation_stats: dict | None = None
    error: str | None = None  # the server's error message, if the request failed


def build_inputs(request: dict) -> list:
    """tritonclient InferInputs for a request dict {input name: value or list of values}."""
    import tritonclient.grpc as grpcclient

    specs = {s.name: s for s in INPUTS}
    unknown = sorted(set(request) - set(specs))
    if unknown:
        raise ValueError(f"unknown inputs {unknown}; the model takes {sorted(specs)}")
    inputs = []
    for name, value in request.items():
        datatype, dtype = _CLIENT_TYPES[specs[name].triton_type]
        values = value if isinstance(value, (list, tuple)) else [value]
        if dtype is np.object_:
            values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
        array = np.array(values, dtype=dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def stream_one(url: str, model: str, request: dict, timeout: float = 300.0,
               on_text: Callable[[str], None] | None = None) -> Result:
    """Send one request on its own stream and collect its responses until the final one."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    out = Result()
    try:
        client.async_stream_infer(model, build_inputs(request), enable_empty_final_response=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                result, error = responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no final response from {model!r} within {timeout:.0f} s") from None
            if error is not None:
                out.error = error.message()
                return out
            if _add(out, result) and on_text:
                on_text(out.text)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


def stream_many(url: str, model: str, requests: list[dict], timeout: float = 300.0) -> list[Result]:
    """Send all requests at once (one stream each) and return their results in order."""
    with ThreadPoolExecutor(max_workers=max(1, len(requests))) as pool:
        futures = [pool.submit(stream_one, url, model, r, timeout) for r in requests]
        return [f.result() for f in futures]


def _add(out: Result, result) -> bool:
    """Merge one response into out; returns whether it carried data."""
    text = result.as_numpy("text_output")
    if text is None:  # the empty final response
        return False
    out.responses += 1
    out.text += b"".join(text.reshape(-1)).decode("utf-8")
    ids = result.as_numpy("output_ids")
    if ids is not None:
        out.output_ids += ids.tolist()
    reason = result.as_numpy("finish_reason")
    if reason is not None:
        out.finish_reason = reason.reshape(-1)[0].decode()
        out.num_input_tokens = int(result.as_numpy("num_input_tokens")[0])
        out.num_output_tokens = int(result.as_numpy("num_output_tokens")[0])
        out.speculation_stats = json.loads(result.as_numpy("speculation_stats")[0])
    return True
