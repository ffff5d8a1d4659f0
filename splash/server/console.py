"""What rank 0 shows on the terminal: a progress bar while loading weights, then a live panel (layout, switches,
tokens/s, requests, KV pages per rank). ``quiet``, or a stderr that is not a terminal, gets a few plain log lines
instead, which is what scripts and tests see.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console as RichConsole
from rich.console import Group
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text


class Rate:
    """Tokens/s over a sliding window of snapshots."""

    def __init__(self, window_s: float = 3.0) -> None:
        self.window_s = window_s
        self._points: list[tuple[float, int]] = []

    def update(self, t: float, total: int) -> float:
        self._points.append((t, total))
        while len(self._points) > 2 and t - self._points[0][0] > self.window_s:
            self._points.pop(0)
        (t0, n0), (t1, n1) = self._points[0], self._points[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def _bar(used: int, total: int, width: int = 20) -> str:
    frac = used / total if total else 0.0
    filled = int(round(frac * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {used}/{total} ({100 * frac:.0f}%)"


def _scheduler_line(layout: str, sch: dict) -> str:
    m = sch["model"].get(layout, {})
    parts = []
    if m.get("last_predicted_s") is not None:
        err = m.get("median_error")
        parts.append(f"step predicted {m['last_predicted_s'] * m['factor'] * 1e3:.1f} ms vs measured "
                     f"{m['last_measured_s'] * 1e3:.1f} ms" + (f" (median error {err:.0%})" if err is not None else ""))
    d = sch.get("last_decision")
    if d:
        parts.append(f"last decision: {d['verdict']}" + (f" → {d['target']}" if d.get("target") else "")
                     + f" ({d['reason']})")
    return "; ".join(parts) or "no prediction yet"


def render_panel(snap: object, title: str, tokens_per_s: float, uptime_s: float) -> Panel:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column()
    pending = f" → {snap.target} at the next step" if snap.target and snap.target != snap.layout else ""
    t.add_row("layout", f"[bold]{snap.layout}[/bold]{pending} ({snap.mode}; allowed "
                        f"{', '.join(snap.allowed_layouts)})")
    pairs = ", ".join(f"{a}→{b}: {n}" for (a, b), n in sorted(snap.switch_counts.items())) or "none"
    t.add_row("switches", f"{snap.total_switches} ({pairs})")
    if getattr(snap, "scheduler", None):
        t.add_row("cost model", _scheduler_line(snap.layout, snap.scheduler))
    t.add_row("tokens/s", f"{tokens_per_s:,.1f}   (generated {snap.generated_tokens:,}, steps {snap.steps:,})")
    t.add_row("requests", f"{snap.running} running, {snap.waiting} waiting")
    cap = snap.kv_capacity.get(snap.layout)
    t.add_row("KV tokens", f"{snap.kv_used_tokens:,} used" + (f" of {cap:,} in {snap.layout}" if cap else ""))
    for r, used in enumerate(snap.kv_used_blocks):
        t.add_row(f"KV rank {r}", Text(_bar(used, snap.kv_blocks_per_rank)))
    return Panel(t, title=title, subtitle=f"up {uptime_s:,.0f}s · Ctrl-C to stop", border_style="green")


def _terminal_behind_mpiexec() -> bool:
    """mpiexec relays a rank's output through pipes, so the rank never sees a TTY: assume a terminal under
    mpiexec with a real TERM (``--quiet`` is for scripts); SPLASH_CONSOLE=plain|live overrides the guess."""
    forced = os.environ.get("SPLASH_CONSOLE", "")
    if forced in ("plain", "live"):
        return forced == "live"
    under_mpi = any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))
    return under_mpi and os.environ.get("TERM", "dumb") not in ("", "dumb")


class Console:
    status_every_s = 10.0   # not a terminal: one plain status line this often

    def __init__(self, quiet: bool = False) -> None:
        self.rich = RichConsole(stderr=True)
        if not self.rich.is_terminal and _terminal_behind_mpiexec():
            self.rich = RichConsole(stderr=True, force_terminal=True)
        self.quiet = quiet
        self.live_ok = not quiet and self.rich.is_terminal
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def log(self, message: str) -> None:
        if self.live_ok:   # through rich: a line printed while the live panel runs goes above it, not into it
            self.rich.print(message, markup=False, highlight=False, soft_wrap=True)
        else:
            print(message, file=sys.stderr, flush=True)

    @contextmanager
    def loading(self, what: str, total: int) -> Iterator[Callable[[], None]]:
        """Yields ``advance()``; a progress bar when the live console is on."""
        if not self.live_ok:
            if not self.quiet:
                self.log(f"splash-serve: {what} ({total} tensors)")
            yield lambda: None
            return
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*cols, console=self.rich, transient=False) as progress:
            task = progress.add_task(what, total=total)
            yield lambda: progress.advance(task)

    def start_panel(self, snapshot: Callable[[], object], title: str) -> None:
        if self.quiet:
            return
        self._thread = threading.Thread(target=self._run_panel, args=(snapshot, title), daemon=True,
                                        name="splash-console")
        self._thread.start()

    def stop_panel(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _run_panel(self, snapshot: Callable[[], object], title: str) -> None:
        rate, t0 = Rate(), time.monotonic()

        def frame() -> Group | Panel:
            snap = snapshot()
            if snap is None:
                return Panel("starting…", title=title)
            return render_panel(snap, title, rate.update(time.monotonic(), snap.generated_tokens),
                                time.monotonic() - t0)

        if not self.live_ok:
            while not self._stop.wait(self.status_every_s):
                snap = snapshot()
                if snap is not None:
                    tps = rate.update(time.monotonic(), snap.generated_tokens)
                    self.log(f"splash-serve: layout {snap.layout} ({snap.mode}), {snap.total_switches} switches, "
                             f"{tps:.1f} tok/s, {snap.running} running, {snap.waiting} waiting, "
                             f"KV blocks/rank {snap.kv_used_blocks}/{snap.kv_blocks_per_rank}")
            return
        from rich.live import Live
        with Live(frame(), console=self.rich, refresh_per_second=2, transient=False,
                  redirect_stdout=False, redirect_stderr=False) as live:
            while not self._stop.wait(0.5):
                live.update(frame())
