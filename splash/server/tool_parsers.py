"""Tool-call parsers (``--tool-call-parser``, vLLM's names) for the formats GLM and DeepSeek models emit.

* ``glm45``: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>…</tool_call>``; a value is JSON
  unless the tool's schema says the argument is a string (or it is not JSON).
* ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```
  <｜tool▁call▁end｜>…``; ``deepseek_v31``: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`` (ARGS:
  JSON text, passed through).
* ``deepseek_v32`` (DSML): ``<｜DSML｜invoke name="NAME"><｜DSML｜parameter name="K" string="true|false">V
  </｜DSML｜parameter>…``; ``string="false"`` values are JSON.

An output whose call section holds no complete call is all content (a malformed call is never lost nor an error).
Streaming, DeepSeek's arguments go out as they arrive, GLM's and DSML's (built from pairs) when the call closes;
so a DeepSeek call cut short (max_tokens) has already streamed as a call when the end shows it is content.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

from splash.server.reasoning import partial_tail


@dataclass
class Call:
    name: str | None        # None while the name is still being generated
    arguments: str          # JSON text so far (the whole text once done)
    done: bool


def _schema_type(tools: list[dict] | None, fn: str, key: str):
    for t in tools or ():
        if t.get("name") == fn:
            prop = ((t.get("parameters") or {}).get("properties") or {}).get(key) or {}
            return prop.get("type")
    return None


def _json_or_text(v: str):
    try:
        return json.loads(v)
    except (json.JSONDecodeError, ValueError):
        return v


class _Format(ABC):
    start: str          # the marker that opens the tool-call section
    early = False       # a call's name and arguments stream before it closes (its arguments are the model's text)

    @abstractmethod
    def calls(self, section: str, tools: list[dict] | None) -> list[Call]:
        """The calls in a tool-call section; one still being generated comes last, not done."""


class _Glm45(_Format):
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def calls(self, section: str, tools: list[dict] | None) -> list[Call]:
        out = []
        for m in self._block.finditer(section):
            body, done = m.group(1), bool(m.group(2))
            cut = min((i for i in (body.find("\n"), body.find("<arg_key>")) if i >= 0), default=-1)
            if cut < 0 and not done:
                out.append(Call(None, "", False))
                break
            name = (body if cut < 0 else body[:cut]).strip()
            if not done:
                out.append(Call(name or None, "", False))
                break
            args = {}
            for k, v in self._pair.findall(body):
                k, v = k.strip(), v.strip()
                args[k] = v if _schema_type(tools, name, k) == "string" else _json_or_text(v)
            out.append(Call(name, json.dumps(args, ensure_ascii=False), True))
        return out


class _DeepSeek(_Format):
    start = "<｜tool▁calls▁begin｜>"
    early = True
    call_start, sep, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    args_open, args_close = "", ""      # V3: ``function<sep>NAME`` then a ```json fence; V3.1: ``NAME<sep>``

    def calls(self, section: str, tools: list[dict] | None) -> list[Call]:
        out = []
        for piece in section.split(self.call_start)[1:]:
            head, has_sep, body = piece.partition(self.sep)
            name, opened = head, has_sep
            if self.args_open:
                name, opened, body = body.partition(self.args_open)
            if not has_sep or not opened or not name.strip():
                out.append(Call(None, "", False))
                break
            close = self.args_close + self.call_end
            end = body.find(close)
            if end >= 0:
                out.append(Call(name.strip(), body[:end], True))
                continue
            keep = partial_tail(body, close)
            out.append(Call(name.strip(), body[:len(body) - keep], False))
            break
        return out


class _DeepSeekV3(_DeepSeek):
    args_open, args_close = "\n```json\n", "\n```"


class _DeepSeekV32(_Format):
    start = "<｜DSML｜function_calls>"
    _invoke = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>(.*?)(</｜DSML｜invoke>|$)', re.DOTALL)
    _param = re.compile(r'<｜DSML｜parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</｜DSML｜parameter>',
                        re.DOTALL)

    def calls(self, section: str, tools: list[dict] | None) -> list[Call]:
        out = []
        for m in self._invoke.finditer(section):
            name, body, done = m.group(1), m.group(2), bool(m.group(3))
            if not done:
                out.append(Call(name or None, "", False))
                break
            args = {k: (v if s == "true" else _json_or_text(v)) for k, s, v in self._param.findall(body)}
            out.append(Call(name, json.dumps(args, ensure_ascii=False), True))
        if not out and "<｜DSML｜invoke" in section:
            out.append(Call(None, "", False))   # the invoke's name is still being generated
        return out


FORMATS = {"glm45": _Glm45, "deepseek_v3": _DeepSeekV3, "deepseek_v31": _DeepSeek, "deepseek_v32": _DeepSeekV32}


def get(name: str) -> _Format:
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[name]()


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse(name: str, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
    """(content, [{"name", "arguments"}]) of a complete output."""
    fmt = get(name)
    i = text.find(fmt.start)
    if i < 0:
        return text, []
    calls = [c for c in fmt.calls(text[i:], tools) if c.done and c.name]
    if not calls:
        return text, []
    return (text[:i] or None), [{"name": c.name, "arguments": c.arguments} for c in calls]


class CallDeltas:
    """OpenAI's streamed tool calls: a call's first delta ``{"index", "id", "type", "function": {"name",
    "arguments": ""}}``, then ``{"index", "function": {"arguments"}}`` per growth of its arguments."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.sent: list[str] = []     # arguments sent per call

    def __call__(self, calls: list[tuple[str, str]]) -> list[dict]:
        """The deltas that bring the calls sent so far to ``calls`` [(name, arguments so far)]."""
        out = []
        for k, (name, args) in enumerate(calls):
            if k == len(self.ids):
                self.ids.append(call_id())
                self.sent.append("")
                out.append({"index": k, "id": self.ids[k], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            if len(args) > len(self.sent[k]) and args.startswith(self.sent[k]):
                out.append({"index": k, "function": {"arguments": args[len(self.sent[k]):]}})
                self.sent[k] = args
        return out


class ToolStream:
    """Streaming ``parse``: ``feed(delta)`` → (content increment, [tool-call deltas]); ``finish()`` the same for
    what was held back."""

    def __init__(self, name: str, tools: list[dict] | None = None) -> None:
        self.fmt, self.tools = get(name), tools
        self.text = ""
        self.sent_content = 0      # characters of text sent as content
        self.section: int | None = None
        self.deltas = CallDeltas()

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        if self.section is None:
            i = self.text.find(self.fmt.start, max(0, self.sent_content - len(self.fmt.start)))
            if i < 0:
                end = len(self.text) - partial_tail(self.text, self.fmt.start)
                out, self.sent_content = self.text[self.sent_content:end], max(self.sent_content, end)
                return out, []
            self.section = i
            content, self.sent_content = self.text[self.sent_content:i], i
            return content, self._call_deltas(done_only=False)
        return "", self._call_deltas(done_only=False)

    def _call_deltas(self, done_only: bool) -> list[dict]:
        early = self.fmt.early and not done_only   # only the last call can be unnamed or open
        return self.deltas([(c.name, c.arguments) for c in self.fmt.calls(self.text[self.section:], self.tools)
                            if c.name and (c.done or early)])
    def finish(self) -> tuple[str, list[dict]]:
        """The end: held-back text, or a section with no complete call, is content."""
        if self.section is None:
            out, self.sent_content = self.text[self.sent_content:], len(self.text)
            return out, []
        deltas = self._call_deltas(done_only=True)
        if not any(c.done and c.name for c in self.fmt.calls(self.text[self.section:], self.tools)):
            # no complete call: the section is content (a DeepSeek call cut short has also streamed as a call)
            out, self.sent_content = self.text[self.sent_content:], len(self.text)
            return out, deltas
        return "", deltas
