"""Reasoning parsers (``--reasoning-parser``, vLLM's names): a model's ``<think>…</think>`` → ``reasoning_content``.

* ``deepseek_r1``: reasoning up to ``</think>`` (a leading ``<think>`` dropped), content after; without
  ``</think>`` all of it is reasoning.
* ``glm45``: reasoning only when the output holds both tags (text before ``<think>`` dropped, as vLLM);
  otherwise all content (``enable_thinking: false`` puts an empty ``<think></think>`` in the prompt).
* ``deepseek_v3``: ``deepseek_r1`` with ``chat_template_kwargs`` ``thinking`` / ``enable_thinking``, else content.
* Whatever the parser, a prompt that ends with ``<think>`` (GLM-5.x's and DeepSeek-V3.1's templates with thinking
  on) starts the output inside the reasoning: ``deepseek_r1``'s rule.
"""
from __future__ import annotations

START, END = "<think>", "</think>"


def _effective(name: str, kwargs: dict | None, opened: bool = False) -> str | None:
    if opened:
        return "deepseek_r1"
    if name == "deepseek_v3":
        kw = kwargs or {}
        return "deepseek_r1" if kw.get("thinking") or kw.get("enable_thinking") else None
    return name


def split(name: str | None, text: str, kwargs: dict | None = None,
          opened: bool = False) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a complete output; None where a part is empty/absent."""
    name = _effective(name, kwargs, opened) if name else None
    if name is None:
        return None, text
    if name == "glm45":   # both tags, or no reasoning at all
        if START not in text or END not in text:
            return None, text
        text = text.partition(START)[2]
        if END not in text:
            return None, text
    elif text.startswith(START):   # deepseek_r1
        text = text[len(START):]
    if END not in text:
        return text, None
    r, _, c = text.partition(END)
    return r, c or None


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """Streaming ``split``: ``feed(delta) -> (reasoning, content)`` increments, holding back only a tail that
    could start a tag; ``finish()`` the rest."""

    def __init__(self, name: str | None, kwargs: dict | None = None, opened: bool = False) -> None:
        self.name = _effective(name, kwargs, opened) if name else None
        # before: nothing decided yet (start tag may come); think: inside reasoning; content: after it
        self.state = "content" if self.name is None else "before"
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        if self.state == "content":
            return "", delta
        self.buf += delta
        r, c = "", ""
        if self.state == "before":
            if len(self.buf) < len(START) and START.startswith(self.buf):
                return "", ""   # could still be <think>
            if self.buf.startswith(START):
                self.buf = self.buf[len(START):]
                self.state = "think"
            elif self.name == "glm45":
                self.state = "content"
                out, self.buf = self.buf, ""
                return "", out
            else:
                self.state = "think"   # deepseek_r1: the template opened the thinking block
        if self.state == "think":
            i = self.buf.find(END)
            if i < 0:
                keep = partial_tail(self.buf, END)
                r, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return r, ""
            r, c = self.buf[:i], self.buf[i + len(END):]
            self.buf, self.state = "", "content"
        return r, c

    def finish(self) -> tuple[str, str]:
        """A partial tag held back at the end is text of the part it was in."""
        out, self.buf = self.buf, ""
        if self.state == "before" and self.name == "glm45":
            return "", out
        if self.state in ("before", "think"):
            return out, ""
        return "", out
