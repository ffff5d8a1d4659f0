"""Fault handling between ranks: a step watchdog, and the step-message channel the followers wait on.

* ``Watchdog``: a daemon thread per rank. Code marks ``begin(what)`` / ``end()`` around work that involves
  the other ranks (an engine step); if one piece of work runs past ``timeout_s`` the rank prints a message
  naming itself and the stalled work, and calls ``MPI.COMM_WORLD.Abort(1)`` — which ends every rank, so a
  dead or hung peer never leaves the others waiting forever. (A rank that *dies* is also reported by
  ``mpiexec``, which then ends the job; the watchdog covers the ranks that are still alive but stuck.)
* ``StepChannel``: wraps the engine's communicator so that ``broadcast_obj`` — the one call per step that
  carries rank 0's step message — waits *politely* on the followers: a nonblocking broadcast of the message
  length, polled with short sleeps once it has spun for ~2 ms. An idle server therefore costs no CPU on
  ranks ≠ 0 (a blocking MPICH broadcast busy-polls a whole core), Python signal handlers run while a
  follower waits, and each received message arms the follower's watchdog until the next one arrives.
  Every other attribute is delegated to the wrapped communicator.
"""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

SPIN_S = 0.002          # busy-poll this long before sleeping (keeps step-to-step latency low)
NAP_S = 0.0005          # sleep between polls for the next ~50 ms
SLEEP_S = 0.002         # then sleep this long between polls (idle server)


def abort_job(message: str) -> None:
    """Print ``message`` and end every rank. The short pause lets mpiexec relay the message before the
    abort tears the job down (otherwise it can be lost with the pipe)."""
    try:
        sys.stderr.flush()
        os.write(2, (message.rstrip("\n") + "\n").encode())
    except OSError:
        pass
    time.sleep(0.5)
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(1)


class Watchdog:
    """Abort every rank when one piece of collective work on this rank takes longer than ``timeout_s``."""

    def __init__(self, rank: int, timeout_s: float, abort: Callable[[str], None] = abort_job,
                 poll_s: float | None = None) -> None:
        self.rank, self.timeout_s, self._abort = rank, timeout_s, abort
        self._poll_s = poll_s if poll_s is not None else min(0.5, timeout_s / 4)
        self._lock = threading.Lock()
        self._what: str | None = None
        self._since = 0.0
        self._stop = threading.Event()
        self.fired: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"splash-watchdog-{rank}", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def begin(self, what: str) -> None:
        with self._lock:
            self._what, self._since = what, time.monotonic()

    def end(self) -> None:
        with self._lock:
            self._what = None

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            with self._lock:
                what, since = self._what, self._since
            if what is not None and time.monotonic() - since > self.timeout_s:
                self.fired = (f"splash-serve: rank {self.rank}: {what} has not finished after "
                              f"{self.timeout_s:g}s (server.collective_timeout_s) — a peer rank died or hung "
                              f"in a collective; aborting all ranks")
                self._abort(self.fired)
                return


class StepChannel:
    """The engine's communicator with a polite, watched ``broadcast_obj`` (see the module docstring).

    ``on_signal_grace_s``: once ``signalled`` is set (a follower got SIGINT/SIGTERM), a follower that still
    receives no message from rank 0 within this many seconds aborts the job instead of waiting forever.
    """

    def __init__(self, comm: Any, watchdog: Watchdog | None = None, on_signal_grace_s: float = 30.0) -> None:
        self._comm = comm
        self._watchdog = watchdog
        self.signalled: float | None = None
        self.on_signal_grace_s = on_signal_grace_s
        self.messages = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    def broadcast_obj(self, obj: Any, root: int = 0) -> Any:
        mpi = getattr(self._comm, "mpi_comm", None)
        if mpi is None or self._comm.size == 1:
            return self._comm.broadcast_obj(obj, root)
        if self._watchdog is not None and self.rank != root:
            self._watchdog.end()
        from mpi4py import MPI

        header = np.zeros(1, dtype=np.int64)
        if self.rank == root:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            header[0] = len(data)
            mpi.Ibcast([header, MPI.INT64_T], root=root).Wait()
            mpi.Bcast([np.frombuffer(data, dtype=np.uint8), MPI.BYTE], root=root)
            self.messages += 1
            return obj
        self._wait(mpi.Ibcast([header, MPI.INT64_T], root=root))
        buf = np.empty(int(header[0]), dtype=np.uint8)
        mpi.Bcast([buf, MPI.BYTE], root=root)
        msg = pickle.loads(buf.tobytes())
        self.messages += 1
        if self._watchdog is not None and not (isinstance(msg, dict) and msg.get("kind") == "stop"):
            self._watchdog.begin(f"step message {self.messages} from rank {root}")
        return msg

    def _wait(self, req: Any) -> None:
        t0 = time.monotonic()
        while not req.Test():
            now = time.monotonic()
            waited = now - t0
            if waited < SPIN_S:
                continue
            time.sleep(NAP_S if waited < 0.05 else SLEEP_S)
            if self.signalled is not None and now - self.signalled > self.on_signal_grace_s:
                abort_job(f"splash-serve: rank {self.rank}: got a stop signal but rank 0 sent no stop "
                           f"message within {self.on_signal_grace_s:g}s; aborting all ranks")
