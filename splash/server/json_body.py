"""A non-streamed JSON response written as it goes: the body's lists (``choices``) are encoded item by item in a
worker thread and sent in pieces of about ``PIECE_BYTES``, so rank 0 never holds the whole encoded body (a
response with logprobs can be hundreds of MB) and the event loop keeps answering other requests meanwhile.
The bytes are those Starlette's JSONResponse writes (compact separators, UTF-8, NaN refused).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Iterator

from fastapi.responses import StreamingResponse

PIECE_BYTES = 256 << 10


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _pieces(body: dict) -> Iterator[str]:
    yield "{"
    for i, (key, value) in enumerate(body.items()):
        yield f"{',' if i else ''}{_dumps(key)}:"
        if isinstance(value, list):
            yield "["
            for j, item in enumerate(value):
                yield ("," if j else "") + _dumps(item)
            yield "]"
        else:
            yield _dumps(value)
    yield "}"


def _next_piece(it: Iterator[str]) -> bytes:
    out, size = [], 0
    for s in it:
        out.append(s)
        size += len(s)
        if size >= PIECE_BYTES:
            break
    return "".join(out).encode("utf-8")


async def _chunks(body: dict) -> AsyncIterator[bytes]:
    it = _pieces(body)
    while piece := await asyncio.to_thread(_next_piece, it):
        yield piece


def json_response(body: dict) -> StreamingResponse:
    return StreamingResponse(_chunks(body), media_type="application/json")
