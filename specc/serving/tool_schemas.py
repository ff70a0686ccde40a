"""The request fields of OpenAI tool calling: `tools`, `tool_choice`, and the assistant `tool_calls` of a
conversation's history (serving/tools.py plans and answers them)."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names; no quote can reach the grammar
MAX_TOOLS = 128  # OpenAI's limit per request
CHOICES = ("none", "auto", "required")


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of an object; None: any object
    strict: bool | None = None  # calls are held to the schema either way

    @field_validator("parameters")
    @classmethod
    def _object(cls, v):
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f'a tool\'s parameters must be a JSON schema of type "object", got type {v["type"]!r}')
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json(cls, v):
        try:
            value = json.loads(v)
        except ValueError:
            raise ValueError("must be the call's arguments as JSON text of an object, e.g. '{\"city\": \"Paris\"}'") from None
        if not isinstance(value, dict):
            raise ValueError(f"must be JSON text of an object, got {type(value).__name__}")
        return v


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict:
        """The call as chat templates take it: arguments as a mapping (templates render them with tojson)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(self.function.arguments)}}


def check_tool_choice(value: Any) -> Any:
    """tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name": NAME}}."""
    if value is None or value in CHOICES:
        return value
    if (isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict)
            and isinstance(value["function"].get("name"), str)):
        return value
    raise ValueError('allowed "none", "auto", "required" or {"type": "function", "function": {"name": "..."}}')
