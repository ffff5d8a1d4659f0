"""Reading a request body defensively: media type (415; a missing Content-Type is JSON, as curl and FastAPI
take it), size (413, without reading the rest), time (408), disconnects (``ClientGone``), JSON that cannot be
parsed (400), and values the parser accepts but nothing downstream can use (integers too long for Python to
parse from text, lone surrogates from ``\\uXXXX`` escapes): a 400 naming the field.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from splash.server.protocol import QUOTE_CHARS, APIError, quote

INT_DIGITS = 1000          # longer integer literals are refused by the field that holds them (int64 has 19)


class ClientGone(Exception):
    """The client went away before its request was answered: there is nobody to answer."""


def _check_media_type(request: Request) -> None:
    ctype = request.headers.get("content-type")
    if ctype is None:
        return
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"unsupported Content-Type {quote(ctype)}: send the body as application/json",
                       code="unsupported_media_type")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (server.max_request_body_bytes)",
                    code="request_too_large")


@dataclass(frozen=True)
class HugeInt:
    """An integer literal too long to convert: kept as its length, for find_unusable to refuse."""
    digits: int


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


async def _read(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, max_body_bytes: int, read_timeout_s: float) -> Any:
    _check_media_type(request)
    t0 = time.monotonic()
    try:
        raw = await asyncio.wait_for(_read(request, max_body_bytes), read_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {read_timeout_s:g}s "
                            f"(server.read_timeout_s; waited {time.monotonic() - t0:.1f}s)",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        data, suspect = loads(raw)
    except RecursionError:
        raise APIError(400, "the JSON in the request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, or a literal the parser cannot turn into a value
        raise APIError(400, f"malformed JSON in the request body: {e}", code="invalid_json") from None
    bad = find_unusable(data) if suspect else None
    if bad is not None:
        raise APIError(400, f"invalid value for '{bad[0]}': {bad[1]}", param=bad[0])
    return data


async def until_disconnected(request: Request) -> None:
    """Return when the client's connection closed (only for use after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
