"""OpenAI request bodies (validated, every error naming its field) and the response objects.

Requests are parsed from the raw JSON in pydantic's strict mode, so a string where a number
belongs is an error, not a guess. Fields that change what is generated and that specc does not
implement (OpenAI's best_of, suffix and functions, and tools on completions; other servers' extensions such as
chat_template, min_p or guided_json: `REFUSED`) are refused when set to anything but their neutral
value, so no answer pretends to honour them; other unknown fields (user, metadata, store, ...) are
ignored, as OpenAI-compatible servers do. Penalties, logit_bias, logprobs, echo and response_format
(json_object, json_schema) are implemented (runtime/rules.py, runtime/grammar.py), and tools on chat
(tools.py, tool_schemas.py).
"""
from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal, Union

from ..runtime.rules import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .tool_schemas import MAX_TOOLS, Tool, ToolCall, check_tool_choice


class APIError(Exception):
    """An error answered as OpenAI's {"error": {...}} JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: matching is rechecked after every round, for every row
_OFF = (None, False, 0, "", [], {})  # JSON's ways of leaving a field unset or off
# fields refused unless set to one of their neutral values (both endpoints; `echo` on chat)
REFUSED: dict[str, tuple] = {
    "tools": _OFF, "functions": _OFF, "tool_choice": (*_OFF, "none", "auto"), "function_call": (*_OFF, "none"),
    "prediction": _OFF, "audio": _OFF,
    "modalities": (*_OFF, ["text"]), "web_search_options": _OFF,
    # other servers' extensions (vLLM, llama.cpp, TGI) that a client written for them may send
    "chat_template": _OFF, "chat_template_kwargs": _OFF, "add_generation_prompt": (None, True),
    "continue_final_message": _OFF, "guided_json": _OFF, "guided_regex": _OFF, "guided_choice": _OFF,
    "guided_grammar": _OFF, "structured_outputs": _OFF, "grammar": _OFF, "json_schema": _OFF,
    "min_p": _OFF, "typical_p": (None, 1, 1.0),
    "repeat_penalty": (None, 1, 1.0), "min_tokens": _OFF, "ignore_eos": _OFF, "stop_token_ids": _OFF,
    "bad_words": _OFF, "prompt_logprobs": _OFF, "n_probs": _OFF, "include_stop_str_in_output": _OFF,
    "skip_special_tokens": (None, True), "mirostat": _OFF, "tfs_z": (None, 1, 1.0), "dry_multiplier": _OFF,
    "xtc_probability": _OFF, "best_of": (None, 1), "suffix": _OFF,
}

HINTS = {"chat_template": " (the server applies the model's template, or the one given with specc serve --chat-template)",
         "n": "", "functions": " (give tools instead)", "function_call": " (give tools and tool_choice instead)"}


def _neutral(value, allowed: tuple) -> bool:
    """value is one of `allowed`; booleans only equal booleans (in Python 1 == True, and 1 is not off)."""
    def same(a) -> bool:
        if isinstance(a, bool) or isinstance(value, bool):
            return type(a) is type(value) and a == value
        numbers = isinstance(a, (int, float)) and isinstance(value, (int, float))
        return (type(a) is type(value) or numbers) and a == value
    return any(same(a) for a in allowed)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object: {"name": ..., "schema": {...}}')
        return self


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # extra fields are checked against REFUSED

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
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                      description="extension (as in vLLM): 1 = off")
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100], checked by the model
    response_format: ResponseFormat | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256, description="extension (as in vLLM): "
                                   "prompts share the prefix cache only with requests of the same salt")

    def json_schema(self):
        """What response_format asks the grammar for: None, "json_object" or the schema (a dict)."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        return "json_object" if fmt.type == "json_object" else fmt.json_schema.schema_

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(stops)} stop strings; allowed at most {MAX_STOP_STRINGS}")
        long = next((i for i, s in enumerate(stops) if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise ValueError(f"stop string {long} is {len(stops[long])} characters; allowed at most {MAX_STOP_CHARS}")
        return stops

    def unsupported(self) -> list[str]:
        """Fields set to something specc cannot do."""
        extra = self.model_extra or {}
        return [name for name, value in extra.items() if name in REFUSED and not _neutral(value, REFUSED[name])]

    def conflicts(self) -> list[tuple[str, str]]:
        """(field, message) for fields whose values are valid alone but not together."""
        return []


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's completions bound; 0: the sampled token's only

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("an empty list holds no prompt; give a string, a list of strings, a list of token "
                             "ids or a list of those")
        return v

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> list[str]:
        return super().unsupported()

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
    tool_calls: list[ToolCall] | None = None  # an assistant's calls; the tool messages after it answer them
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None
    function_call: Any = None  # OpenAI's deprecated form: refused, tools replace it

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates take it (calls' arguments as mappings)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs_: int | None = Field(None, ge=0, le=20, alias="top_logprobs")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None  # "none", "auto", "required" or a named function (tool_schemas.check_tool_choice)
    parallel_tool_calls: bool | None = None
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        return check_tool_choice(v)

    @property
    def top_logprobs(self) -> int | None:
        """Alternatives per token when logprobs is on (0 without top_logprobs); None: no logprobs."""
        return (self.top_logprobs_ or 0) if self.logprobs else None

    def conflicts(self) -> list[tuple[str, str]]:
        if self.top_logprobs_ is not None and not self.logprobs:
            return [("top_logprobs", "top_logprobs needs logprobs: true")]
        return []

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += [f"messages.{i}.function_call" for i, m in enumerate(self.messages) if not _neutral(m.function_call, _OFF)]
        echo = (self.model_extra or {}).get("echo")
        return bad + ([] if _neutral(echo, _OFF) else ["echo"])

    def conversation(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


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
        hint = HINTS.get(bad[0].rsplit(".", 1)[-1], "")
        raise APIError(400, f"{bad[0]}: not supported by specc serve; leave it unset{hint}", bad[0])
    for param, message in req.conflicts():
        raise APIError(400, f"{param}: {message}", param)
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
    if err["type"] == "missing":
        return ""
    text = repr(value)
    if isinstance(value, (dict, list)) and len(text) > 80:
        return ""
    return f" (got {text[:80]}...)" if len(text) > 80 else f" (got {text})"


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


def choice(index: int, text: str, finish_reason: str | None, chat: bool, chunk: bool, first: bool = False,
           logprobs: dict | None = None) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if not chunk:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


LOGPROB_FLOOR = -9999.0  # a token the rules forbid has probability 0 (logprob -inf); OpenAI reports -9999.0


def logprobs_object(entries: list[tuple], tokenizer, chat: bool, offset: int = 0,
                    token_bytes: list[bytes] | None = None) -> tuple[dict, int]:
    """OpenAI's logprobs object of (token, logprob, [(alternative, logprob)]) entries (a logprob of None: the
    prompt's first token) and the text offset after them. Chat: {"content": [...]} with each token's own bytes
    (token_bytes, else its text's); completions: tokens, token_logprobs, top_logprobs, text_offset (the offset
    moves by the text the token adds to the output, special tokens adding none; the sampled token is always
    among its top_logprobs, as in vLLM). Every number is finite: -inf is LOGPROB_FLOOR, and alternatives the
    rules forbid (logprob -inf) are left out."""
    def text(t):
        return tokenizer.decode([t])

    entries = [(t, _finite(lp), [(a, alp) for a, alp in alts if math.isfinite(alp)]) for t, lp, alts in entries]
    if chat:
        def item(t, lp):
            s = text(t)
            raw = token_bytes[t] if token_bytes is not None and 0 <= t < len(token_bytes) else s.encode("utf-8")
            return {"token": s, "logprob": lp, "bytes": list(raw)}
        return {"content": [{**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in alts]}
                            for t, lp, alts in entries]}, offset
    tokens, offsets = [], []
    for t, _, _ in entries:
        tokens.append(text(t))
        offsets.append(offset)
        offset += len(tokenizer.decode([t], skip_special_tokens=True))
    tops = [None if lp is None else {**{text(a): alp for a, alp in alts}, text(t): lp} for t, lp, alts in entries]
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}, offset


def _finite(logprob: float | None) -> float | None:
    if logprob is None or math.isfinite(logprob):
        return logprob
    return LOGPROB_FLOOR if logprob < 0 else 0.0
