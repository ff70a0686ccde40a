"""How each model family writes a tool call: one table (`FORMATS`), the grammar that holds a model to its
family's format (an xgrammar structural tag), and the parser that reads calls back out of the text, whole
or as it streams.

A format is found by the marker its chat template writes into the conversation (llama.cpp's server
detects formats the same way); a template with none of the markers gets a clear refusal, never a guess.
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    """One family's way of writing calls: `block_open` (call_open NAME args_key ARGS call_close)
    [call_sep ...] `block_close`. ARGS is a JSON object; NAME has no quote (tools.NAME_PATTERN)."""

    name: str
    families: str  # who writes it, for docs/serving.md and error messages
    marker: str  # the chat template holds this where it renders tools
    trigger: str  # in free text (tool_choice auto), this opens a call; a prefix of every call's text
    block_open: str
    call_open: str
    args_key: str
    call_close: str
    block_close: str
    call_sep: str | None = None  # between calls of one block; None: one call per block
    block_sep: str | None = None  # between blocks when only calls are allowed; None: no parallel calls

    def call_begin(self, name: str, first_in_block: bool = True) -> str:
        return (self.block_open if first_in_block else "") + self.call_open + name + self.args_key


FORMATS: tuple[ToolFormat, ...] = (
    ToolFormat("hermes", "Qwen2.5, Qwen3, SmolLM3, Hermes 2/3 (any template writing <tool_call>)", "<tool_call>",
               "<tool_call>", '<tool_call>\n', '{"name": "', '", "arguments": ', "}", "\n</tool_call>",
               block_sep="\n"),
    ToolFormat("mistral", "Mistral, Mixtral (templates writing [TOOL_CALLS] with text markers)", "[TOOL_CALLS]",
               "[TOOL_CALLS]", "[TOOL_CALLS] [", '{"name": "', '", "arguments": ', "}", "]", call_sep=", "),
    ToolFormat("llama3_json", "Llama 3.1, 3.2, 3.3 (JSON tool calls; one call per turn)", "<|python_tag|>",
               '{"name": "', "", '{"name": "', '", "parameters": ', "}", ""),
)


def detect(template: str) -> ToolFormat | None:
    """The format whose marker the chat template holds (None: no known format)."""
    return next((f for f in FORMATS if f.marker in template), None)


# -- the grammar -------------------------------------------------------------------------------------------
def structural_tag(fmt: ToolFormat, tools: list[tuple[str, str]], choice: str, parallel: bool) -> str:
    """The xgrammar structural tag (JSON text) for `tools` [(name, EBNF of its arguments)]. choice: "auto" (text,
    and once the trigger appears a whole call), "required" (only calls, at least one), "none" (text that never
    opens a call), or a tool's name (exactly one call of it)."""
    if choice == "none":
        fmt_ = {"type": "any_text", "excludes": [fmt.trigger]}
    elif choice == "auto":
        fmt_ = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": [_tag(fmt, t, True) for t in tools],
                "stop_after_first": not parallel}
    else:
        chosen = [t for t in tools if choice in ("required", t[0])]
        fmt_ = _calls_only(fmt, chosen, parallel and choice == "required")
    return json.dumps({"type": "structural_tag", "format": fmt_})


def _tag(fmt: ToolFormat, tool: tuple[str, str], whole_block: bool) -> dict:
    name, ebnf = tool
    end = fmt.call_close + (fmt.block_close if whole_block else "")
    return {"type": "tag", "begin": fmt.call_begin(name, whole_block), "content": {"type": "grammar", "grammar": ebnf},
            "end": end}


def _calls_only(fmt: ToolFormat, tools: list[tuple[str, str]], parallel: bool) -> dict:
    if parallel and fmt.call_sep is not None:  # many calls inside one block
        calls = {"type": "tags_with_separator", "tags": [_tag(fmt, t, False) for t in tools], "separator": fmt.call_sep,
                 "at_least_one": True}
        return {"type": "sequence", "elements": [_const(fmt.block_open), calls, _const(fmt.block_close)]}
    tags = [_tag(fmt, t, True) for t in tools]
    if parallel and fmt.block_sep is not None:  # many blocks of one call
        return {"type": "tags_with_separator", "tags": tags, "separator": fmt.block_sep, "at_least_one": True}
    return tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


# -- the parser --------------------------------------------------------------------------------------------
@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int  # the call's position among the choice's calls
    name: str


@dataclass
class Arguments:
    index: int
    text: str  # the next piece of the call's arguments (JSON text)


OUT, BLOCK_OPEN, CALL_OPEN, NAME, ARGS_KEY, ARGS, CALL_CLOSE, AFTER_CALL, BLOCK_CLOSE = range(9)


class CallParser:
    """Reads one choice's text as it arrives: `feed(delta, final)` returns what the new text settles, text
    outside calls (Content), a call's name (CallStart) and pieces of its arguments (Arguments). Text that may
    still turn out to open a call is held back until it is known. The grammar guarantees the calls' shape; a
    text that breaks it (cut short by a stop string) is handed back as content, never dropped."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.mode, self.buffer, self.calls = fmt, OUT, "", 0
        self.unparsed = ""  # the block's text so far, handed back as content if it breaks the format before a call
        self.started = False  # a call of this block has begun (its name is out)
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str, final: bool) -> list:
        self.buffer += text
        out: list = []
        while self._step(out, final):
            pass
        if final and (self.buffer or self.mode != OUT):
            self._broken(out)
        return _merged(out)

    def _step(self, out: list, final: bool) -> bool:
        """Consume what the buffer settles in the current mode; False when it must wait for more text."""
        f, mode = self.fmt, self.mode
        if mode == OUT:
            return self._outside(out, final)
        if mode == NAME:
            end = self.buffer.find('"')
            if end < 0:
                return False
            out.append(CallStart(self.calls, self.buffer[:end]))
            self.started = True
            self._take(end, ARGS_KEY)
            return True
        if mode == ARGS:
            return self._arguments(out)
        if mode == AFTER_CALL:
            if f.call_sep and self.buffer.startswith(f.call_sep):
                self._take(len(f.call_sep), CALL_OPEN)
                return True
            if f.call_sep and f.call_sep.startswith(self.buffer) and not final:
                return False
            self.mode = BLOCK_CLOSE
            return True
        literal, after = {BLOCK_OPEN: (f.block_open, CALL_OPEN), CALL_OPEN: (f.call_open, NAME),
                          ARGS_KEY: (f.args_key, ARGS), CALL_CLOSE: (f.call_close, AFTER_CALL),
                          BLOCK_CLOSE: (f.block_close, OUT)}[mode]
        if self.buffer.startswith(literal):
            self._take(len(literal), after)
            if after == OUT:
                self.unparsed, self.started = "", False
            return True
        if literal.startswith(self.buffer) and not final:
            return False
        self._broken(out)
        return False

    def _broken(self, out: list) -> None:
        """The text stopped following the format (cut short by max_tokens or a stop string): before a call's
        name it stays text; after it, the call keeps what it had and the format's cut-off rest is dropped."""
        if not self.started:
            out.append(Content(self.unparsed + self.buffer))
        self.buffer, self.unparsed, self.mode, self.started = "", "", OUT, False

    def _take(self, n: int, mode: int) -> None:
        self.unparsed += self.buffer[:n]
        self.buffer, self.mode = self.buffer[n:], mode

    def _outside(self, out: list, final: bool) -> bool:
        at = self.buffer.find(self.fmt.trigger)
        if at >= 0:
            out.append(Content(self.buffer[:at]))
            self.buffer, self.mode, self.unparsed = self.buffer[at:], BLOCK_OPEN, ""
            return True
        hold = 0 if final else _partial(self.buffer, self.fmt.trigger)
        out.append(Content(self.buffer[:len(self.buffer) - hold]))
        self.buffer = self.buffer[len(self.buffer) - hold:]
        return False

    def _arguments(self, out: list) -> bool:
        """Scan the arguments' JSON up to the brace that closes it (strings and escapes tracked)."""
        for i, c in enumerate(self.buffer):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    out.append(Arguments(self.calls, self.buffer[:i + 1]))
                    self.calls += 1
                    self._take(i + 1, CALL_CLOSE)
                    return True
        if self.buffer:
            out.append(Arguments(self.calls, self.buffer))
            self._take(len(self.buffer), ARGS)
        return False


def _partial(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _merged(events: list) -> list:
    """Adjacent pieces of the same kind joined, empty pieces dropped."""
    out: list = []
    for e in events:
        if isinstance(e, (Content, Arguments)) and not e.text:
            continue
        if out and type(out[-1]) is type(e) and isinstance(e, Content):
            out[-1] = Content(out[-1].text + e.text)
        elif out and isinstance(e, Arguments) and isinstance(out[-1], Arguments) and out[-1].index == e.index:
            out[-1] = Arguments(e.index, out[-1].text + e.text)
        else:
            out.append(e)
    return out
