"""The orchestrator model's tensors: what a client sends and what each streamed response holds.

Names follow the common Triton LLM conventions (`text_input`, `max_tokens`, `temperature`,
`top_p`, `top_k`, `text_output`, `finish_reason`, `num_input_tokens`, ...), so Triton's
`generate` / `generate_stream` HTTP endpoints and existing gRPC clients work unchanged.
All inputs but `text_input` are optional; scalars have shape [1].
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import RequestError


@dataclass(frozen=True)
class TensorSpec:
    name: str
    triton_type: str  # TYPE_* of model_config.proto
    dims: tuple[int, ...]
    doc: str
    optional: bool = True
    final_only: bool = False  # outputs: only on a request's last response


INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (1,), "the prompt (UTF-8)", optional=False),
    TensorSpec("max_tokens", "TYPE_INT32", (1,), "most new tokens (default: the model's `default_max_tokens` parameter)"),
    TensorSpec("temperature", "TYPE_FP32", (1,), "0 = greedy (default: the recipe's sampling.temperature)"),
    TensorSpec("top_p", "TYPE_FP32", (1,), "nucleus mass in (0, 1] (default: the recipe's)"),
    TensorSpec("top_k", "TYPE_INT32", (1,), "keep the k most likely tokens, 0 = all (default: the recipe's)"),
    TensorSpec("seed", "TYPE_UINT64", (1,), "seed of the request's own random stream (default 0)"),
    TensorSpec("stop", "TYPE_STRING", (-1,), "stop strings: the text ends before the first one generated"),
    TensorSpec("stream", "TYPE_BOOL", (1,), "true (default): a response per round; false: one response at the end"),
    TensorSpec("chat", "TYPE_BOOL", (1,), "apply the tokenizer's chat template to text_input (default false)"),
)

OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", (-1,), "text released by this response (a delta; concatenate them)"),
    TensorSpec("output_ids", "TYPE_INT64", (-1,), "token ids generated since the previous response"),
    TensorSpec("finish_reason", "TYPE_STRING", (1,), '"stop" (EOS or a stop string) or "length"', final_only=True),
    TensorSpec("num_input_tokens", "TYPE_INT32", (1,), "prompt tokens", final_only=True),
    TensorSpec("num_output_tokens", "TYPE_INT32", (1,), "generated tokens", final_only=True),
    TensorSpec("num_draft_tokens", "TYPE_INT32", (1,), "tokens the drafter proposed for this request", final_only=True),
    TensorSpec("num_accepted_tokens", "TYPE_INT32", (1,), "drafted tokens the target accepted", final_only=True),
    TensorSpec("speculation_stats", "TYPE_STRING", (1,),
               "JSON: rounds, drafted, accepted, acceptance_rate, accepted_per_round, tokens_per_target_pass, "
               "acceptance_by_position", final_only=True),
)


@dataclass(frozen=True)
class GenerationRequest:
    """One request's settings, parsed from its input tensors (None = the bundle's default)."""

    prompt: str
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    stop: tuple[str, ...] = ()
    stream: bool = True
    chat: bool = False


def parse_request(get: Callable[[str], np.ndarray | None], default_max_tokens: int) -> GenerationRequest:
    """Read and check a request's inputs; `get(name)` returns an input as numpy, or None if absent.

    Raises RequestError naming the input and what is allowed.
    """
    text = _scalar(get, "text_input")
    if text is None:
        raise RequestError("text_input is required: the prompt as one UTF-8 string")
    prompt = _text(text, "text_input")
    if not prompt:
        raise RequestError("text_input is empty; send a prompt of at least one character")
    max_tokens = _scalar(get, "max_tokens")
    max_tokens = default_max_tokens if max_tokens is None else int(max_tokens)
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
    stop = get("stop")
    stop = () if stop is None else tuple(_text(s, "stop") for s in np.asarray(stop).reshape(-1))
    if any(not s for s in stop):
        raise RequestError("stop strings must not be empty")
    return GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_optional(_scalar(get, "temperature"), _decimal),
        top_p=_optional(_scalar(get, "top_p"), _decimal),
        top_k=_optional(_scalar(get, "top_k"), int),
        seed=_optional(_scalar(get, "seed"), int) or 0,
        stop=stop,
        stream=bool(_optional(_scalar(get, "stream"), bool, True)),
        chat=bool(_optional(_scalar(get, "chat"), bool, False)),
    )


def _scalar(get, name: str):
    value = get(name)
    if value is None:
        return None
    value = np.asarray(value)
    if value.size != 1:
        raise RequestError(f"{name} must hold exactly one value (shape [1]), got shape {list(value.shape)}")
    return value.reshape(-1)[0]


def _optional(value, kind, default=None):
    return default if value is None else kind(value)


def _decimal(value) -> float:
    """An FP32 input as the shortest decimal that is the same float32 (0.9, not 0.8999999762)."""
    return float(str(np.float32(value)))


def _text(value, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name} is not valid UTF-8") from None
    return str(value)


def response_tensors(text: str, token_ids: list[int], final: dict | None = None) -> dict[str, np.ndarray]:
    """The outputs of one response; `final` (finish_reason, num_input_tokens, stats) on the last."""
    out = {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(token_ids, dtype=np.int64),
    }
    if final is not None:
        stats = final["stats"]
        out.update({
            "finish_reason": np.array([final["finish_reason"].encode()], dtype=np.object_),
            "num_input_tokens": np.array([final["num_input_tokens"]], dtype=np.int32),
            "num_output_tokens": np.array([final["num_output_tokens"]], dtype=np.int32),
            "num_draft_tokens": np.array([stats["drafted"]], dtype=np.int32),
            "num_accepted_tokens": np.array([stats["accepted"]], dtype=np.int32),
            "speculation_stats": np.array([json.dumps(stats).encode()], dtype=np.object_),
        })
    return out


def markdown_table(specs: tuple[TensorSpec, ...]) -> str:
    """The specs as a Markdown table (docs/triton.md embeds the output of this)."""
    rows = ["| name | type | dims | |", "|---|---|---|---|"]
    for s in specs:
        note = s.doc + (" (last response only)" if s.final_only else "") + ("" if s.optional else " (required)")
        rows.append(f"| `{s.name}` | {s.triton_type.removeprefix('TYPE_')} | {list(s.dims)} | {note} |")
    return "\n".join(rows)
