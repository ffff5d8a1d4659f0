"""Chat ``tools`` and ``tool_choice``: checking them, and the forced calls of "required" / a named function.

``"none"`` shows the tools to the template and parses no call; ``"auto"`` (the default with tools) parses the
model's own call format (splash.server.tool_parsers). ``"required"`` constrains the output, as vLLM does, to a
JSON array of ``{"name": <a tool>, "parameters": <its schema>}`` (at most one with ``parallel_tool_calls:
false``); a named function constrains it to that function's parameters. The output becomes ``tool_calls``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from splash.server.protocol import APIError
from splash.server.structured import GrammarSpec


@dataclass(frozen=True)
class ToolChoice:
    mode: str                      # none | auto | required | named
    tools: tuple[dict, ...]        # the functions as given ({"name", "parameters", ...})
    name: str | None = None        # the named function


def _function(tool: Any, i: int) -> dict:
    where, param = f"tools[{i}]", f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise APIError(400, f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", param=param)
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise APIError(400, f"'{where}.function.name' must be a non-empty string", param=f"{param}.function.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise APIError(400, f"'{where}.function.parameters' must be a JSON schema object",
                       param=f"{param}.function.parameters")
    return fn


def read_tools(tools: list | None, tool_choice: Any) -> ToolChoice:
    fns = tuple(_function(t, i) for i, t in enumerate(tools or ()))
    names = [f["name"] for f in fns]
    if len(set(names)) != len(names):
        raise APIError(400, "'tools' has two functions with the same name", param="tools")
    choice = tool_choice if tool_choice is not None else ("auto" if fns else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"'tool_choice' must be none, auto, required or a named function; got {choice!r}",
                           param="tool_choice")
        if choice != "none" and not fns:
            raise APIError(400, f"'tool_choice' {choice!r} needs 'tools'", param="tool_choice")
        return ToolChoice(choice, fns)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(
        choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise APIError(400, "'tool_choice' as an object must be {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", param="tool_choice")
    if name not in names:
        raise APIError(400, f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                       param="tool_choice")
    return ToolChoice("named", fns, name)


def _params(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def forced_spec(tc: ToolChoice, parallel: bool | None) -> GrammarSpec | None:
    if tc.mode == "named":
        fn = next(f for f in tc.tools if f["name"] == tc.name)
        return GrammarSpec("json", json.dumps(_params(fn), sort_keys=True), "tool_choice")
    if tc.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                               "parameters": _params(f)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in tc.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return GrammarSpec("json", json.dumps(schema, sort_keys=True), "tool_choice")


def forced_calls(tc: ToolChoice, text: str) -> list[dict] | None:
    """[{"name", "arguments"}] of a forced output, arguments as the model wrote them (so a stream's deltas add up
    to the same text); None when ``text`` is not a complete call (e.g. cut by max_tokens: it is then content)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if tc.mode == "named":
        return [{"name": tc.name, "arguments": text.strip()}]
    calls = scan_calls(text)
    if not isinstance(value, list) or len(calls) != len(value):
        return None
    return [{"name": n, "arguments": a} for n, a in calls]


def _value_end(s: str, i: int) -> int:
    """Index just past the JSON value starting at s[i], or -1 while it is incomplete (a number or literal is
    complete only once a delimiter follows it)."""
    try:
        end = _DECODER.raw_decode(s, i)[1]
    except json.JSONDecodeError:
        return -1
    return end if s[i] in "{[\"" or (end < len(s) and s[end] in ",}]") else -1


_DECODER = json.JSONDecoder()
_NAME = re.compile(r'\s*,?\s*\{\s*"name"\s*:\s*')
_PARAMS = re.compile(r'\s*,\s*"parameters"\s*:\s*')


def scan_calls(s: str) -> list[tuple[str, str]]:
    """(name, arguments so far) of each call in a growing ``[{"name": …, "parameters": …}, …]`` (the keys in
    the schema's order)."""
    return _scan(s, s.find("[") + 1 if "[" in s else len(s))[0]


def _scan(s: str, i: int) -> tuple[list[tuple[str, str]], int, int]:
    """The calls from ``s[i]`` on, how many of them are complete, and where the text after those starts."""
    out: list[tuple[str, str]] = []
    complete, after = 0, i
    while i < len(s):
        m = _NAME.match(s, i)
        if m is None:
            break
        j = _value_end(s, m.end())
        p = _PARAMS.match(s, j) if j >= 0 else None
        if p is None:
            break
        name = json.loads(s[m.end():j])
        e = _value_end(s, p.end())
        if e < 0:
            out.append((name, s[p.end():]))
            break
        out.append((name, s[p.end():e]))
        close = s.find("}", e)
        if close < 0:
            break
        i = after = close + 1
        complete += 1
    return out, complete, after


class CallScanner:
    """``scan_calls`` of a streamed output, reading each complete call once (re-reading them all per token cost a
    request of many calls seconds of the event loop): ``feed(delta)`` → (the index of the first call returned,
    the calls from it on)."""

    def __init__(self) -> None:
        self.text = ""
        self.at: int | None = None   # where the calls not yet complete start (None: before the "[")
        self.complete = 0

    def feed(self, delta: str) -> tuple[int, list[tuple[str, str]]]:
        self.text += delta
        if self.at is None:
            if "[" not in self.text:
                return 0, []
            self.at = self.text.find("[") + 1
        first = self.complete
        calls, complete, self.at = _scan(self.text, self.at)
        self.complete += complete
        return first, calls
