"""Reasoning parsers (``--reasoning-parser``, vLLM's names): a model's ``<think>…</think>`` → ``reasoning_content``.

* ``deepseek_r1``: the output is reasoning up to ``</think>`` and content after it; a leading ``<think>`` is dropped
  (templates often put it in the prompt). Without ``</think>`` everything is reasoning (the model never finished
  thinking).
* ``glm45``: reasoning only when the output holds ``<think>`` and ``</think>`` (text before ``<think>`` is dropped,
  as vLLM does); otherwise all of it is content (GLM's ``enable_thinking: false`` puts an empty
  ``<think></think>`` in the prompt, so the answer carries no tags). Streaming: after a leading ``<think>`` the
  text is reasoning until ``</think>``.
* ``deepseek_v3``: DeepSeek-V3.1/V3.2's thinking switch: with ``chat_template_kwargs`` ``thinking`` (or
  ``enable_thinking``) true it is ``deepseek_r1``, otherwise the output is all content.
* Whatever the parser, when the prompt itself ends with ``<think>`` (GLM-5.x's and DeepSeek-V3.1's templates open
  the thinking block in the prompt when thinking is on), the output starts inside the reasoning: ``deepseek_r1``'s
  rule applies (reasoning until ``</think>``).

``split`` parses a whole output; ``ReasoningStream`` is the streaming form, fed text deltas and returning
(reasoning, content) increments; it holds back only a tail that could still be the start of a tag.
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
    """(reasoning_content, content) of a complete output; None where a part is empty/absent. ``opened``: the
    prompt ends with ``<think>``."""
    name = _effective(name, kwargs, opened) if name else None
    if name is None:
        return None, text
    if name == "glm45":
        if START not in text or END not in text:
            return None, text
        text = text.partition(START)[2]
        if END not in text:
            return None, text
        r, _, c = text.partition(END)
        return r, c or None
    # deepseek_r1
    if text.startswith(START):
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
    """Streaming ``split``: ``feed(delta) -> (reasoning, content)`` increments, ``finish()`` the rest."""

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
        """What is held back at the end: a partial tag is text of the part it was in."""
        out, self.buf = self.buf, ""
        if self.state == "before" and self.name == "glm45":
            return "", out
        if self.state in ("before", "think"):
            return out, ""
        return "", out
