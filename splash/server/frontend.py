"""Rank 0's front end: the asyncio event loop in the main thread runs uvicorn; the engine thread runs steps.

Shutdown (SIGINT/SIGTERM): uvicorn stops accepting connections and lets running requests finish (drain, up to
``DRAIN_S``; a second signal cuts the drain short), then the engine thread aborts whatever is left and
broadcasts ``stop`` to the followers, and rank 0 returns 0.
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
from splash.server.metrics import Metrics
from splash.server.watchdog import Watchdog, abort_job

DRAIN_S = 10.0


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


async def serve(state_kw: dict, engine: Any, sock: socket.socket, console: Console, watchdog: Watchdog | None,
                allowed_layouts: tuple[str, ...], title: str) -> int:
    aio = asyncio.get_running_loop()

    def post(fn: Any) -> None:
        try:
            aio.call_soon_threadsafe(fn)
        except RuntimeError:   # the loop already closed (only at the very end of shutdown)
            pass

    allowed_layouts = tuple(getattr(getattr(engine, "control", None), "allowed", allowed_layouts))  # feasible here
    holder: dict[str, EngineLoop] = {}
    metrics = Metrics(lambda: holder["loop"].snapshot if "loop" in holder else None)
    loop = EngineLoop(engine, post, metrics, watchdog, allowed_layouts, on_fatal=abort_job)
    holder["loop"] = loop
    state = ServerState(loop=loop, metrics=metrics, allowed_layouts=allowed_layouts, **state_kw)
    app = create_app(state)
    quiet = console.quiet or console.live_ok
    config = uvicorn.Config(app, log_level="warning" if quiet else "info", access_log=not quiet,
                            timeout_graceful_shutdown=int(DRAIN_S), lifespan="off", ws="none")
    server = _Server(config)
    old = _install_signals(server)
    loop.start()
    host, port = sock.getsockname()[:2]
    console.log(f"splash-serve: serving {state.model_name} on http://{host}:{port} "
                f"({state.world_size} rank(s), layout {loop.snapshot.layout})")
    console.start_panel(lambda: loop.snapshot, title)
    try:
        await server.serve(sockets=[sock])
    finally:
        console.stop_panel()
        await asyncio.to_thread(loop.stop)
        for sig, handler in old:
            signal.signal(sig, handler)
    console.log("splash-serve: stopped")
    return 0
