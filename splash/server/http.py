"""Connection-level defences below the ASGI app, and a rate limit for repeated log lines.

``protocol_class`` gives uvicorn an h11 protocol that answers 431 for a header block past ``max_header_bytes``
(h11 would answer a bare 400) and 408 when a request's headers have not arrived within ``header_timeout_s`` of
the accept or of the request's first byte (so idle or slow-drip connections cannot exhaust file descriptors);
it then discards input for a moment before closing, so the client reads the answer rather than a reset. Each
answer written here is passed to ``count(status)`` for ``splash_requests_total``.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from splash.server.protocol import error_body

LINGER_S = 0.5        # keep discarding input this long after the last byte before closing a refused connection
LINGER_MAX_S = 5.0


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps(error_body(message)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    return head + body


class _GuardedH11(H11Protocol):
    max_header_bytes = 32 * 1024
    header_timeout_s = 30.0
    count: Callable[[int], None] = staticmethod(lambda status: None)

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._refused_at: float | None = None
        self._linger: Any = None
        # uvicorn times out idle keep-alive connections only after a first response: start the clock at accept
        self._header_timer: Any = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._refused_at is not None:
            self._keep_lingering()
            return
        if self.conn.their_state is h11.IDLE:
            buffered = self.conn.trailing_data[0]
            if len(buffered) + len(data) > self.max_header_bytes and b"\r\n\r\n" not in (buffered + data)[
                    :self.max_header_bytes + 4]:
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request's header block is larger than {self.max_header_bytes} bytes")
                return
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._linger):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._refuse(408, "Request Timeout", f"the request's headers did not arrive within "
                                                 f"{self.header_timeout_s:g}s (server.read_timeout_s)")

    def send_400_response(self, msg: str) -> None:
        self.count(400)
        super().send_400_response(msg)

    def _refuse(self, status: int, reason: str, message: str) -> None:
        self.count(status)
        self._unset_keepalive_if_required()
        self.transport.write(_raw_response(status, reason, message))
        self._refused_at = time.monotonic()
        self._keep_lingering()

    def _keep_lingering(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
        left = LINGER_MAX_S - (time.monotonic() - self._refused_at)
        self._linger = self.loop.call_later(max(0.0, min(LINGER_S, left)), self.transport.close)


def protocol_class(max_header_bytes: int, header_timeout_s: float, count: Callable[[int], None]) -> type:
    return type("SplashH11Protocol", (_GuardedH11,), {"max_header_bytes": max_header_bytes,
                                                      "header_timeout_s": header_timeout_s,
                                                      "count": staticmethod(count)})


class RateLimitFilter(logging.Filter):
    """At most ``burst`` records per ``window_s`` for each (logger, message template): a flood of bad requests
    writes a few lines, not MBs; the next line let through says how many were dropped."""

    def __init__(self, burst: int = 5, window_s: float = 10.0) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._state: dict[tuple[str, str], list[float | int]] = {}   # key -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        if len(self._state) > 4096:   # many distinct templates (formatted messages): start over
            self._state.clear()
        st = self._state.get(key)
        if st is None or now - st[0] > self.window_s:
            dropped = int(st[2]) if st else 0
            self._state[key] = st = [now, 0, 0]
            if dropped:
                record.msg = f"{record.msg} ({dropped} similar message(s) suppressed)"
        if st[1] >= self.burst:
            st[2] += 1
            return False
        st[1] += 1
        return True


LIMITED_LOGGERS = ("uvicorn.error", "splash.switch", "splash")   # not the access log: one line per request


def install_log_limits() -> RateLimitFilter:
    flt = RateLimitFilter()
    for name in LIMITED_LOGGERS:
        logging.getLogger(name).addFilter(flt)
    return flt
