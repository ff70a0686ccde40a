"""OpenAI tool calling for `specc serve`: the request fields (`tools`, `tool_choice`, `parallel_tool_calls`, and
assistant `tool_calls` / `role: tool` messages in the history), the plan a request's tools make (the family's
format, the template's tools argument, the grammar), and the reply's `message.tool_calls` and stream deltas.

Calls are constrained by a grammar (tool_formats.structural_tag), so `required` and a named tool always give
calls whose arguments validate against the tool's schema, and `auto` gives text or such calls. The grammar is
a rule like response_format's: speculation stays exact (runtime/rules.py).
"""
from __future__ import annotations

import json
import re
import threading
import uuid
from dataclasses import dataclass

from ..errors import RequestError
from ..runtime.grammar import check_schema, schema_ebnf
from .schemas import APIError
from .tool_formats import FORMATS, Arguments, CallParser, CallStart, Content, ToolFormat, detect, structural_tag
from .tool_schemas import CHOICES, Tool


# -- the plan of a request's tools ------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean here: the tools as the chat template takes them, the choice ("none",
    "auto", "required" or a tool's name), the family's format and the grammar (None: no constraint)."""

    tools: list[dict]
    choice: str
    parallel: bool
    format: ToolFormat | None
    tag: str | None

    @property
    def parses(self) -> bool:
        return self.format is not None and self.choice != "none"


def plan(req, tokenizer) -> ToolPlan | None:
    """The plan of a chat request's tools (None: it has none); APIError 400 naming the field for tools this
    model cannot call."""
    choice = _choice_name(req.tool_choice)
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice: a tool choice needs tools; give the tools array", "tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(400, f"tools.{i}.function.name: {name!r} is given twice; tool names must be unique",
                           f"tools.{i}.function.name")
    choice = choice or "auto"
    if choice not in CHOICES and choice not in names:
        raise APIError(400, f"tool_choice: no tool is named {choice!r}; the tools are {', '.join(names)}",
                       "tool_choice")
    if choice != "none" and req.json_schema() is not None:
        raise APIError(400, "response_format: a JSON response and tool calls cannot be asked together; leave "
                            'response_format unset or set tool_choice "none"', "response_format")
    tools = [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in req.tools]
    template = _template(tokenizer)
    fmt = detect(template)
    if fmt is None and choice != "none":
        known = "; ".join(f"{f.name} ({f.marker}: {f.families})" for f in FORMATS)
        raise APIError(400, "tools: this model's chat template writes tool calls in no format specc knows, so its "
                            f"calls could not be read back; known formats: {known}. Serve it with --chat-template FILE "
                            "of a template in one of them, or send tool_choice \"none\"", "tools",
                       code="tool_format_unknown")
    if fmt is not None:
        _check_text_markers(fmt, tokenizer)
    parallel = req.parallel_tool_calls is not False
    tag = None if fmt is None else structural_tag(fmt, _grammars(req.tools, choice), choice, parallel)
    return ToolPlan(tools, choice, parallel, fmt, tag)


def _choice_name(choice) -> str | None:
    return choice["function"]["name"] if isinstance(choice, dict) else choice


def _template(tokenizer) -> str:
    """The chat template, checked to render the tools argument (a template without tools would send the
    conversation to the model without them)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise APIError(400, "tools: this model's tokenizer has no chat template to render tools with; serve it with "
                            "specc serve --chat-template FILE (a template that renders tools)", "tools",
                       code="no_chat_template")
    with _LOCK:
        renders = _RENDERS_TOOLS.get(template)
    if renders is None:
        probe = {"type": "function", "function": {"name": "specc_probe_tool", "parameters": {"type": "object"}}}
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe],
                                                 add_generation_prompt=True, tokenize=False)
            renders = "specc_probe_tool" in text
        except Exception:  # jinja2's errors, a template that fails on a tools argument
            renders = False
        with _LOCK:
            _RENDERS_TOOLS[template] = renders
    if not renders:
        raise APIError(400, "tools: this model's chat template does not render tools, so the model would never see "
                            "them; serve it with specc serve --chat-template FILE of a template that renders the "
                            "tools argument (docs/serving.md, Tool calling)", "tools", code="template_without_tools")
    return template


_RENDERS_TOOLS: dict[str, bool] = {}  # by template text: rendering a probe costs a template pass
_LOCK = threading.Lock()


def _check_text_markers(fmt: ToolFormat, tokenizer) -> None:
    """The format's markers must be text to this tokenizer: its special tokens are left out of decoded text and
    out of the grammar's string matching."""
    pieces = (fmt.trigger, fmt.block_open, fmt.block_close, fmt.call_open, fmt.args_key)
    special = [t for t in getattr(tokenizer, "all_special_tokens", []) if t and any(t in p for p in pieces)]
    if special:
        raise APIError(400, f"tools: this tokenizer makes {special[0]} a special token, and specc reads {fmt.name} "
                            "tool calls only where their markers are text", "tools", code="tool_format_unsupported")


def _grammars(tools: list[Tool], choice: str) -> list[tuple[str, str]]:
    """(name, EBNF of its arguments) per tool. The schema of each tool that `choice` lets the model call is held
    to response_format's checks first (runtime/grammar.check_schema: keywords the grammar enforces, size and
    pattern bounds), so a call never breaks a keyword the grammar could not enforce; that, or a schema the
    grammar library cannot compile, is a 400 naming the tool's parameters (and the keyword)."""
    out = []
    for i, t in enumerate(tools):
        schema = t.function.parameters if t.function.parameters is not None else {"type": "object"}
        param = f"tools.{i}.function.parameters"
        text = json.dumps(schema)
        if choice in ("auto", "required", t.function.name):
            try:
                check_schema(text, name=f"{param}: tool {t.function.name!r}")
            except RequestError as exc:
                raise APIError(400, str(exc), param) from None
        try:
            out.append((t.function.name, schema_ebnf(text)))
        except RequestError as exc:
            raise APIError(400, f"{param}: tool {t.function.name!r}: {exc}", param) from None
    return out


# -- the reply -----------------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def escape_controls(text: str) -> str:
    """Raw control characters as JSON escapes. The arguments' grammar has no free whitespace, so one can only
    stand inside a string, where the escape is the same value and a strict JSON parser accepts it (xgrammar's
    string rules admit some raw control characters)."""
    return _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


_CONTROL = re.compile(r"[\x00-\x1f]")


class ChoiceCalls:
    """One choice's text read as content and tool calls, whole (`message`) or as OpenAI stream deltas (`deltas`).
    Trailing whitespace of the content is left out of both (the space before a call), so the streamed pieces
    join to the whole reply's content."""

    def __init__(self, fmt: ToolFormat):
        self.parser = CallParser(fmt)
        self.held = ""  # whitespace not yet known to be followed by more content
        self.calls: list[dict] = []
        self.content = ""

    def deltas(self, text: str, final: bool) -> list[dict]:
        out = []
        for event in self.parser.feed(text, final):
            if isinstance(event, Content):
                piece = self.held + event.text
                shown = piece.rstrip()
                self.held = piece[len(shown):]
                if shown:
                    self.content += shown
                    out.append({"content": shown})
            elif isinstance(event, CallStart):
                call_id = new_call_id()
                self.calls.append({"id": call_id, "type": "function", "function": {"name": event.name, "arguments": ""}})
                out.append({"tool_calls": [{"index": event.index, "id": call_id, "type": "function",
                                            "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, Arguments):
                text = escape_controls(event.text)
                self.calls[event.index]["function"]["arguments"] += text
                out.append({"tool_calls": [{"index": event.index, "function": {"arguments": text}}]})
        return out

    def message(self, text: str) -> dict:
        """The whole reply's message: content (None when there is none) and tool_calls."""
        self.deltas(text, True)
        message = {"role": "assistant", "content": self.content or None}
        if self.calls:
            message["tool_calls"] = self.calls
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason


class ToolReply:
    """The choices of one request that asked for tools."""

    def __init__(self, tools: ToolPlan, n: int):
        self.choices = [ChoiceCalls(tools.format) for _ in range(n)]

    def whole(self, choice: dict, text: str) -> dict:
        """A whole reply's choice (schemas.choice) with its message read for calls."""
        calls = self.choices[choice["index"]]
        return {**choice, "message": calls.message(text), "finish_reason": calls.finish_reason(choice["finish_reason"])}

    def chunks(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> list[dict]:
        """The stream chunks' choices for one event of choice `index`: a delta per piece, the finish last."""
        calls = self.choices[index]
        out = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None}
               for d in calls.deltas(text, finish_reason is not None)]
        if out:
            out[0]["logprobs"] = logprobs
        if finish_reason is not None or (logprobs and not out):
            out.append({"index": index, "delta": {}, "logprobs": None if out else logprobs,
                        "finish_reason": calls.finish_reason(finish_reason)})
        return out
