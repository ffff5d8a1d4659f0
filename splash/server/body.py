"""Reading a request body defensively: media type (415; a missing Content-Type is JSON, as curl and FastAPI
take it), size (413, without reading the rest), time (408), disconnects (``ClientGone``), JSON that cannot be
parsed (400) and values nothing downstream can use (400 naming the field, ``splash.server.limits``).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from splash.server import limits
from splash.server.protocol import APIError


class ClientGone(Exception):
    """The client went away before its request was answered: there is nobody to answer."""


def _check_media_type(request: Request) -> None:
    ctype = request.headers.get("content-type")
    if ctype is None:
        return
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"unsupported Content-Type {limits.quote(ctype)}: send the body as application/json",
                       code="unsupported_media_type")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (server.max_request_body_bytes)",
                    code="request_too_large")


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
        data, suspect = limits.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the JSON in the request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:   # any other literal the parser cannot turn into a value
        raise APIError(400, f"malformed JSON in the request body: {e}", code="invalid_json") from None
    bad = limits.find_unusable(data) if suspect else None
    if bad is not None:
        raise APIError(400, f"invalid value for '{bad[0]}': {bad[1]}", param=bad[0])
    return data


async def until_disconnected(request: Request) -> None:
    """Return when the client's connection closed (only for use after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
