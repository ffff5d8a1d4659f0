"""Building large responses off the event loop, in one worker thread (so large bodies are built one at a time,
with bounded memory, and /health keeps answering), and writing a non-streamed JSON body as it goes: its lists
are encoded a slice at a time and sent in pieces of about ``PIECE_BYTES``, so rank 0 never holds the whole
encoded body (one with logprobs can be hundreds of MB). The bytes are those Starlette's JSONResponse writes.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Iterator

from fastapi.responses import StreamingResponse

PIECE_BYTES = 256 << 10
SLICE_ITEMS = 512          # a long list is encoded this many items per json.dumps call (each call holds the GIL)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _pieces(value: Any) -> Iterator[str]:
    """The JSON text of `value` in pieces: no json.dumps call encodes more than SLICE_ITEMS list items."""
    if isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield f"{',' if i else ''}{_dumps(key)}:"
            yield from _pieces(item)
        yield "}"
    elif isinstance(value, list) and len(value) > SLICE_ITEMS:
        yield "["
        for j in range(0, len(value), SLICE_ITEMS):
            yield ("," if j else "") + _dumps(value[j:j + SLICE_ITEMS])[1:-1]
        yield "]"
    elif isinstance(value, list):
        yield "["
        for j, item in enumerate(value):
            yield ","if j else ""
            yield from _pieces(item)
        yield "]"
    else:
        yield _dumps(value)


def _next_piece(it: Iterator[str]) -> bytes:
    out, size = [], 0
    for s in it:
        out.append(s)
        size += len(s)
        if size >= PIECE_BYTES:
            break
    return "".join(out).encode("utf-8")


class ResponseBuilder:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="splash-response")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _chunks(self, body: dict) -> AsyncIterator[bytes]:
        it = _pieces(body)
        while piece := await self.run(_next_piece, it):
            yield piece

    def json_response(self, body: dict) -> StreamingResponse:
        return StreamingResponse(self._chunks(body), media_type="application/json")
