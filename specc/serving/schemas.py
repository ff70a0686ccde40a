"""OpenAI request bodies (validated, every error naming its field) and the response objects.

Requests are parsed from the raw JSON in pydantic's strict mode, so a string where a number
belongs is an error, not a guess. Fields of the OpenAI API that specc does not implement are
refused when set to anything but their neutral value (logprobs, penalties, logit_bias, echo,
best_of, suffix, tools); other unknown fields are ignored, as OpenAI-compatible servers do.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class APIError(Exception):
    """An error answered as OpenAI's {"error": {...}} JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="extension (as in vLLM): keep the k most likely tokens; 0 or -1: off")
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI fields specc does not implement: accepted only at their neutral values
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def unsupported(self) -> list[str]:
        """Fields set to something specc cannot do."""
        bad = [name for name in ("presence_penalty", "frequency_penalty") if getattr(self, name) != 0]
        bad += [name for name in ("logprobs", "top_logprobs", "logit_bias") if getattr(self, name) not in (None, False, {}, 0)]
        return bad


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += ["echo"] if self.echo else []
        bad += ["best_of"] if self.best_of not in (None, 1) else []
        bad += ["suffix"] if self.suffix else []
        return bad

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: Any = None
    response_format: Any = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += ["tools"] if self.tools else []
        fmt = self.response_format
        bad += ["response_format"] if fmt and not (isinstance(fmt, dict) and fmt.get("type") == "text") else []
        return bad

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def parse_request(cls: type[_Sampling], raw: bytes) -> _Sampling:
    """The validated request, or APIError(400) naming the first bad field."""
    try:
        req = cls.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param(err["loc"]) or None
        if err["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {err['msg']}") from None
        raise APIError(400, f"{param or 'body'}: {err['msg']}" + _got(err), param) from None
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"{bad[0]}: not supported by specc serve; leave it unset", bad[0])
    if getattr(req, "max_completion_tokens", None) is not None and req.max_tokens is None:
        req.max_tokens = req.max_completion_tokens
    return req


def _param(loc: tuple) -> str:
    """messages.0.content style path of a pydantic error, without the union-branch names."""
    out = []
    for part in loc:
        if isinstance(part, int):
            out.append(str(part))
        elif part in ("str", "list[str]", "list[int]", "list[list[int]]", "list[TextPart]", "none") or "[" in part:
            break
        else:
            out.append(part)
    return ".".join(out)


def _got(err: dict) -> str:
    value = err.get("input")
    if err["type"] == "missing" or isinstance(value, (dict, list)) and len(str(value)) > 80:
        return ""
    return f" (got {value!r})"


# -- responses -------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_object(rid: str, model: str, choices: list[dict], use: dict | None, chunk: bool, chat: bool) -> dict:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if use is not None or not chunk:
        out["usage"] = use
    return out


def choice(index: int, text: str, finish_reason: str | None, chat: bool, chunk: bool, first: bool = False) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if not chunk:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}
    delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
