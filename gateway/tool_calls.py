"""Tool calling on the OpenAI door: `tools` and `tool_choice` checked, the output constrained to a
call or parsed into `tool_calls`. Pure: no IO.

- "none": the tools go to the chat template (the model may read them); the output is text.
- a named function (`{"type": "function", "function": {"name": N}}`): the output is constrained to
  that function's `parameters` schema and returned as one call of it (finish reason "stop", as
  OpenAI's for a forced function).
- "required": the output is constrained to a JSON array of `{"name", "parameters"}` (at least one;
  each a tool's name and a value of its parameters, as vLLM's), returned as those calls.
- `parallel_tool_calls: false`: one call at most ("required" is constrained to one; "auto" keeps
  the first).
- "auto" (the default when tools are given): the model decides. Calls it writes in the Hermes
  format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (that of Qwen2.5, Qwen3,
  Hermes and the chat templates written for them), become `tool_calls`; the rest is content.

"required" and "auto" end with finish reason "tool_calls" when they made a call.
"""

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from gateway.openai_request import ApiError, _bad

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # its JSON Schema ({"type": "object"} when it gave none)
    spec: dict  # as sent: what the chat template renders


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: tuple[Tool, ...]
    name: str = ""  # "named": the function
    parallel: bool = True  # more than one call allowed

    def schema(self) -> dict | None:
        """The JSON Schema the output is constrained to (None: free text)."""
        if self.mode == "named":
            return next(t.parameters for t in self.tools if t.name == self.name)
        if self.mode == "required":
            return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}), "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                 "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]}}
        return None

    def template_tools(self) -> list[dict]:
        return [t.spec for t in self.tools]


def _tool(i: int, spec: Any) -> Tool:
    field = f"tools[{i}]"
    fn = spec.get("function") if isinstance(spec, dict) and spec.get("type", "function") == "function" else None
    if not isinstance(fn, dict):
        raise _bad(field, "{type: function, function: {name, description, parameters}}", spec)
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise _bad(f"{field}.function.name", "1..64 characters of a-z A-Z 0-9 _ -", name)
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object"}
    elif not isinstance(params, dict):
        raise _bad(f"{field}.function.parameters", "a JSON Schema object", params)
    return Tool(name, params, spec)


def tool_choice(body: dict) -> ToolChoice | None:
    """The body's `tools` and `tool_choice` (None: no tools). A choice that names no given tool, or
    asks for one with no tools, is a 400 naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice in (None, "none"):
            return None
        raise ApiError(400, "tool_choice: give the tools it chooses from (tools)", param="tool_choice")
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad("tools", f"a list of at most {MAX_TOOLS} functions", f"{type(tools).__name__} of {len(tools)}"
                   if isinstance(tools, list) else tools)
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ApiError(400, f"tools: function names must be unique, got {names}", param="tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "true or false", parallel)
    if choice is None or choice in ("auto", "none", "required"):
        return ToolChoice(choice or "auto", parsed, parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice", '"none", "auto", "required" or {type: function, function: {name}}', choice)
    if name not in names:
        raise ApiError(400, f"tool_choice: no tool is named {name!r} (tools: {names})", param="tool_choice")
    return ToolChoice("named", parsed, name, parallel)


def call(name: str, arguments: str) -> dict:
    """One entry of a message's `tool_calls`."""
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _hermes(body: str) -> tuple[str, str] | None:
    """A Hermes call's body -> (name, arguments as JSON text), or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class HermesStream:
    """Splits text as it streams into content and Hermes tool calls. `feed` -> events, each
    ("content", text) or ("call", name, arguments); text that may still open a call is held back
    until it is known not to. A `<tool_call>` block that does not parse stays content."""

    def __init__(self):
        self.buf = ""
        self.inside = False

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while True:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = next((k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1)
                                 if self.buf.endswith(OPEN[:k])), 0)
                    _content(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                _content(out, self.buf[:i])
                self.buf, self.inside = self.buf[i + len(OPEN):], True
            else:
                j = self.buf.find(CLOSE)
                if j < 0:
                    return out
                body, self.buf, self.inside = self.buf[:j], self.buf[j + len(CLOSE):], False
                parsed = _hermes(body)
                if parsed is None:
                    _content(out, OPEN + body + CLOSE)
                else:
                    out.append(("call", *parsed))

    def finish(self) -> list[tuple]:
        """The held-back rest, as content (an unclosed call too)."""
        out: list[tuple] = []
        _content(out, (OPEN if self.inside else "") + self.buf)
        self.buf, self.inside = "", False
        return out


def _content(out: list[tuple], text: str) -> None:
    if text:
        out.append(("content", text))


def calls_of(choice: ToolChoice, text: str) -> tuple[str | None, list[dict]]:
    """A whole output -> (its content, None when it is all calls; its `tool_calls`). An output
    that was to be a call but does not parse (cut by max_tokens) stays content, with no calls."""
    if choice.mode == "named":
        return None, [call(choice.name, text)]
    if choice.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        return None, [call(it["name"], json.dumps(it["parameters"], ensure_ascii=False)) for it in items]
    if choice.mode == "auto":
        stream = HermesStream()
        events = stream.feed(text) + stream.finish()
        content = "".join(e[1] for e in events if e[0] == "content")
        calls = [call(e[1], e[2]) for e in events if e[0] == "call"][:None if choice.parallel else 1]
        return (content or None) if calls else content, calls
    return text, []
