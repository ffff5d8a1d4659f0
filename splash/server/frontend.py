"""Rank 0's front end: uvicorn on the asyncio loop in the main thread; the engine thread runs steps.

Shutdown (SIGINT/SIGTERM): new requests get 503 and running ones may finish for ``server.drain_timeout_s`` (a
second signal cuts it short); then the engine thread fails what is left (an error event and ``[DONE]`` per
stream, a 503 body per waiting request) and stops the followers, and uvicorn gets ``FLUSH_S`` to deliver them.
"""
from __future__ import annotations

import asyncio
import signal
import socket
from contextlib import contextmanager
from typing import Any, Iterator

import uvicorn

from splash.server.app import ServerState, create_app
from splash.server.console import Console
from splash.server.engine_loop import EngineLoop
from splash.server.http import install_log_limits, protocol_class
from splash.server.metrics import Metrics
from splash.server.watchdog import Watchdog, abort_job

FLUSH_S = 3.0           # after the drain: time for the error events and 503 bodies to reach the clients
MAX_HEADER_BYTES = 32 * 1024


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture: it re-raises the signal after shutdown (exit -15), we exit 0."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _install_signals(server: _Server) -> list[tuple[int, Any]]:
    def on_signal(signum: int, _frame: Any) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    return [(sig, signal.signal(sig, on_signal)) for sig in (signal.SIGINT, signal.SIGTERM)]


async def _drain(server: _Server, loop: EngineLoop, drain_s: float) -> None:
    """On the first stop signal: drain for up to ``drain_s``, then stop the engine (see the module docstring)."""
    while not server.should_exit:
        await asyncio.sleep(0.05)
    loop.begin_drain()
    deadline = asyncio.get_running_loop().time() + drain_s
    while loop.outstanding and not server.force_exit and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.to_thread(loop.stop)


async def serve(state_kw: dict, engine: Any, sock: socket.socket, console: Console, watchdog: Watchdog | None,
                title: str, max_outstanding: int | None = None) -> int:
    aio = asyncio.get_running_loop()

    def post(fn: Any) -> None:
        try:
            aio.call_soon_threadsafe(fn)
        except RuntimeError:   # the loop already closed (only at the very end of shutdown)
            pass

    metrics = Metrics(lambda: loop.snapshot)   # scraped only once the app below serves, when `loop` is bound
    # engine.control.allowed: the allowed layouts feasible on this model and world size
    loop = EngineLoop(engine, post, metrics, watchdog, engine.control.allowed, abort_job, max_outstanding)
    state = ServerState(loop=loop, metrics=metrics, say=console.log, **state_kw)
    app = create_app(state)
    quiet = console.quiet or console.live_ok
    read_s, drain_s = state.limits.read_timeout_s, state.limits.drain_timeout_s
    config = uvicorn.Config(app, log_level="warning" if quiet else "info", access_log=not quiet,
                            timeout_graceful_shutdown=int(drain_s + FLUSH_S) + 1, lifespan="off",
                            ws="none",
                            http=protocol_class(MAX_HEADER_BYTES, read_s, metrics.count_unrouted),
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES + 1024)
    server = _Server(config)
    old = _install_signals(server)
    install_log_limits()
    loop.start()
    drain = asyncio.ensure_future(_drain(server, loop, drain_s))
    host, port = sock.getsockname()[:2]
    console.log(f"splash-serve: serving {state.model_name} on http://{host}:{port} "
                f"({state.world_size} rank(s), layout {loop.snapshot.layout}"
                f"{', API key required' if state.api_key else ''})")
    console.start_panel(lambda: loop.snapshot, title)
    try:
        await server.serve(sockets=[sock])
    finally:
        drain.cancel()
        console.stop_panel()
        await asyncio.to_thread(loop.stop)
        for sig, handler in old:
            signal.signal(sig, handler)
    console.log("splash-serve: stopped")
    return 0
