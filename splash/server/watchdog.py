"""Fault handling between ranks: a heartbeat watchdog, and the step-message channel the followers wait on.

``Watchdog``: every follower keeps a TCP link to rank 0 on which both ends beat every ``interval`` from a daemon
thread (no MPI, so it runs while the main thread sits in a collective). It detects a dead or stuck peer, not a
slow step: a link closed without a goodbye, or ``timeout_s`` (``server.collective_timeout_s``) without a beat,
aborts every rank with a message naming the rank.
``StepChannel``: the engine's communicator with a ``broadcast_obj`` that followers wait on politely (a
nonblocking broadcast of the length, polled with short sleeps after ~2 ms of spinning), so an idle server costs no
CPU on ranks ≠ 0 (MPICH's blocking broadcast busy-polls a core) and signal handlers run while they wait.
"""
from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

SPIN_S = 0.002          # busy-poll this long before sleeping (keeps step-to-step latency low)
NAP_S = 0.0005          # sleep between polls for the next ~50 ms
SLEEP_S = 0.002         # then sleep this long between polls (idle server)


def abort_job(message: str) -> None:
    """Print ``message`` and end every rank (after a pause, so mpiexec relays the message before the abort)."""
    try:
        sys.stderr.flush()
        os.write(2, (message.rstrip("\n") + "\n").encode())
    except OSError:
        pass
    time.sleep(0.5)
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(1)


class Watchdog:
    BEAT, BYE = b".", b"B"

    def __init__(self, rank: int, timeout_s: float, abort: Callable[[str], None] = abort_job,
                 interval_s: float | None = None) -> None:
        self.rank, self.timeout_s, self._abort = rank, timeout_s, abort
        self.interval_s = interval_s if interval_s is not None else min(1.0, timeout_s / 5)
        self._stop = threading.Event()
        self._listen: socket.socket | None = None
        self._peers: dict[int, socket.socket] = {}     # rank -> socket (rank 0: followers; follower: {0: ...})
        self._seen: dict[int, float] = {}
        self._expected: tuple[int, ...] = ()
        self._thread: threading.Thread | None = None

    def serve(self, followers: tuple[int, ...], host: str = "127.0.0.1") -> tuple[str, int]:
        """Rank 0: listen for the followers' links; the address they connect to."""
        self._listen = socket.create_server((host, 0))
        self._listen.setblocking(False)
        self._expected = tuple(followers)
        now = time.monotonic()
        self._seen = dict.fromkeys(self._expected, now)   # a follower must connect within timeout_s too
        self._start()
        return host, self._listen.getsockname()[1]

    def connect(self, address: tuple[str, int]) -> None:
        sock = socket.create_connection(address, timeout=max(5.0, self.timeout_s))
        sock.sendall(struct.pack("!i", self.rank))
        sock.setblocking(False)
        self._peers, self._expected, self._seen = {0: sock}, (0,), {0: time.monotonic()}
        self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"splash-watchdog-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Say goodbye to every peer (so they do not take our exit for a death) and close."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        for sock in list(self._peers.values()):
            try:
                sock.setblocking(True)
                sock.sendall(self.BYE)
            except OSError:
                pass
            sock.close()
        self._peers.clear()
        if self._listen is not None:
            self._listen.close()

    def _run(self) -> None:
        pending: dict[socket.socket, bytes] = {}       # accepted, rank not yet read
        next_beat = 0.0
        while not self._stop.is_set():
            socks = list(self._peers.values()) + list(pending) + ([self._listen] if self._listen else [])
            try:
                readable, _, _ = select.select(socks, [], [], self.interval_s / 2)
            except (OSError, ValueError):
                if self._stop.is_set():
                    return
                raise
            now = time.monotonic()
            for sock in readable:
                if sock is self._listen:
                    self._accept(pending)
                elif sock in pending:
                    self._identify(sock, pending, now)
                elif self._receive(sock, now):
                    return
            if now >= next_beat:
                self._beat()
                next_beat = now + self.interval_s
            if self._check(now):
                return

    def _accept(self, pending: dict[socket.socket, bytes]) -> None:
        try:
            conn, _ = self._listen.accept()
        except OSError:
            return
        conn.setblocking(False)
        pending[conn] = b""

    def _identify(self, sock: socket.socket, pending: dict[socket.socket, bytes], now: float) -> None:
        try:
            data = pending[sock] + sock.recv(4 - len(pending[sock]))
        except OSError:
            data = b""
        if not data:
            pending.pop(sock).close()
            return
        pending[sock] = data
        if len(data) == 4:
            del pending[sock]
            rank = struct.unpack("!i", data)[0]
            self._peers[rank], self._seen[rank] = sock, now

    def _receive(self, sock: socket.socket, now: float) -> bool:
        """Read what a peer sent; True when the watchdog is done (the peer died, or everyone said goodbye)."""
        rank = next(r for r, s in self._peers.items() if s is sock)
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if self.BYE in data:
            self._peers.pop(rank).close()
            self._expected = tuple(r for r in self._expected if r != rank)
            return not self._expected
        if not data:
            return self._fire(f"rank {rank} died (its heartbeat link to rank {self.rank} closed without a goodbye)")
        self._seen[rank] = now
        return False

    def _beat(self) -> None:
        for sock in list(self._peers.values()):
            try:
                sock.send(self.BEAT)
            except OSError:
                pass   # the peer is not reading (stopped) or gone: _check and _receive tell which

    def _check(self, now: float) -> bool:
        for rank in self._expected:
            silent = now - self._seen.get(rank, now)
            if silent > self.timeout_s:
                what = "connected" if rank not in self._peers else "sent a heartbeat"
                return self._fire(f"rank {rank} has not {what} for {silent:.1f}s (server.collective_timeout_s = "
                                  f"{self.timeout_s:g}): it is stopped, hung or unreachable")
        return False

    def _fire(self, why: str) -> bool:
        if self._stop.is_set():
            return True
        self._abort(f"splash-serve: rank {self.rank}: {why}; aborting all ranks")
        return True


class StepChannel:
    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def broadcast_obj(self, obj: Any, root: int = 0) -> Any:
        mpi = getattr(self._comm, "mpi_comm", None)
        if mpi is None or self._comm.size == 1:
            return self._comm.broadcast_obj(obj, root)
        from mpi4py import MPI

        header = np.zeros(1, dtype=np.int64)
        if self.rank == root:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            header[0] = len(data)
            mpi.Ibcast([header, MPI.INT64_T], root=root).Wait()
            mpi.Bcast([np.frombuffer(data, dtype=np.uint8), MPI.BYTE], root=root)
        else:
            self._wait(mpi.Ibcast([header, MPI.INT64_T], root=root))
            buf = np.empty(int(header[0]), dtype=np.uint8)
            mpi.Bcast([buf, MPI.BYTE], root=root)
            return pickle.loads(buf.tobytes())
        return obj

    @staticmethod
    def _wait(req: Any) -> None:
        t0 = time.monotonic()
        while not req.Test():
            waited = time.monotonic() - t0
            if waited < SPIN_S:
                continue
            time.sleep(NAP_S if waited < 0.05 else SLEEP_S)
