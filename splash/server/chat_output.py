"""The assistant message of a chat choice: generated text → ``reasoning_content``, ``content``, ``tool_calls``.

The text goes through the reasoning parser (unless a grammar shapes the whole output), then the tool-call
parser under ``tool_choice: "auto"``, or the forced call of ``"required"`` / a named function. ``message`` reads a
whole output, ``ChatStream`` a stream (a choice's deltas add up to its message). A parser that fails leaves the
text as content, never a 500.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from splash.server import reasoning, tool_parsers
from splash.server.tool_choice import CallScanner, ToolChoice, forced_calls

_log = logging.getLogger("splash.server")


@dataclass(frozen=True)
class OutputMode:
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    tools: ToolChoice | None = None
    template_kwargs: dict | None = None
    constrained: bool = False          # a grammar shapes the whole output: no reasoning to split off
    thinking_opened: bool = False      # the prompt ends with <think>: the output starts inside the reasoning

    @property
    def forced(self) -> bool:
        return self.tools is not None and self.tools.mode in ("required", "named")

    @property
    def auto_tools(self) -> bool:
        return self.tools is not None and self.tools.mode == "auto" and self.tool_parser is not None

    @property
    def reasoner(self) -> str | None:
        return None if self.constrained else self.reasoning_parser

    @property
    def plain(self) -> bool:
        return not (self.forced or self.auto_tools or self.reasoner)


def message(mode: OutputMode, text: str, finish: str | None) -> tuple[dict, str | None]:
    try:
        return _message(mode, text, finish)
    except Exception:  # noqa: BLE001 — model output a parser cannot handle is content, never a 500
        _log.exception("parsing the output failed; returning it as content")
        return {"role": "assistant", "content": text}, finish


def _message(mode: OutputMode, text: str, finish: str | None) -> tuple[dict, str | None]:
    r, rest = reasoning.split(mode.reasoner, text, mode.template_kwargs, mode.thinking_opened)
    msg: dict = {"role": "assistant", "content": rest}
    if r is not None:
        msg["reasoning_content"] = r
    calls: list[dict] = []
    if mode.forced:
        got = forced_calls(mode.tools, rest or "")
        if got is not None:
            calls, msg["content"] = got, None
    elif mode.auto_tools:
        content, calls = tool_parsers.parse(mode.tool_parser, rest or "", list(mode.tools.tools))
        msg["content"] = content if calls else rest
    if calls:
        msg["tool_calls"] = [{"id": tool_parsers.call_id(), "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        if finish == "stop":
            finish = "tool_calls"
    return msg, finish


class ChatStream:
    """Per choice: ``feed(text delta)`` → the delta fields to send (may be empty)."""

    def __init__(self, mode: OutputMode) -> None:
        self.mode = mode
        self.reason = (reasoning.ReasoningStream(mode.reasoner, mode.template_kwargs, mode.thinking_opened)
                       if mode.reasoner else None)
        self.tools = tool_parsers.ToolStream(mode.tool_parser, list(mode.tools.tools)) if mode.auto_tools else None
        self.forced = tool_parsers.CallDeltas() if mode.forced else None
        self.forced_text = ""      # a named function's forced output: its arguments
        self.scanner = CallScanner()   # "required"'s forced output: a JSON array of calls
        self.called = False
        self.broken = False     # a parser failed: the rest of the text goes out as content

    def _after_reasoning(self, text: str, last: bool) -> dict:
        out: dict = {}
        calls: list[dict] = []
        if self.forced is not None:
            tc = self.mode.tools
            if tc.mode == "named":
                self.forced_text += text
                calls = self.forced([(tc.name, self.forced_text)])
            else:
                first, found = self.scanner.feed(text)
                calls = self.forced(found, first)
        elif self.tools is not None:
            content, calls = self.tools.feed(text)
            if last:
                more, tail = self.tools.finish()
                content, calls = content + more, calls + tail
            if content:
                out["content"] = content
        elif text:
            out["content"] = text
        if calls:
            out["tool_calls"] = calls
            self.called = True
        return out

    def feed(self, delta: str, last: bool = False) -> dict:
        if self.mode.plain:   # every chunk before the last carries a content field, even an empty one
            return {"content": delta} if delta or not last else {}
        if self.broken:
            return {"content": delta} if delta else {}
        try:
            return self._feed(delta, last)
        except Exception:  # noqa: BLE001 — from here on the stream is plain content (never a 500 mid-stream)
            _log.exception("parsing the streamed output failed; the rest is sent as content")
            self.broken = True
            return {"content": delta} if delta else {}

    def _feed(self, delta: str, last: bool) -> dict:
        r, rest = (self.reason.feed(delta) if self.reason else ("", delta))
        if last and self.reason:
            r2, rest2 = self.reason.finish()
            r, rest = r + r2, rest + rest2
        out = self._after_reasoning(rest, last)
        if r:
            out["reasoning_content"] = r
        return out

    def finish_reason(self, finish: str | None) -> str | None:
        return "tool_calls" if finish == "stop" and self.called else finish
