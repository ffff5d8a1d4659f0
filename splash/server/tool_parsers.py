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
so a DeepSeek call cut short (max_tokens) has already streamed as a call when the end shows it is content. A stream
reads each complete call once and looks tools up by name: re-reading the whole section per token, with a scan of
the tools per argument, cost a request with thousands of tools and calls minutes of the event loop.
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
    end: int = 0            # a done call: where it ends in the text read (the next call is read from there)
    at: int = -1            # an open call of an early format: where its arguments start in the text read


Tools = dict[str, dict]      # the request's functions by name


def by_name(tools: list[dict] | None) -> Tools:
    out: Tools = {}
    for t in tools or ():
        out.setdefault(t.get("name"), t)
    return out


def _schema_type(tools: Tools, fn: str, key: str):
    t = tools.get(fn)
    if t is None:
        return None
    prop = ((t.get("parameters") or {}).get("properties") or {}).get(key) or {}
    return prop.get("type") if isinstance(prop, dict) else None


def _json_or_text(v: str):
    try:
        return json.loads(v)
    except (json.JSONDecodeError, ValueError):
        return v


class _Format(ABC):
    start: str          # the marker that opens the tool-call section
    early = False       # a call's name and arguments stream before it closes (its arguments are the model's text)
    close = ""          # not early: the marker without which no call completes (a stream reads nothing until it)

    @abstractmethod
    def calls(self, section: str, tools: Tools) -> list[Call]:
        """The calls in ``section``, up to and including the first that is not complete (it comes last)."""


class _Glm45(_Format):
    start, close = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def calls(self, section: str, tools: Tools) -> list[Call]:
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
            out.append(Call(name, json.dumps(args, ensure_ascii=False), True, m.end()))
        return out


class _DeepSeek(_Format):
    start = "<｜tool▁calls▁begin｜>"
    early = True
    call_start, sep, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    args_open, args_close = "", ""      # V3: ``function<sep>NAME`` then a ```json fence; V3.1: ``NAME<sep>``

    def calls(self, section: str, tools: Tools) -> list[Call]:
        out, at = [], section.find(self.call_start)
        for piece in section.split(self.call_start)[1:]:
            at += len(self.call_start)
            head, has_sep, body = piece.partition(self.sep)
            name, opened = head, has_sep
            if self.args_open:
                name, opened, body = body.partition(self.args_open)
            if not has_sep or not opened or not name.strip():
                out.append(Call(None, "", False))
                break
            close = self.args_close + self.call_end
            end = body.find(close)
            if end >= 0:   # the call ends where its end marker does: piece = head + sep + body
                out.append(Call(name.strip(), body[:end], True, at + len(piece) - len(body) + end + len(close)))
                at += len(piece)
                continue
            keep = partial_tail(body, close)
            out.append(Call(name.strip(), body[:len(body) - keep], False, at=at + len(piece) - len(body)))
            break
        return out


class _DeepSeekV3(_DeepSeek):
    args_open, args_close = "\n```json\n", "\n```"


class _DeepSeekV32(_Format):
    start, close = "<｜DSML｜function_calls>", "</｜DSML｜invoke>"
    _invoke = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>(.*?)(</｜DSML｜invoke>|$)', re.DOTALL)
    _param = re.compile(r'<｜DSML｜parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</｜DSML｜parameter>',
                        re.DOTALL)

    def calls(self, section: str, tools: Tools) -> list[Call]:
        out = []
        for m in self._invoke.finditer(section):
            name, body, done = m.group(1), m.group(2), bool(m.group(3))
            if not done:
                out.append(Call(name or None, "", False))
                break
            args = {k: (v if s == "true" else _json_or_text(v)) for k, s, v in self._param.findall(body)}
            out.append(Call(name, json.dumps(args, ensure_ascii=False), True, m.end()))
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
    calls = [c for c in fmt.calls(text[i:], by_name(tools)) if c.done and c.name]
    if not calls:
        return text, []
    return (text[:i] or None), [{"name": c.name, "arguments": c.arguments} for c in calls]


class CallDeltas:
    """OpenAI's streamed tool calls: a call's first delta ``{"index", "id", "type", "function": {"name",
    "arguments": ""}}``, then ``{"index", "function": {"arguments"}}`` per growth of its arguments."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.sent: list[str] = []     # arguments sent per call

    def more(self, k: int, arguments: str) -> list[dict]:
        """The delta of call ``k``'s arguments growing by ``arguments`` (its caller tracks what was sent)."""
        return [{"index": k, "function": {"arguments": arguments}}] if arguments else []

    def __call__(self, calls: list[tuple[str, str]], first: int = 0) -> list[dict]:
        """The deltas that bring the calls sent so far to ``calls`` [(name, arguments so far)], the calls from
        index ``first`` on (those before it were sent whole)."""
        out = []
        for k, (name, args) in enumerate(calls, first):
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
        self.fmt, self.tools = get(name), by_name(tools)
        self.text = ""
        self.sent_content = 0      # characters of text sent as content
        self.section: int | None = None
        self.read = 0              # the text before it holds only complete calls, already sent
        self.seen = 0              # the text before it was searched for the format's close marker
        self.settled = 0           # complete named calls sent (whole)
        self.open: tuple[int, int] | None = None   # early formats: the open call's index, where its unsent text starts
        self.deltas = CallDeltas()

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        if self.section is None:
            i = self.text.find(self.fmt.start, max(0, self.sent_content - len(self.fmt.start)))
            if i < 0:
                end = len(self.text) - partial_tail(self.text, self.fmt.start)
                out, self.sent_content = self.text[self.sent_content:end], max(self.sent_content, end)
                return out, []
            self.section = self.read = i
            content, self.sent_content = self.text[self.sent_content:i], i
            return content, self._call_deltas(done_only=False)
        return "", self._call_deltas(done_only=False)

    def _call_deltas(self, done_only: bool) -> list[dict]:
        """The deltas of the calls not yet sent whole, read from where the first of them starts."""
        early = self.fmt.early and not done_only   # only the last call can be unnamed or open
        if self.fmt.close:   # an open call sends nothing: read again only once a call can have closed
            look, self.seen = max(self.read, self.seen - len(self.fmt.close) + 1), len(self.text)
            if self.text.find(self.fmt.close, look) < 0:
                return []
        out = self._open_arguments() if self.open is not None else []
        if self.open is not None:
            return out
        start, named, done = self.read, [], 0
        calls = self.fmt.calls(self.text[start:], self.tools)
        for c in calls:
            if c.done:
                self.read = start + c.end
            if c.name and (c.done or early):
                named.append((c.name, c.arguments))
                done += c.done
        out += self.deltas(named, self.settled)
        self.settled += done   # the complete calls come first, and are now sent whole
        last = calls[-1] if calls else None
        if early and last is not None and not last.done and last.name and last.at >= 0:
            self.open = (self.settled, start + last.at + len(last.arguments))
        return out

    def _open_arguments(self) -> list[dict]:
        """An early format's open call, read on from where its last read stopped (not from its start: one long
        call re-read per token cost seconds of the event loop): its new arguments, and whether it closed."""
        k, sent = self.open
        close = self.fmt.args_close + self.fmt.call_end
        end = self.text.find(close, sent)
        if end < 0:   # a tail that may start the end marker is held back, never sent as arguments
            tail = max(sent, len(self.text) - len(close) + 1)
            upto = len(self.text) - partial_tail(self.text[tail:], close)
            self.open = (k, upto)
            return self.deltas.more(k, self.text[sent:upto])
        self.open, self.read = None, end + len(close)
        self.settled += 1
        return self.deltas.more(k, self.text[sent:end])

    def finish(self) -> tuple[str, list[dict]]:
        """The end: held-back text, or a section with no complete call, is content."""
        if self.section is None:
            out, self.sent_content = self.text[self.sent_content:], len(self.text)
            return out, []
        deltas = self._call_deltas(done_only=True)
        if not self.settled:
            # no complete call: the section is content (a DeepSeek call cut short has also streamed as a call)
            out, self.sent_content = self.text[self.sent_content:], len(self.text)
            return out, deltas
        return "", deltas
