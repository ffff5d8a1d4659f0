"""Values a request body may carry that the JSON parser accepts but nothing downstream can use (integers too
long for Python to parse from text, lone surrogates from ``\\uXXXX`` escapes: a 400 naming the field), and
bounded quoting, so an error message never echoes a 100,000-character input whole.
"""
from __future__ import annotations

import json
import sys
from typing import Any

QUOTE_CHARS = 64           # an error message shows at most this many characters of one client value
MAX_MESSAGE_CHARS = 1024   # and an error message is never longer than this
INT_DIGITS = 1000          # longer integer literals are refused by the field that holds them (int64 has 19)


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    s = repr(value)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}... ({len(s) - limit} more characters)"


def clip(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return message if len(message) <= limit else f"{message[:limit]}... (message cut at {limit} characters)"


class HugeInt:
    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def loads(raw: bytes) -> tuple[Any, bool]:
    """(the parsed body, whether it may hold a value ``find_unusable`` refuses: only then is the walk needed)."""
    huge = []
    limit = min(INT_DIGITS, sys.get_int_max_str_digits() or INT_DIGITS)

    def parse_int(text: str) -> int | HugeInt:
        digits = len(text.lstrip("-"))
        if digits > limit:
            huge.append(digits)
            return HugeInt(digits)
        return int(text)

    data = json.loads(raw, parse_int=parse_int)
    return data, bool(huge) or b"\\ud" in raw.lower()


def _unusable(value: Any) -> str | None:
    if isinstance(value, HugeInt):
        return f"an integer of {value.digits} digits is out of range"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"the string contains a lone surrogate ({quote(value[e.start:e.end])} at character {e.start}), "
                    "which is not valid Unicode text")
    return None


def find_unusable(data: Any) -> tuple[str, str] | None:
    """(field path like ``messages.0.content``, why) of the first value nothing can use, or None; iterative,
    as the JSON may be deeply nested."""
    todo: list[tuple[Any, str]] = [(data, "")]
    while todo:
        value, path = todo.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                sub = f"{path}.{k}" if path else str(k)
                if (why := _unusable(k)) is not None:
                    return sub[:QUOTE_CHARS], f"the field name: {why}"
                todo.append((v, sub))
        elif isinstance(value, list):
            todo.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value))
        elif isinstance(value, (HugeInt, str)):
            if (why := _unusable(value)) is not None:
                return path[:QUOTE_CHARS] or "body", why
    return None
